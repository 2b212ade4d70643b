"""CUDA kernels for kiln.kernels.fp8_fused_linear's ops: FP8 GEMVs that compute their own input.

At 1..FUSED_GEMV_MAX_ROWS rows each op is one launch of a GEMV with the tilings of
kiln.kernels.triton_fp8's (the same tables, shared memory refitted for a 16-bit input tile),
whose K loop builds each tile of the projection's input from the producer's inputs:

    RMS_NORM       x * norm_weight                   (x 1/rms at the end, per row)
    ADD_RMS_NORM   (x + residual) * norm_weight      (the same; program 0 writes x + residual)
    SILU_AND_MUL   silu(gate) * up
    PLAIN          x                                 (the attention output before o_proj)

and multiplies it with the e4m3 weight tile widened to 16 bits: no activation quantization
(kiln.kernels.fp8_fused_linear's doc says why that is sound). The RMSNorm needs the row's
mean square, which only the whole row gives: every program sums the squares of the row as
its K loop reads it (each reads the whole row anyway) and scales its sums by 1/rms at the
end, so nothing is read twice. Elsewhere (more rows, a dtype or layout the kernels do not
take) the op runs its chain: the `*_quant_fp8` kernel, then `kiln::fp8_linear`.

One row runs on the CUDA cores in float32 (as triton_fp8's row kernel); 2-16 rows, and one
row where the table says `dot`, through tl.dot in the activation's 16-bit dtype (a 16- or
64-row tile, rows past M masked). KILN_FP8_FUSED_GEMV_MAX_ROWS in the environment (read once,
at import; 0 turns the fused kernels off: every op runs its chain) sets the row limit.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from kiln.kernels.fp8 import FP8_DTYPE
from kiln.kernels.fp8_fused_linear import (add_rms_norm_fp8_linear, add_rms_norm_fp8_linear_chain,
                                           check_fused_weight, check_silu_and_mul_args, quantize_fp8_linear,
                                           quantize_fp8_linear_chain, rms_norm_fp8_linear, rms_norm_fp8_linear_chain,
                                           silu_and_mul_fp8_linear, silu_and_mul_fp8_linear_chain)
from kiln.kernels.rms_norm import check_rms_norm_args
from kiln.kernels.triton_common import GEMV_EARLY_TILE, max_shared_memory, pdl_launch_args, wait_for_previous_kernel
from kiln.kernels.triton_fp8 import fp8_gemv_config
from kiln.kernels.triton_linear import DOT_BLOCK_M, GemvConfig, fit_shared_memory

FUSED_GEMV_MAX_ROWS = int(os.environ.get("KILN_FP8_FUSED_GEMV_MAX_ROWS", "16"))

# What the K loop computes from the op's inputs (module doc).
PLAIN, RMS_NORM, ADD_RMS_NORM, SILU_AND_MUL = 0, 1, 2, 3
_INPUT_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _input_tile(x_ptr, r_ptr, g_ptr, x_offs, r_offs, ks, mask, PROLOGUE: tl.constexpr):
    """(a, s) in float32 for the input elements at x_offs: a the projection's input (before
    1/rms), s the residual sum whose squares give the rms (RMS_NORM / ADD_RMS_NORM). Each
    value is rounded to the activation dtype where the unfused chain rounds it."""
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if PROLOGUE == SILU_AND_MUL:
        g = x.to(tl.float32)
        u = tl.load(r_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
        a = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        s = a
    elif PROLOGUE == PLAIN:
        a = x.to(tl.float32)
        s = a
    else:
        if PROLOGUE == ADD_RMS_NORM:
            r = tl.load(r_ptr + r_offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # summed = x + residual, in dt
        s = x.to(tl.float32)
        a = s * tl.load(g_ptr + ks).to(tl.float32)
    return a, s


@triton.jit
def _fused_gemv_row_kernel(x_ptr, r_ptr, g_ptr, sum_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, eps,
                           PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, EARLY_TILE: tl.constexpr = False):
    # One row; the tiling and loop of triton_fp8's row kernel.
    tile = tl.program_id(0)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K
    first = tl.arange(0, BLOCK_K)
    if EARLY_TILE:  # the first weight tile before the wait (the weights are no kernel's output)
        w_first = tl.load(w_rows + first[None, :])
    wait_for_previous_kernel(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    k_start = 0
    if EARLY_TILE:
        a, s = _input_tile(x_ptr, r_ptr, g_ptr, first, first, first, first < K, PROLOGUE)
        acc += w_first.to(tl.float32) * a[None, :]
        if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
            squares += s * s
        if PROLOGUE == ADD_RMS_NORM:
            if tile == 0:
                tl.store(sum_ptr + first, s.to(sum_ptr.dtype.element_ty))
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :])
        a, s = _input_tile(x_ptr, r_ptr, g_ptr, ks, ks, ks, ks < K, PROLOGUE)
        acc += w.to(tl.float32) * a[None, :]
        if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
            squares += s * s
        if PROLOGUE == ADD_RMS_NORM:
            if tile == 0:
                tl.store(sum_ptr + ks, s.to(sum_ptr.dtype.element_ty))
    sums = tl.sum(acc, axis=1)
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
        sums = sums * tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
    out = sums * tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _fused_gemv_dot_kernel(x_ptr, r_ptr, g_ptr, sum_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_r,
                           eps, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                           EARLY_TILE: tl.constexpr = False):
    # Rows past M are masked to zero; the dot runs in the activation's dtype with the e4m3
    # weight tile widened to it (exact: every e4m3 value is a float16 and a bfloat16).
    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K
    first = tl.arange(0, BLOCK_K)
    if EARLY_TILE:
        w_first = tl.load(w_rows + first[None, :])
    wait_for_previous_kernel(PDL)
    dt = x_ptr.dtype.element_ty
    row_mask = rows[:, None] < M
    x_rows = rows[:, None] * stride_x
    r_rows = rows[:, None] * stride_r
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_start = 0
    if EARLY_TILE:
        a, s = _input_tile(x_ptr, r_ptr, g_ptr, x_rows + first[None, :], r_rows + first[None, :], first, row_mask,
                           PROLOGUE)
        acc = tl.dot(a.to(dt), tl.trans(w_first.to(dt)), acc)
        if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
            squares += tl.sum(s * s, axis=1)
        if PROLOGUE == ADD_RMS_NORM:
            if tile == 0:
                tl.store(sum_ptr + rows[:, None] * K + first[None, :], s.to(sum_ptr.dtype.element_ty), mask=row_mask)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :])
        a, s = _input_tile(x_ptr, r_ptr, g_ptr, x_rows + ks[None, :], r_rows + ks[None, :], ks, row_mask, PROLOGUE)
        acc = tl.dot(a.to(dt), tl.trans(w.to(dt)), acc)
        if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
            squares += tl.sum(s * s, axis=1)
        if PROLOGUE == ADD_RMS_NORM:
            if tile == 0:
                tl.store(sum_ptr + rows[:, None] * K + ks[None, :], s.to(sum_ptr.dtype.element_ty), mask=row_mask)
    if PROLOGUE == RMS_NORM or PROLOGUE == ADD_RMS_NORM:
        acc = acc * tl.math.rsqrt(squares / K + eps)[:, None]
    acc = acc * tl.load(ws_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask & (cols[None, :] < N))


def fused_gemv_config(n: int, k: int, m: int, shared_memory: int = 0) -> GemvConfig | None:
    """The fused GEMV's tiling for m rows of [n, k], or None (the op runs its chain): the FP8
    GEMV's (kiln.kernels.triton_fp8.fp8_gemv_config), unsplit, its staged tiles refitted for
    a 16-bit input tile and a weight tile widened to 16 bits."""
    if not 1 <= m <= FUSED_GEMV_MAX_ROWS:
        return None
    config = fp8_gemv_config(n, k, m)
    if config is None:
        return None
    config = dataclasses.replace(config, split_k=1)
    if m > 1 or config.dot:
        config = fit_shared_memory(config, 2, shared_memory, early_tile=GEMV_EARLY_TILE)
    return config if k % config.block_k == 0 else None


def _applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
             config: GemvConfig | None, m: int, *others: torch.Tensor) -> bool:
    return (config is not None and 1 <= m <= max(DOT_BLOCK_M, config.block_m) and x.dtype in _INPUT_DTYPES
            and weight.dtype == FP8_DTYPE and weight.is_contiguous() and weight_scale.is_contiguous()
            and (bias is None or bias.is_contiguous())
            and all(t.dtype == x.dtype and t.device == x.device for t in others))


def _rows2d(t: torch.Tensor, k: int) -> torch.Tensor:
    t2 = t.reshape(-1, k)  # a view whenever the leading dimensions allow one
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _launch(prologue: int, x: torch.Tensor, other: torch.Tensor | None, norm_weight: torch.Tensor | None,
            weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
            eps: float, config: GemvConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [..., N] (and x + other for ADD_RMS_NORM) by one fused GEMV launch."""
    n, k = weight.shape
    x2 = _rows2d(x, k)
    m = x2.shape[0]
    r2 = _rows2d(other, k) if other is not None else x2
    g = norm_weight.contiguous() if norm_weight is not None else x2
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    summed = torch.empty((m, k), dtype=x.dtype, device=x.device) if prologue == ADD_RMS_NORM else None
    ws = weight_scale.float()
    b = bias if bias is not None else y  # never read without HAS_BIAS
    grid = (triton.cdiv(n, config.block_n),)
    common = dict(PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  num_warps=config.num_warps, num_stages=config.num_stages, EARLY_TILE=GEMV_EARLY_TILE,
                  **pdl_launch_args(x.device))
    sum_out = summed if summed is not None else y
    if m == 1 and not config.dot:
        _fused_gemv_row_kernel[grid](x2, r2, g, sum_out, weight, ws, b, y, n, k, float(eps), **common)
    else:
        _fused_gemv_dot_kernel[grid](x2, r2, g, sum_out, weight, ws, b, y, m, n, k, x2.stride(0), r2.stride(0),
                                     float(eps), BLOCK_M=config.block_m, **common)
    y = y.view(*x.shape[:-1], n)
    return y, (summed.view(x.shape) if summed is not None else None)


def _config_for(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None) -> tuple[int, GemvConfig | None]:
    n, k = weight.shape
    m = x.numel() // k if k else 0
    return m, config or fused_gemv_config(n, k, m, max_shared_memory(x.device))


def rms_norm_fp8_linear_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                               weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                               config: GemvConfig | None = None) -> torch.Tensor:
    """`config` overrides the tiling (tests, bench)."""
    m, config = _config_for(x, weight, config)
    if not _applies(x, weight, weight_scale, bias, config, m, norm_weight):
        return rms_norm_fp8_linear_chain(x, norm_weight, eps, weight, weight_scale, bias, out_dtype)
    return _launch(RMS_NORM, x, None, norm_weight, weight, weight_scale, bias, out_dtype, eps, config)[0]


def add_rms_norm_fp8_linear_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                   weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                   out_dtype: torch.dtype, config: GemvConfig | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    m, config = _config_for(x, weight, config)
    if not _applies(x, weight, weight_scale, bias, config, m, residual, norm_weight):
        return add_rms_norm_fp8_linear_chain(x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype)
    y, summed = _launch(ADD_RMS_NORM, x, residual, norm_weight, weight, weight_scale, bias, out_dtype, eps, config)
    return y, summed


def silu_and_mul_fp8_linear_triton(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                                   weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                                   config: GemvConfig | None = None) -> torch.Tensor:
    m, config = _config_for(gate, weight, config)
    if not _applies(gate, weight, weight_scale, bias, config, m, up):
        return silu_and_mul_fp8_linear_chain(gate, up, weight, weight_scale, bias, out_dtype)
    return _launch(SILU_AND_MUL, gate, up, None, weight, weight_scale, bias, out_dtype, 0.0, config)[0]


def quantize_fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                               bias: torch.Tensor | None, out_dtype: torch.dtype,
                               config: GemvConfig | None = None) -> torch.Tensor:
    m, config = _config_for(x, weight, config)
    if not _applies(x, weight, weight_scale, bias, config, m):
        return quantize_fp8_linear_chain(x, weight, weight_scale, bias, out_dtype)
    return _launch(PLAIN, x, None, None, weight, weight_scale, bias, out_dtype, 0.0, config)[0]


@rms_norm_fp8_linear.register_kernel("cuda")
def _rms_norm_fp8_linear_cuda(x, norm_weight, eps, weight, weight_scale, bias, out_dtype):
    check_rms_norm_args(x, norm_weight)
    check_fused_weight(x, weight, weight_scale, bias, "rms_norm_fp8_linear")
    return rms_norm_fp8_linear_triton(x, norm_weight, eps, weight, weight_scale, bias, out_dtype)


@add_rms_norm_fp8_linear.register_kernel("cuda")
def _add_rms_norm_fp8_linear_cuda(x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype):
    check_rms_norm_args(x, norm_weight, residual)
    check_fused_weight(x, weight, weight_scale, bias, "add_rms_norm_fp8_linear")
    return add_rms_norm_fp8_linear_triton(x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype)


@silu_and_mul_fp8_linear.register_kernel("cuda")
def _silu_and_mul_fp8_linear_cuda(gate, up, weight, weight_scale, bias, out_dtype):
    check_silu_and_mul_args(gate, up, "silu_and_mul_fp8_linear")
    check_fused_weight(gate, weight, weight_scale, bias, "silu_and_mul_fp8_linear")
    return silu_and_mul_fp8_linear_triton(gate, up, weight, weight_scale, bias, out_dtype)


@quantize_fp8_linear.register_kernel("cuda")
def _quantize_fp8_linear_cuda(x, weight, weight_scale, bias, out_dtype):
    check_fused_weight(x, weight, weight_scale, bias, "quantize_fp8_linear")
    return quantize_fp8_linear_triton(x, weight, weight_scale, bias, out_dtype)
