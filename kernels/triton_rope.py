"""Triton kernel for `kiln::rope` (registered for CUDA): q and k of one token per program.

Each program loads the token's cos/sin row once and rotates every head of q and of k,
optionally normalising each head first (Qwen3's q/k norm), so the op is one launch per
layer. The rotated partner of element d is element (d + D/2) mod D, loaded directly
rather than built with a concatenation. Intermediate products are rounded to the model
dtype where the eager graph rounds them, so bf16 results match the unfused graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.rope import check_rope_args, rope_reference
from kiln.kernels.rope import rope as rope_op
from kiln.kernels.triton_common import num_warps_for, pow2_at_least


@triton.jit
def _rotate_heads(
    x_base, out_base, n_heads, stride_h, w_ptr, c, s, eps,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, H_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
):
    half = HEAD_DIM // 2
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    d_rot = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    h = tl.arange(0, H_PAD)
    mask = (h < n_heads)[:, None] & d_ok[None, :]
    x = tl.load(x_base + h[:, None] * stride_h + d[None, :], mask=mask, other=0.0)
    xr = tl.load(x_base + h[:, None] * stride_h + d_rot[None, :], mask=mask, other=0.0)
    dt = out_base.dtype.element_ty
    if HAS_NORM:
        xf = x.to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + d_rot, mask=d_ok, other=0.0).to(tl.float32)
        x = ((xf * inv_rms[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt)
        xr = ((xr.to(tl.float32) * inv_rms[:, None]).to(dt).to(tl.float32) * wr[None, :]).to(dt)
    a = (x.to(tl.float32) * c[None, :]).to(dt)
    b = (xr.to(tl.float32) * sign[None, :] * s[None, :]).to(dt)
    out = a.to(tl.float32) + b.to(tl.float32)
    tl.store(out_base + h[:, None] * HEAD_DIM + d[None, :], out.to(dt), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
    n_q_heads, n_k_heads, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    c = tl.load(cos_ptr + t * stride_ct + d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=d_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * n_q_heads * HEAD_DIM, n_q_heads, stride_qh,
                  qw_ptr, c, s, eps, HEAD_DIM, D_PAD, HQ_PAD, HAS_NORM)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * n_k_heads * HEAD_DIM, n_k_heads, stride_kh,
                  kw_ptr, c, s, eps, HEAD_DIM, D_PAD, HK_PAD, HAS_NORM)


def rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rope_args(q, k, cos, sin)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope: give both q_norm_weight and k_norm_weight, or neither")
    dtypes = {q.dtype, k.dtype, cos.dtype, sin.dtype}
    if q_norm_weight is not None:
        dtypes |= {q_norm_weight.dtype, k_norm_weight.dtype}
    if len(dtypes) != 1:
        # Mixed dtypes promote in ways the kernel does not mirror; rare enough to leave to torch.
        return rope_reference(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    has_norm = q_norm_weight is not None
    qw = q_norm_weight.contiguous() if has_norm else q
    kw = k_norm_weight.contiguous() if has_norm else k
    d_pad = pow2_at_least(d)
    hq_pad, hk_pad = pow2_at_least(hq), pow2_at_least(hk)
    _rope_kernel[(t,)](
        q, k, cos, sin, qw, kw, q_out, k_out,
        hq, hk, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        HEAD_DIM=d, D_PAD=d_pad, HQ_PAD=hq_pad, HK_PAD=hk_pad, HAS_NORM=has_norm,
        num_warps=num_warps_for(hq_pad * d_pad),
    )
    return q_out, k_out


@rope_op.register_kernel("cuda")
def _rope_cuda(q, k, cos, sin, q_norm_weight, k_norm_weight, eps):
    return rope_triton(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)
