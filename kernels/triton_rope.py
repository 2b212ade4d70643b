"""Triton kernel for `kiln::rope` (registered for CUDA): q and k of one token per program.

Each program loads the token's cos/sin row once and rotates every head of q and of k,
optionally normalising each head first (Qwen3's q/k norm), so the op is one launch per
layer. The rotated partner of element d is element (d + D/2) mod D, loaded directly
rather than built with a concatenation. Intermediate products are rounded to the model
dtype where the eager graph rounds them, so bf16 results match the unfused graph.

That rounding only survives compilation with floating-point contraction off
(`COMPILE_OPTIONS`): with it on (Triton's default), LLVM narrows `x * cos` rounded to bf16
and the following add into one `fma.rn.bf16`, which skips the product's rounding: about
17% of bf16 outputs then differed from the eager graph's (measured on an H200).
The interpreter (numpy) never contracts, so only a compiled kernel shows it;
tests/test_kernels_triton.py compiles this kernel for sm_90 and checks its PTX.

For `kiln::rope_paged_attention` the same kernel writes the rotated keys and the values
straight into their KV-cache slots (`write_kv`), replacing the separate cache write; into
an FP8 (e4m3) cache too, divided by the layer's k/v scales in float32 and cast with
saturation, as the reference's write does (before, an FP8 cache fell back to torch's RoPE
and write: ~20 launches a layer, ~1 ms of a 5 ms decode step on the H200, run H1).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch
import triton
import triton.language as tl

from kiln.kernels.paged_attention import kv_amax_recording, write_kv_cache
from kiln.kernels.rope import check_rope_args, rope_reference, rotated_for_attention
from kiln.kernels.rope import rope as rope_op
from kiln.kernels.triton_common import num_warps_for, pdl_launch_args, pow2_at_least, wait_for_previous_kernel

# Launch options of `_rope_kernel`: no FMA contraction, so the products rounded to the
# model dtype (as the eager graph's separate mul and add kernels round them) stay rounded.
COMPILE_OPTIONS: Mapping[str, bool] = MappingProxyType({"enable_fp_fusion": False})


@triton.jit
def mul_rounded(a, b, NO_CONTRACT: tl.constexpr):
    """a * b in float32, rounded on its own. With NO_CONTRACT (CUDA only: inline assembly, not
    interpreted) by `mul.rn.f32`, which no compiler fuses with a later add: kernels that keep
    floating-point contraction on for the rest of their math use it (see the module doc)."""
    if NO_CONTRACT:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return a * b


@triton.jit
def rotate_rounded(x, x_partner, cos, signed_sin, NO_CONTRACT: tl.constexpr = False):
    """RoPE of x (any shape, the model dtype) given each element's rotation partner (element
    (d + D/2) mod D), cos and sin broadcast to it as float32, sin negated for d < D/2: the
    eager graph's x * cos + rotate_half(x) * sin, rounded to the model dtype where it rounds."""
    dt = x.dtype
    a = mul_rounded(x.to(tl.float32), cos, NO_CONTRACT).to(dt)
    b = mul_rounded(x_partner.to(tl.float32), signed_sin, NO_CONTRACT).to(dt)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dt)


@triton.jit
def inv_rms_rounded(x, eps, axis: tl.constexpr, HEAD_DIM: tl.constexpr, NO_CONTRACT: tl.constexpr = False):
    """1 / rms of each head of x along `axis` (its head dimension; padded elements 0), float32,
    each square rounded on its own (`mul_rounded`)."""
    xf = x.to(tl.float32)
    return tl.math.rsqrt(tl.sum(mul_rounded(xf, xf, NO_CONTRACT), axis=axis) / HEAD_DIM + eps)


@triton.jit
def rms_normed_rounded(x, inv_rms, w, NO_CONTRACT: tl.constexpr = False):
    """Qwen3's per-head q/k norm of x (the model dtype) given its 1/rms and the norm weight
    (both float32, broadcast to x): rounded to the model dtype after each product, as the
    eager graph's separate ops round."""
    dt = x.dtype
    return mul_rounded(mul_rounded(x.to(tl.float32), inv_rms, NO_CONTRACT).to(dt).to(tl.float32), w,
                        NO_CONTRACT).to(dt)


@triton.jit
def _rotate_heads(
    x_base, out_base, n_heads, stride_h, out_stride_h, w_ptr, c, s, eps, scale_ptr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, H_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
    SCALED: tl.constexpr, ROT_DIM: tl.constexpr, F32_TABLES: tl.constexpr = False,
):
    """Each head's first ROT_DIM dims rotated (partial rotary: the rest pass as they are).
    F32_TABLES: cos/sin are float32 beside 16-bit heads (the OLMo family's graph), whose
    products and sum are float32, rounded once, where they are stored."""
    half = ROT_DIM // 2
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    d_rot = tl.where(d < half, d + half, tl.where(d < ROT_DIM, d - half, d))
    sign = tl.where(d < half, -1.0, 1.0)
    h = tl.arange(0, H_PAD)
    mask = (h < n_heads)[:, None] & d_ok[None, :]
    x = tl.load(x_base + h[:, None] * stride_h + d[None, :], mask=mask, other=0.0)
    xr = tl.load(x_base + h[:, None] * stride_h + d_rot[None, :], mask=mask, other=0.0)
    dt = x_base.dtype.element_ty  # the model dtype, where the eager graph rounds
    if HAS_NORM:
        inv_rms = inv_rms_rounded(x, eps, 1, HEAD_DIM)
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + d_rot, mask=d_ok, other=0.0).to(tl.float32)
        x = rms_normed_rounded(x, inv_rms[:, None], w[None, :])
        xr = rms_normed_rounded(xr, inv_rms[:, None], wr[None, :])
    if F32_TABLES:
        out = x.to(tl.float32) * c[None, :] + xr.to(tl.float32) * (sign * s)[None, :]
    else:
        out = rotate_rounded(x, xr, c[None, :], (sign * s)[None, :])
    if ROT_DIM < HEAD_DIM:
        out = tl.where((d < ROT_DIM)[None, :], out, x.to(out.dtype))
    if SCALED:
        # An FP8 cache holds k / k_scale: the rotated key rounded to the model dtype first,
        # then divided in float32 (as the reference's write), then the cast saturates.
        out = out.to(dt).to(tl.float32) / tl.load(scale_ptr)
    tl.store(out_base + h[:, None] * out_stride_h + d[None, :], out.to(out_base.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr,
    n_q_heads, n_k_heads, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, stride_vt, stride_vh,
    stride_c_blk, stride_c_off, stride_c_h,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr, WRITE_KV: tl.constexpr, CACHE_BLOCK: tl.constexpr, KV_SCALE: tl.constexpr,
    PDL: tl.constexpr = False, ROT_DIM: tl.constexpr = -1, F32_TABLES: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    ROTATED: tl.constexpr = HEAD_DIM if ROT_DIM < 0 else ROT_DIM  # cos/sin's width
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    c = tl.load(cos_ptr + t * stride_ct + d, mask=d < ROTATED, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=d < ROTATED, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * n_q_heads * HEAD_DIM, n_q_heads, stride_qh, HEAD_DIM,
                  qw_ptr, c, s, eps, kv_scale_ptr, HEAD_DIM, D_PAD, HQ_PAD, HAS_NORM, False, ROTATED, F32_TABLES)
    if WRITE_KV:
        # The rotated key and the value go straight to the token's cache slot.
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dest = (slot // CACHE_BLOCK) * stride_c_blk + (slot % CACHE_BLOCK) * stride_c_off
        _rotate_heads(k_ptr + t * stride_kt, k_cache_ptr + dest, n_k_heads, stride_kh, stride_c_h,
                      kw_ptr, c, s, eps, kv_scale_ptr, HEAD_DIM, D_PAD, HK_PAD, HAS_NORM, KV_SCALE, ROTATED,
                      F32_TABLES)
        h = tl.arange(0, HK_PAD)
        mask = (h < n_k_heads)[:, None] & d_ok[None, :]
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        if KV_SCALE:
            v = v.to(tl.float32) / tl.load(kv_scale_ptr + 1)
        tl.store(v_cache_ptr + dest + h[:, None] * stride_c_h + d[None, :], v.to(v_cache_ptr.dtype.element_ty),
                 mask=mask)
    else:
        _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * n_k_heads * HEAD_DIM, n_k_heads, stride_kh, HEAD_DIM,
                      kw_ptr, c, s, eps, kv_scale_ptr, HEAD_DIM, D_PAD, HK_PAD, HAS_NORM, False, ROTATED,
                      F32_TABLES)


def f32_tables(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm_weight: torch.Tensor | None) -> bool:
    """float32 cos/sin beside 16-bit q/k and no q/k norm: the OLMo family's RoPE, whose graph
    computes the rotation in float32 and casts it back (the kernel's F32_TABLES)."""
    return (cos.dtype == sin.dtype == torch.float32 and q.dtype in (torch.bfloat16, torch.float16)
            and q_norm_weight is None)


def rope_kernel_applies(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None, write_kv: tuple | None,
) -> bool:
    """Whether a Triton kernel rotates these (else torch's reference does, then the write):
    one dtype throughout (or float32 cos/sin beside 16-bit heads without q/k norms:
    `f32_tables`), a KV cache whose last dimension is contiguous, and no KV-scale calibration
    under way for an FP8 cache."""
    dtypes = {q.dtype, k.dtype} | ({cos.dtype, sin.dtype} if not f32_tables(q, cos, sin, q_norm_weight) else set())
    if q_norm_weight is not None and k_norm_weight is not None:
        dtypes |= {q_norm_weight.dtype, k_norm_weight.dtype}
    if write_kv is None:
        return len(dtypes) == 1
    # An FP8 cache is written by the kernel too (the rotated k rounded in its own dtype, then
    # divided by its scale and cast, as the reference's write_kv_cache does).
    fp8_cache = write_kv[1].dtype == torch.float8_e4m3fn
    dtypes |= {write_kv[0].dtype} if fp8_cache else {write_kv[0].dtype, write_kv[1].dtype}
    # Mixed dtypes promote in ways the kernel does not mirror; rare enough to leave to torch.
    # Start-up's KV-scale calibration records the rotated keys' amax: torch's path, once.
    return len(dtypes) == 1 and write_kv[1].stride(-1) == 1 and not (fp8_cache and kv_amax_recording())


def rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    write_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q and k (the first cos.shape[-1] dims of each head: partial rotary where that is
    under D). With `write_kv=(v, kv_cache, slot_mapping[, kv_scale])` the rotated k and v are
    written into the cache instead of returned (k_out is then None), and the rotated q comes
    back in q's dtype, for the attention (`kiln::rope_paged_attention`); without it in the
    op's dtype, q's promoted with cos's (float32 for the OLMo family's float32 tables)."""
    check_rope_args(q, k, cos, sin, partial=True)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope: give both q_norm_weight and k_norm_weight, or neither")
    kv_scale = write_kv[3] if write_kv is not None and len(write_kv) > 3 else None
    fp8_cache = write_kv is not None and write_kv[1].dtype == torch.float8_e4m3fn
    if not rope_kernel_applies(q, k, cos, sin, q_norm_weight, k_norm_weight, write_kv):
        q_out, k_out = rope_reference(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)
        if write_kv is None:
            return q_out, k_out
        q_out, k_out = rotated_for_attention(q_out, k_out, q, k, q_norm_weight)
        write_kv_cache(k_out, write_kv[0], write_kv[1], write_kv[2], kv_scale)
        return q_out, None
    t, hq, d = q.shape
    hk = k.shape[1]
    tables_f32 = f32_tables(q, cos, sin, q_norm_weight)
    out_dtype = torch.float32 if tables_f32 and write_kv is None else q.dtype
    q_out = torch.empty((t, hq, d), dtype=out_dtype, device=q.device)
    k_out = torch.empty((t, hk, d), dtype=out_dtype, device=k.device) if write_kv is None else None
    if t == 0:
        return q_out, k_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    has_norm = q_norm_weight is not None
    qw = q_norm_weight.contiguous() if has_norm else q
    kw = k_norm_weight.contiguous() if has_norm else k
    if write_kv is not None:
        v, kv_cache, slot_mapping = write_kv[:3]
        kv_scale = kv_scale if fp8_cache else None  # a cache of the compute dtype: no scale applies
        v = v if v.stride(-1) == 1 else v.contiguous()
        k_cache, v_cache = kv_cache[0], kv_cache[-1]  # (a one-plane cache: V is K)
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        cache_block = kv_cache.shape[2]
    else:
        v, k_cache, v_cache, slot_mapping, kv_scale = k, k_out, k_out, q, None  # unused placeholders
        cache_strides, cache_block = (0, 0, 0), 1
    d_pad = pow2_at_least(d)
    hq_pad, hk_pad = pow2_at_least(hq), pow2_at_least(hk)
    _rope_kernel[(t,)](
        q, k, cos, sin, qw, kw, q_out, k_out if k_out is not None else q_out,
        v, k_cache, v_cache, slot_mapping, kv_scale if kv_scale is not None else q,
        hq, hk, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), v.stride(0), v.stride(1),
        *cache_strides,
        HEAD_DIM=d, D_PAD=d_pad, HQ_PAD=hq_pad, HK_PAD=hk_pad, HAS_NORM=has_norm,
        WRITE_KV=write_kv is not None, CACHE_BLOCK=cache_block, KV_SCALE=kv_scale is not None,
        ROT_DIM=cos.shape[-1] if cos.shape[-1] < d else -1, F32_TABLES=tables_f32,
        num_warps=num_warps_for(hq_pad * d_pad), **COMPILE_OPTIONS, **pdl_launch_args(q.device, "rope"),
    )
    return q_out, k_out


@rope_op.register_kernel("cuda")
def _rope_cuda(q, k, cos, sin, q_norm_weight, k_norm_weight, eps):
    return rope_triton(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)
