"""Triton kernels for `kiln::rms_norm`, `kiln::add_rms_norm`, their offset and gated forms and
`kiln::add_layer_norm`
(registered for CUDA).

One program normalises one row (the last dimension fits one block: hidden sizes up to
16k). Inputs may be strided views with up to two leading levels of strides, e.g. the q
slice of a merged QKV projection viewed as [T, H, D]; outputs are contiguous. Rounding
follows the eager graph (see `kiln.kernels.rms_norm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.layer_norm import add_layer_norm as add_layer_norm_op
from kiln.kernels.layer_norm import check_layer_norm_args
from kiln.kernels.rms_norm import add_offset_rms_norm as add_offset_rms_norm_op
from kiln.kernels.rms_norm import add_rms_norm as add_rms_norm_op
from kiln.kernels.rms_norm import check_rms_norm_args
from kiln.kernels.rms_norm import gated_rms_norm as gated_rms_norm_op
from kiln.kernels.rms_norm import offset_rms_norm as offset_rms_norm_op
from kiln.kernels.rms_norm import rms_norm as rms_norm_op
from kiln.kernels.triton_common import (NORM_EARLY_WEIGHT, num_warps_for, pdl_launch_args, pow2_at_least,
                                        wait_for_previous_kernel)


@triton.jit
def _rms_norm_row(x_ptr, res_ptr, w_ptr, sum_ptr, row, rows_inner, n_cols, eps,
                  stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY_WEIGHT: tl.constexpr,
                  OFFSET_WEIGHT: tl.constexpr = False, offset=0.0):
    """One program's row: (x, or x + residual as stored to sum_ptr; its RMSNorm times the
    weight in float32, unrounded; the columns; their mask). With EARLY_WEIGHT the norm weight
    is loaded before the PDL wait (it is no earlier kernel's output; triton_common). With
    OFFSET_WEIGHT (`kiln::offset_rms_norm`) the norm is not rounded before it meets
    offset + weight."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if EARLY_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wait_for_previous_kernel(PDL)
    outer = row // rows_inner
    inner = row % rows_inner
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
        # Rounded to the residual stream's dtype before normalising, as the eager add is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    normed = xf * tl.math.rsqrt(variance + eps)
    if not EARLY_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if OFFSET_WEIGHT:
        return x, normed * (offset + w.to(tl.float32)), cols, mask
    return x, normed.to(x.dtype).to(tl.float32) * w.to(tl.float32), cols, mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    rows_inner, n_cols, eps,
    stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False, EARLY_WEIGHT: tl.constexpr = False, OFFSET_WEIGHT: tl.constexpr = False, offset=0.0,
):
    row = tl.program_id(0)
    _, out, cols, mask = _rms_norm_row(x_ptr, res_ptr, w_ptr, sum_ptr, row, rows_inner, n_cols, eps,
                                       stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
                                       HAS_RESIDUAL, BLOCK, PDL, EARLY_WEIGHT, OFFSET_WEIGHT, offset)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr, rows_inner, n_cols, eps,
    stride_x_outer, stride_x_inner, stride_g_outer, stride_g_inner,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False, EARLY_WEIGHT: tl.constexpr = False,
):
    """`kiln::gated_rms_norm`: the RMSNorm row times the weight, rounded to x's dtype as the
    eager product is, times SiLU(gate) in float32."""
    row = tl.program_id(0)
    x, out, cols, mask = _rms_norm_row(x_ptr, x_ptr, w_ptr, out_ptr, row, rows_inner, n_cols, eps,
                                       stride_x_outer, stride_x_inner, 0, 0, False, BLOCK, PDL, EARLY_WEIGHT)
    gate = tl.load(gate_ptr + row // rows_inner * stride_g_outer + row % rows_inner * stride_g_inner + cols,
                   mask=mask, other=0.0).to(tl.float32)
    out = out.to(x.dtype).to(tl.float32) * (gate * tl.sigmoid(gate))
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [outer, inner, N] with a unit last stride, without copying when strides allow."""
    n = x.shape[-1]
    if x.dim() == 1:
        x = x.view(1, n)
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-2], n)
    except RuntimeError:  # leading dimensions not mergeable: one copy
        return x.reshape(-1, n).unsqueeze(0)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            offset: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both norms' launch; `offset` (not None): `kiln::offset_rms_norm`'s form, out in x's dtype."""
    n = x.shape[-1]
    summed_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = summed_dtype if offset is not None else torch.promote_types(summed_dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=summed_dtype, device=x.device)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out, summed
    x3 = _rows_view(x)
    r3 = _rows_view(residual) if residual is not None else x3
    if r3.shape != x3.shape:  # views differ in how the leading dims fold: align the residual
        r3 = residual.reshape(x3.shape)
    block = pow2_at_least(n)
    _rms_norm_kernel[(rows,)](
        x3, r3, weight.contiguous(), out, summed if summed is not None else out,
        x3.shape[1], n, float(eps),
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block),
        EARLY_WEIGHT=NORM_EARLY_WEIGHT, OFFSET_WEIGHT=offset is not None, offset=float(offset or 0.0),
        **pdl_launch_args(x.device, "norm"),
    )
    return out, summed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None  # always made when a residual is given
    return out, summed


@rms_norm_op.register_kernel("cuda")
def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm_args(x, weight)
    return rms_norm_triton(x, weight, eps)


@add_rms_norm_op.register_kernel("cuda")
def _add_rms_norm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    return add_rms_norm_triton(x, residual, weight, eps)


@triton.jit
def _add_layer_norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, sum_ptr,
    rows_inner, n_cols, eps,
    stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    outer = row // rows_inner
    inner = row % rows_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    r = tl.load(res_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
    # Rounded to the residual stream's dtype before normalising, as the eager add is.
    s = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * n_cols + cols, s, mask=mask)
    sf = s.to(tl.float32)
    mean = tl.sum(sf, axis=0) / n_cols
    centered = tl.where(mask, sf - mean, 0.0)
    variance = tl.sum(centered * centered, axis=0) / n_cols
    out = centered * tl.math.rsqrt(variance + eps)
    if HAS_WEIGHT:
        out = out * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out = out + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_layer_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                          bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=summed_dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=summed_dtype, device=x.device)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out, summed
    x3 = _rows_view(x)
    r3 = _rows_view(residual)
    if r3.shape != x3.shape:  # views differ in how the leading dims fold: align the residual
        r3 = residual.reshape(x3.shape)
    block = pow2_at_least(n)
    w = weight.contiguous() if weight is not None else out
    b = bias.contiguous() if bias is not None else out
    _add_layer_norm_kernel[(rows,)](
        x3, r3, w, b, out, summed,
        x3.shape[1], n, float(eps),
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK=block, num_warps=num_warps_for(block),
        **pdl_launch_args(x.device, "norm"),
    )
    return out, summed


@add_layer_norm_op.register_kernel("cuda")
def _add_layer_norm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_layer_norm_args(x, residual, weight, bias)
    return add_layer_norm_triton(x, residual, weight, bias, eps)


def offset_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return _launch(x, None, weight, eps, offset)[0]


def add_offset_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _launch(x, residual, weight, eps, offset)
    if summed is None:  # always made when a residual is given
        raise RuntimeError("add_offset_rms_norm: no residual sum")
    return out, summed


@offset_rms_norm_op.register_kernel("cuda")
def _offset_rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    check_rms_norm_args(x, weight)
    return offset_rms_norm_triton(x, weight, eps, offset)


@add_offset_rms_norm_op.register_kernel("cuda")
def _add_offset_rms_norm_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    return add_offset_rms_norm_triton(x, residual, weight, eps, offset)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out
    x3 = _rows_view(x)
    g3 = _rows_view(gate)
    if g3.shape != x3.shape:  # views differ in how the leading dims fold: align the gate
        g3 = gate.reshape(x3.shape)
    block = pow2_at_least(n)
    _gated_rms_norm_kernel[(rows,)](
        x3, g3, weight.contiguous(), out, x3.shape[1], n, float(eps),
        x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1),
        BLOCK=block, num_warps=num_warps_for(block), EARLY_WEIGHT=NORM_EARLY_WEIGHT,
        **pdl_launch_args(x.device, "norm"),
    )
    return out


@gated_rms_norm_op.register_kernel("cuda")
def _gated_rms_norm_cuda(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm_args(x, weight)
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} and x {tuple(x.shape)} differ in shape")
    return gated_rms_norm_triton(x, gate, weight, eps)
