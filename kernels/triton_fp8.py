"""Triton kernels for `kiln::quantize_fp8_per_token` and the fused `kiln::rms_norm_quant_fp8`,
`kiln::add_rms_norm_quant_fp8`, `kiln::silu_and_mul_quant_fp8` (and the offset norm form of the
first two, and Gemma's GeGLU form of the third), and a GEMV for
`kiln::fp8_linear` at decode-sized inputs (all registered for CUDA).

The plain-torch reference is five launches (abs, amax, multiply, clamp, cast) and reads the
activation twice from memory at full precision; this kernel is one launch, one program per
token row: a first loop over K finds max|x|, a second writes x * (1 / scale) as e4m3 (the row
is read twice, the second time mostly from L2). `kiln::fp8_linear` is `torch._scaled_mm`
(cuBLASLt's FP8 GEMM with row-wise scales) except at 1-16 rows (the GEMV below).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from kiln.kernels.activation import gelu_tanh_and_mul_reference, silu_and_mul_reference
from kiln.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, check_fp8_linear_args, fp8_linear_reference
from kiln.kernels.fp8 import fp8_linear as fp8_linear_op
from kiln.kernels.fp8 import add_offset_rms_norm_quant_fp8 as add_offset_rms_norm_quant_op
from kiln.kernels.fp8 import add_rms_norm_quant_fp8 as add_rms_norm_quant_op
from kiln.kernels.fp8 import gelu_tanh_and_mul_quant_fp8 as gelu_tanh_and_mul_quant_op
from kiln.kernels.fp8 import offset_rms_norm_quant_fp8 as offset_rms_norm_quant_op
from kiln.kernels.fp8 import quantize_fp8_per_token as quantize_op
from kiln.kernels.fp8 import quantize_fp8_rows as quantize_fp8_rows_ref
from kiln.kernels.fp8 import rms_norm_quant_fp8 as rms_norm_quant_op
from kiln.kernels.fp8 import silu_and_mul_quant_fp8 as silu_and_mul_quant_op
from kiln.kernels.rms_norm import check_rms_norm_args
from kiln.kernels.triton_activation import _rows, gated_activation
from kiln.kernels.triton_common import (GEMV_EARLY_TILE, NORM_EARLY_WEIGHT, max_shared_memory, num_warps_for,
                                        pdl_launch_args, pow2_at_least, split_k_counters, split_k_sum,
                                        wait_for_previous_kernel)
from kiln.kernels.triton_linear import DOT_BLOCK_M, GemvConfig, fit_block_k, fit_shared_memory
from kiln.kernels.triton_norm import _rms_norm_row, _rows_view


@triton.jit
def _reciprocal(scale):
    """1 / scale, IEEE-rounded as the reference's (Triton's `/` is an approximation). The
    kernels multiply each element by it, as `quantize_fp8_rows` does: a division per element
    (div_rn) bound them by arithmetic."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, xq_ptr, scale_ptr, pairs_ptr, num_pairs, K, stride_x, FP8_MAX_C: tl.constexpr,
                          MIN_SCALE_C: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Row `row` of x quantized per row; with TOP_K > 0 (quantize_fp8_gathered_rows_triton) the
    row of pair pairs[row]'s token instead (unread without)."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = row
    if TOP_K > 0:
        pair = tl.load(pairs_ptr + row).to(tl.int64)
        src = tl.where(pair < num_pairs, pair // TOP_K, 0)
    x_row = x_ptr + src * stride_x
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_C, MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    inv = _reciprocal(scale)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x * inv, -FP8_MAX_C), FP8_MAX_C)
        tl.store(xq_ptr + row * K + ks, q.to(xq_ptr.dtype.element_ty), mask=ks < K)


def quantize_fp8_per_token_triton(x: torch.Tensor, block_k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() < 1:
        raise ValueError("quantize_fp8_per_token: x must have at least one dimension")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    xq = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(block_k, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x2, xq, scale, scale, 0, k, x2.stride(0), FP8_MAX_C=FP8_MAX,  # (no pairs)
                                    MIN_SCALE_C=MIN_SCALE, BLOCK_K=block, TOP_K=0, num_warps=4,
                                    **pdl_launch_args(x.device, "fp8_quant"))
    return xq.view(x.shape), scale.view(*x.shape[:-1], 1)


def quantize_fp8_gathered_rows_triton(x: torch.Tensor, pairs: torch.Tensor, num_pairs: int, top_k: int,
                                      block_k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of x [T, K] gathered by MoE pairs: row r of the result is token
    pairs[r] // top_k's row quantized (pairs[r] >= num_pairs, a padding row: token 0's), with its
    scale [R] float32. The W8A8 MoE kernels' input in expert order, in one launch; the same
    values as `quantize_fp8_per_token` then `index_select` (three launches, more for the
    indices)."""
    if x.dim() != 2 or pairs.dim() != 1 or top_k < 1:
        raise ValueError(f"quantize_fp8_gathered_rows: x [T, K], pairs [R], top_k >= 1; got x {tuple(x.shape)}, "
                         f"pairs {tuple(pairs.shape)}, top_k {top_k}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = pairs.shape[0], x.shape[1]
    xq = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows and k:
        _quantize_rows_kernel[(rows,)](x, xq, scale, pairs, num_pairs, k, x.stride(0), FP8_MAX_C=FP8_MAX,
                                       MIN_SCALE_C=MIN_SCALE, BLOCK_K=min(block_k, triton.next_power_of_2(k)),
                                       TOP_K=top_k, num_warps=4, **pdl_launch_args(x.device, "fp8_quant"))
    return xq, scale


@quantize_op.register_kernel("cuda")
def _quantize_fp8_per_token_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_token_triton(x)


# ---- quantization fused into RMSNorm and SiLU-and-mul ------------------------------------------

@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, xq_ptr, scale_ptr, sum_ptr,
    rows_inner, n_cols, eps,
    stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
    FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False, EARLY_WEIGHT: tl.constexpr = False,
    OFFSET_WEIGHT: tl.constexpr = False, offset=0.0,
):
    # kiln.kernels.triton_norm's RMSNorm (one row per program, the row in one block), then the
    # row's e4m3 quantization while it is still in registers: the normed row never goes to memory.
    # OFFSET_WEIGHT: `kiln::offset_rms_norm`'s form.
    row = tl.program_id(0)
    x, out, cols, mask = _rms_norm_row(x_ptr, res_ptr, w_ptr, sum_ptr, row, rows_inner, n_cols, eps,
                                       stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
                                       HAS_RESIDUAL, BLOCK, PDL, EARLY_WEIGHT, OFFSET_WEIGHT, offset)
    # Rounded to the norm's output dtype, as the unfused graph's rms_norm output is.
    out = out.to(x.dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.where(mask, tl.abs(out), 0.0), axis=0) / FP8_MAX_C, MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    q = tl.minimum(tl.maximum(out * _reciprocal(scale), -FP8_MAX_C), FP8_MAX_C)
    tl.store(xq_ptr + row * n_cols + cols, q.to(xq_ptr.dtype.element_ty), mask=mask)


def _norm_quant_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       offset: float | None = None):
    """Both norm forms' launch: `offset` (not None) the offset form."""
    n = x.shape[-1]
    xq = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                                                       device=x.device)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return xq, scale, summed
    x3 = _rows_view(x)
    r3 = _rows_view(residual) if residual is not None else x3
    if r3.shape != x3.shape:
        r3 = residual.reshape(x3.shape)
    block = pow2_at_least(n)
    _rms_norm_quant_kernel[(rows,)](
        x3, r3, weight.contiguous(), xq, scale, summed if summed is not None else xq,
        x3.shape[1], n, float(eps), x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=num_warps_for(block), EARLY_WEIGHT=NORM_EARLY_WEIGHT, OFFSET_WEIGHT=offset is not None,
        offset=float(offset or 0.0), **pdl_launch_args(x.device, "fp8_quant"),
    )
    return xq, scale, summed


def rms_norm_quant_fp8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xq, scale, _ = _norm_quant_launch(x, None, weight, eps)
    return xq, scale


def add_rms_norm_quant_fp8_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xq, scale, summed = _norm_quant_launch(x, residual, weight, eps)
    return xq, scale, summed


def offset_rms_norm_quant_fp8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    xq, scale, _ = _norm_quant_launch(x, None, weight, eps, offset=offset)
    return xq, scale


def add_offset_rms_norm_quant_fp8_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                         offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_quant_launch(x, residual, weight, eps, offset=offset)


@triton.jit
def _silu_and_mul_block(gate_ptr, up_ptr, row, stride_g, stride_u, cols, mask, GELU_TANH: tl.constexpr = False):
    """act(g) * u for the columns `cols` of a row (SiLU, or with GELU_TANH Gemma's GELU), in
    float32, each product rounded to the activation dtype as kiln::silu_and_mul's output is."""
    dt = gate_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    return (gated_activation(g, GELU_TANH).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(gate_ptr, up_ptr, xq_ptr, scale_ptr, n_cols, stride_g, stride_u,
                               FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, BLOCK: tl.constexpr,
                               ONE_PASS: tl.constexpr, PDL: tl.constexpr = False, GELU_TANH: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    # One program per row; the row's max|act(g) * u| sets its scale (act: SiLU, or GELU_TANH).
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        # The whole row in one block (BLOCK >= n_cols): one load of gate and up, the products
        # kept in registers for the quantization.
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _silu_and_mul_block(gate_ptr, up_ptr, row, stride_g, stride_u, cols, mask, GELU_TANH)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX_C, MIN_SCALE_C)
        tl.store(scale_ptr + row, scale)
        q = tl.minimum(tl.maximum(y * _reciprocal(scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(xq_ptr + row * n_cols + cols, q.to(xq_ptr.dtype.element_ty), mask=mask)
    else:
        # A first pass over the columns finds the row's max, a second recomputes the products
        # (gate and up mostly from L2 by then) and writes them as e4m3.
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            y = _silu_and_mul_block(gate_ptr, up_ptr, row, stride_g, stride_u, cols, cols < n_cols, GELU_TANH)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_C, MIN_SCALE_C)
        tl.store(scale_ptr + row, scale)
        inv = _reciprocal(scale)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            y = _silu_and_mul_block(gate_ptr, up_ptr, row, stride_g, stride_u, cols, mask, GELU_TANH)
            q = tl.minimum(tl.maximum(y * inv, -FP8_MAX_C), FP8_MAX_C)
            tl.store(xq_ptr + row * n_cols + cols, q.to(xq_ptr.dtype.element_ty), mask=mask)


# One program per row. The whole row in one block (one pass: gate and up read once, the
# products kept in registers for the quantization) is faster at every row count measured on
# the H200 (14,336 columns, CUDA graphs; bench/RESULTS.md, M2): 6.9 against 14.1 us at 1 row,
# 34 against 45 at 929, 468 against 509 at 16,384. The two-pass loop (blocks of 1,024: the row
# read twice, the second time partly from L2) is kept for rows wider than ONE_PASS_MAX_COLS.
ONE_PASS_MAX_COLS = 32768


def silu_and_mul_quant_plan(rows: int, n_cols: int, block: int = 1024,
                            one_pass: bool | None = None) -> tuple[bool, int, int]:
    """(one pass, BLOCK, num_warps) for `rows` rows of `n_cols` products; from shapes only,
    so a launch can be captured in a CUDA graph (the row count no longer changes the choice:
    see above). `one_pass` forces the kind (tests)."""
    whole = triton.next_power_of_2(n_cols)
    if one_pass is None:
        one_pass = whole <= ONE_PASS_MAX_COLS
    if one_pass:
        return True, whole, 16 if whole >= 8192 else 8 if whole >= 2048 else 4
    return False, min(block, whole), 4


def silu_and_mul_quant_fp8_triton(gate: torch.Tensor, up: torch.Tensor, block: int = 1024,
                                  one_pass: bool | None = None, gelu_tanh: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 silu(gate) * up (with `gelu_tanh`, Gemma's GELU(gate) * up) with one scale per row;
    `one_pass` overrides the plan (tests)."""
    name = "gelu_tanh_and_mul_quant_fp8" if gelu_tanh else "silu_and_mul_quant_fp8"
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.dtype != up.dtype:
        return quantize_fp8_rows_ref((gelu_tanh_and_mul_reference if gelu_tanh else silu_and_mul_reference)(gate, up))
    n = gate.shape[-1]
    xq = torch.empty(gate.shape, dtype=FP8_DTYPE, device=gate.device)
    scale = torch.empty((*gate.shape[:-1], 1), dtype=torch.float32, device=gate.device)
    if xq.numel() == 0:
        return xq, scale
    g2, u2 = _rows(gate), _rows(up)
    planned, block_size, num_warps = silu_and_mul_quant_plan(g2.shape[0], n, block, one_pass)
    _silu_and_mul_quant_kernel[(g2.shape[0],)](g2, u2, xq, scale, n, g2.stride(0), u2.stride(0),
                                               FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
                                               BLOCK=block_size, ONE_PASS=planned, num_warps=num_warps,
                                               GELU_TANH=gelu_tanh, **pdl_launch_args(gate.device, "fp8_quant"))
    return xq, scale


def gelu_tanh_and_mul_quant_fp8_triton(gate: torch.Tensor, up: torch.Tensor, block: int = 1024,
                                       one_pass: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return silu_and_mul_quant_fp8_triton(gate, up, block, one_pass, gelu_tanh=True)


@rms_norm_quant_op.register_kernel("cuda")
def _rms_norm_quant_fp8_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight)
    return rms_norm_quant_fp8_triton(x, weight, eps)


@add_rms_norm_quant_op.register_kernel("cuda")
def _add_rms_norm_quant_fp8_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    return add_rms_norm_quant_fp8_triton(x, residual, weight, eps)


@offset_rms_norm_quant_op.register_kernel("cuda")
def _offset_rms_norm_quant_fp8_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight)
    return offset_rms_norm_quant_fp8_triton(x, weight, eps, offset)


@add_offset_rms_norm_quant_op.register_kernel("cuda")
def _add_offset_rms_norm_quant_fp8_cuda(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                        offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    return add_offset_rms_norm_quant_fp8_triton(x, residual, weight, eps, offset)


@gelu_tanh_and_mul_quant_op.register_kernel("cuda")
def _gelu_tanh_and_mul_quant_fp8_cuda(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gelu_tanh_and_mul_quant_fp8_triton(gate, up)


@silu_and_mul_quant_op.register_kernel("cuda")
def _silu_and_mul_quant_fp8_cuda(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return silu_and_mul_quant_fp8_triton(gate, up)


# ---- FP8 GEMV for decode-sized inputs --------------------------------------------------------
# At 1-16 rows a projection is bound by reading its weight; these kernels read the e4m3 weight
# once with the tiling of kiln.kernels.triton_linear's GEMVs (at one row, the same bytes per
# tile: twice the K of the bf16 table) and apply both scales to the fp32 accumulator. Above
# FP8_GEMV_MAX_ROWS rows, or where the shapes do not fit, kiln::fp8_linear is
# torch._scaled_mm. Which is faster at 1-16 rows is measured by bench/fp8_gemm.py;
# KILN_FP8_GEMV_MAX_ROWS=0 in the environment (read once, at import) always uses _scaled_mm.
FP8_GEMV_MAX_ROWS = int(os.environ.get("KILN_FP8_GEMV_MAX_ROWS", "16"))


@triton.jit
def _fp8_gemv_row_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, count_ptr, N, K,
                         HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False, EARLY_TILE: tl.constexpr = False):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    k_len = K // SPLIT_K  # this program's share of K: [split * k_len, (split + 1) * k_len)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K + split * k_len  # as triton_linear's row kernel
    x_row = x_ptr + split * k_len
    first = tl.arange(0, BLOCK_K)
    if EARLY_TILE:  # the first weight tile before the wait, as triton_linear's GEMVs
        w_first = tl.load(w_rows + first[None, :])
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = 0
    if EARLY_TILE:
        acc += w_first.to(tl.float32) * tl.load(x_row + first).to(tl.float32)[None, :]
        k_start = BLOCK_K
    for k0 in range(k_start, k_len, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :])
        x = tl.load(x_row + ks)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    sums = tl.sum(acc, axis=1)
    last = True
    if SPLIT_K > 1:
        last, sums = split_k_sum(sums, part_ptr, count_ptr, tile, split, cols, cols < N, N, SPLIT_K)
    if last:
        out = sums * tl.load(xs_ptr) * tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
        if HAS_BIAS:
            out += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _e4m3_dot(x, w, acc, BLOCK_M: tl.constexpr):
    """acc + x @ w^T for e4m3 tiles. A 16-row tile: float16 holds every e4m3 value exactly, so
    a 16-bit MMA as the bf16 GEMV's (Triton converts for an FP8 dot at 16 rows anyway). A
    64-row tile (GemvConfig.block_m): Hopper's e4m3 warpgroup MMA on the tiles as they are,
    summed in the tensor core's own accumulator over the whole K, as `_scaled_mm`'s fast
    accumulation above 16 rows (kiln.kernels.fp8): down's outputs (K = 14,336) come within
    ~4 bf16 ulps of float32 sums. Promoting to float32 every 128 of K
    (`max_num_imprecise_acc=128`) made that tile slower than the 16-row one (down 38.3
    against 23.5 us at eight rows on the H200, bench/RESULTS.md S3)."""
    if BLOCK_M >= 64:
        return tl.dot(x, tl.trans(w), acc)
    return tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), acc)


@triton.jit
def _fp8_gemv_tile_dot(x, w, acc, BLOCK_M: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + x @ w^T, or with SWAP_AB its transpose acc^T + w @ x^T: the [BLOCK_N, BLOCK_K]
    weight tile as the e4m3 MMA's M side (64 or 128 rows, a Hopper warpgroup's) and the
    16-row tile of x as its N side. Both tiles are K-major as stored, as e4m3 MMAs need."""
    # if/else, not an early return: Triton would still build the code after it, with the
    # other orientation's shapes.
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = _e4m3_dot(x, w, acc, BLOCK_M)
    return acc


@triton.jit
def _fp8_gemv_dot_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False, EARLY_TILE: tl.constexpr = False,
                         SWAP_AB: tl.constexpr = False):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    k_len = K // SPLIT_K  # as in the row kernel
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K + split * k_len
    first = tl.arange(0, BLOCK_K)
    if EARLY_TILE:
        w_first = tl.load(w_rows + first[None, :])
    wait_for_previous_kernel(PDL)
    x_rows = x_ptr + rows[:, None] * K + split * k_len
    if SWAP_AB:  # (a compile-time branch: the two accumulators never meet)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T's tile (GemvConfig.swap_ab)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = 0
    if EARLY_TILE:
        x = tl.load(x_rows + first[None, :], mask=rows[:, None] < M, other=0.0)
        acc = _fp8_gemv_tile_dot(x, w_first, acc, BLOCK_M, SWAP_AB)
        k_start = BLOCK_K
    for k0 in range(k_start, k_len, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :])
        x = tl.load(x_rows + ks[None, :], mask=rows[:, None] < M, other=0.0)
        acc = _fp8_gemv_tile_dot(x, w, acc, BLOCK_M, SWAP_AB)
    if SWAP_AB:  # y is [M, N]: the transposed tile is stored transposed
        mask = (cols[:, None] < N) & (rows[None, :] < M)
        offs = rows[None, :] * N + cols[:, None]
    else:
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
    last = True
    if SPLIT_K > 1:
        last, acc = split_k_sum(acc, part_ptr, count_ptr, tile, split, offs, mask, M * N, SPLIT_K)
    if last:
        xs = tl.load(xs_ptr + rows, mask=rows < M, other=0.0)
        ws = tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
        if SWAP_AB:
            acc = acc * ws[:, None] * xs[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        else:
            acc = acc * xs[:, None] * ws[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# FP8 GEMV tilings, (largest N, largest K, config) as kiln.kernels.triton_linear's tables;
# the first row that fits wins. From the H200 sweep of 2026-12-01 (bench/tune_gemv.py --fp8,
# Llama-3-8B projections, e4m3 weights past L2), against the bf16 tables with twice the K
# tile that served until then: one row, qkv 9.8 against 12.1 us, o 7.3 against 8.9, gate/up
# 34.3 against 61.4, down 17.9 against 21.4; 2-16 rows (swept at 8), qkv 10.7 against 12.7
# and gate/up 32.6 against _scaled_mm's 48.5 (o and down keep the bf16 dot tiles). One row
# again on 2026-12-02 with programmatic dependent launch (R1): gate/up through the tl.dot
# kernel's 16-row tile (`dot=True`) 31.8 against the row kernel's 34.6 us (3.70 against 3.39
# TB/s); o and down with 3 stages, as fast as 4 (o 6.97 against 6.99 us); at eight rows
# gate/up with 8 warps, as fast as 4 (32.3 against 32.4). (Each first timing of the table's
# tiling in that sweep came right after a compile had let the GPU's clocks drop: 37.7, 7.6
# and 33.5 us; these figures are the same tilings timed again.) At 2-16 rows since
# 2026-12-02 (S1, swept at eight rows) the 64-row tile, Hopper's e4m3 warpgroup MMA on the
# tiles as they are: o 7.9 against the 16-row tile's 8.7 us, down 21.2 against 23.5, qkv
# 10.0 against 11.6, gate/up 33.3 against 34.1. (Splitting K, GemvConfig.split_k, gained
# only down at the 16-row tile: 22.2.) Since 2026-12-04 (X1-X2, swept at one and eight rows)
# at 2-16 rows the weight tile as the MMA's 64 rows and x's rows as its 16 columns
# (`swap_ab`: 64 columns a program, all 16 MMA columns could be rows, against 2-16 of the
# 64-row tile's 64): o 7.6 against 7.9 us, down 19.4 against 21.2, qkv 9.5 against 10.5,
# gate/up 35.3 against 35.7; decode at batch 8 +7.3% (2,723 against 2,537 tokens/s, two
# alternating runs each). At one row the row kernel stays: the swap won only gate/up there,
# by 1.5%, and batch 1 went 376.4 -> 373.5 with it.
FP8_ROW_TABLE: tuple[tuple[float, float, GemvConfig], ...] = (
    (4096, math.inf, GemvConfig(8, 1024, 8, 3)),      # o 4096 x 4096, down 4096 x 14336
    (8192, math.inf, GemvConfig(4, 512, 4, 4)),       # qkv 6144 x 4096
    (math.inf, math.inf, GemvConfig(128, 256, 8, 3, dot=True)),   # gate_up 28672 x 4096
)
FP8_DOT_TABLE: tuple[tuple[float, float, GemvConfig], ...] = (
    (4096, math.inf, GemvConfig(64, 512, 4, 4, swap_ab=True)),     # o, down
    (8192, math.inf, GemvConfig(64, 256, 4, 5, swap_ab=True)),     # qkv
    (math.inf, math.inf, GemvConfig(64, 256, 4, 4, swap_ab=True)),  # gate_up
)


def load_tuned_gemv_configs(path: str) -> dict[tuple[int, int, int], GemvConfig | None]:
    """The best tiling per (n, k, rows) of a `bench/tune_gemv.py --fp8 --out PATH` file (None:
    torch._scaled_mm was fastest). Raises ValueError naming what is wrong with the file."""
    import json

    try:
        with open(path) as f:
            sweep = json.load(f)
        dims = sweep["shape_dims"]
        tuned: dict[tuple[int, int, int], GemvConfig | None] = {}
        for name, rows in sweep["shapes"].items():
            n, k = dims[name]
            for m, result in rows.items():
                best = result["best"]["config"]
                tuned[(int(n), int(k), int(m))] = GemvConfig(**best) if isinstance(best, dict) else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"KILN_FP8_GEMV_TUNED={path!r}: not a bench/tune_gemv.py --fp8 result with "
                         f"shape_dims ({type(e).__name__}: {e})") from e
    if not sweep.get("fp8"):
        raise ValueError(f"KILN_FP8_GEMV_TUNED={path!r}: a bf16 sweep; run bench/tune_gemv.py with --fp8")
    return tuned


# KILN_FP8_GEMV_TUNED=<a bench/tune_gemv.py --fp8 result> (read once, at import): the sweep's
# best tiling overrides the tables at the shapes it timed, at its row counts (one row: its
# row 1; 2-16 rows: its nearest row count above one). For an A/B of a sweep's winners end to
# end (bench/gpu_smoke.sh gemv_tuned_ab) before they go into the tables.
FP8_GEMV_TUNED = (load_tuned_gemv_configs(os.environ["KILN_FP8_GEMV_TUNED"])
                  if os.environ.get("KILN_FP8_GEMV_TUNED") else {})


def _tuned_config(n: int, k: int, m: int) -> tuple[bool, GemvConfig | None]:
    """(found, config) from FP8_GEMV_TUNED for this product."""
    swept = [r for (tn, tk, r) in FP8_GEMV_TUNED if (tn, tk) == (n, k) and (r == 1) == (m == 1)]
    if not swept:
        return False, None
    rows = min(swept, key=lambda r: abs(r - m))
    return True, FP8_GEMV_TUNED[(n, k, rows)]


def fp8_gemv_config(n: int, k: int, m: int, shared_memory: int = 0) -> GemvConfig | None:
    """The GEMV tiling for an [m, k] x [n, k]^T FP8 product, or None (torch._scaled_mm).
    `shared_memory`: as for kiln.kernels.triton_linear.choose_config."""
    if not (1 <= m <= FP8_GEMV_MAX_ROWS and n >= 1 and k >= 1):
        return None
    found, tuned = _tuned_config(n, k, m)
    if found:
        return tuned if tuned is None else fit_block_k(tuned, k)
    table = FP8_ROW_TABLE if m == 1 else FP8_DOT_TABLE
    config = next(c for max_n, max_k, c in table if n <= max_n and k <= max_k)
    if m > 1 or config.dot:
        config = fit_shared_memory(config, 1, shared_memory, early_tile=GEMV_EARLY_TILE)
    return fit_block_k(config, k)


def fp8_linear_triton(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype, config=None) -> torch.Tensor:
    """kiln::fp8_linear by a Triton GEMV at 1..FP8_GEMV_MAX_ROWS rows (`config` overrides the
    choice, for tests and bench/fp8_gemm.py); otherwise the reference (torch._scaled_mm)."""
    check_fp8_linear_args(xq, x_scale, weight, weight_scale, bias)
    n, k = weight.shape
    m = xq.numel() // k if k else 0
    config = config or fp8_gemv_config(n, k, m, max_shared_memory(xq.device))
    if (config is None or not 1 <= m <= DOT_BLOCK_M or k % (config.block_k * config.split_k)
            or not weight.is_contiguous()
            or not weight_scale.is_contiguous() or (bias is not None and not bias.is_contiguous())):
        return fp8_linear_reference(xq, x_scale, weight, weight_scale, bias, out_dtype)
    x2 = xq.reshape(m, k).contiguous()
    xs = x_scale.reshape(m).contiguous().float()
    ws = weight_scale.float()
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    b = bias if bias is not None else y
    tiles = triton.cdiv(n, config.block_n)
    counters = split_k_counters(xq.device) if config.split_k > 1 else None
    if counters is None or tiles > counters.numel():
        config = dataclasses.replace(config, split_k=1)  # (the K tile still divides k)
    if config.split_k > 1:
        partials = torch.empty((config.split_k, m, n), dtype=torch.float32, device=xq.device)
    else:
        partials = counters = y  # never touched unsplit
    grid = (tiles, config.split_k)
    if m == 1 and not config.dot and not config.swap_ab:
        _fp8_gemv_row_kernel[grid](x2, xs, weight, ws, b, y, partials, counters, n, k, HAS_BIAS=bias is not None,
                                   BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
                                   num_warps=config.num_warps, num_stages=config.num_stages,
                                   EARLY_TILE=GEMV_EARLY_TILE, **pdl_launch_args(xq.device, "fp8"))
    else:
        # The swap's rows are the MMA's N side: 16, the smallest tl.dot takes.
        block_m = DOT_BLOCK_M if config.swap_ab else config.block_m
        _fp8_gemv_dot_kernel[grid](x2, xs, weight, ws, b, y, partials, counters, m, n, k, HAS_BIAS=bias is not None,
                                   BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                   SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages,
                                   EARLY_TILE=GEMV_EARLY_TILE, SWAP_AB=config.swap_ab, **pdl_launch_args(xq.device, "fp8"))
    return y.view(*xq.shape[:-1], n)


@fp8_linear_op.register_kernel("cuda")
def _fp8_linear_cuda(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_linear_triton(xq, x_scale, weight, weight_scale, bias, out_dtype)
