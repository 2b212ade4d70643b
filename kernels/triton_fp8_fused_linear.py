"""CUDA kernel for kiln.kernels.fp8_fused_linear's ops: an FP8 GEMV that computes its own input.

At one row (decode at batch 1) each op is one launch of a GEMV, triton_fp8's row kernel
(CUDA cores, float32 sums, the weight's first tile loaded before the PDL wait), whose K loop
builds each tile of the projection's input from the producer's inputs:

    RMS_NORM       x * norm_weight                   (x 1/rms at the end)
    ADD_RMS_NORM   (x + residual) * norm_weight      (the same; program 0 writes x + residual)
                   (with OFFSET_WEIGHT: offset + norm_weight, kiln::offset_rms_norm's form)
    SILU_AND_MUL   silu(gate) * up                   (GELU_TANH_AND_MUL: Gemma's GELU(gate) * up)
    PLAIN          x                                 (the attention output before o_proj)

and multiplies it with the e4m3 weight widened to float32: no activation quantization
(kiln.kernels.fp8_fused_linear's doc says why that is sound). The RMSNorm needs the row's
mean square, which only the whole row gives: every program sums the squares of the row as
its K loop reads it (each reads the whole row anyway) and scales its sums by 1/rms at the
end, so nothing is read twice.

Where it pays, measured on the H200 (bench/fp8_fused_gemv.py, Llama-3-8B shapes, CUDA graphs
under PDL; bench/RESULTS.md V3), against the chain (the `*_quant_fp8` kernel, then the FP8
GEMV): o 6.3 against 8.8 us, qkv 10.2 against 11.0, down 18.7 against 19.1; gate/up 34.8 at
best against 32.1 (its chain's GEMV is the faster tl.dot kernel: gate/up keeps the chain,
FUSED_ROW_TABLE's None). At 2-16 rows the same prologue in the tl.dot kernels (16- and
64-row tiles, the dot in 16 bits) was 1.0-14x slower than the chain at every projection
(eight rows: o 10.4 against 10.5 us, qkv 38.9 against 11.9, down 114 against 24): the input
tile built in registers must be moved into the MMA's operand layout, per program. A second
design (2026-12-04, X5; removed after it, in git history at `b73d077`) kept the swapped e4m3
MMA of the chain's own 2-16-row GEMV (the weight tile in shared memory as the MMA's 64 rows)
and built only the [16, BLOCK_K] row tile, quantized to e4m3 per row and K tile in the
kernel: 2-4x slower than the chain at eight rows (o 15.2 against 9.9 us, qkv 35.3 against
10.6, down 74 against 21, gate/up 80 against 33), decode at batch 8 2,718 -> 814 tokens/s.
Its loops were software-pipelined (the weight and row tiles both copied ahead), but each K
tile's per-row max, its scaled product (which cannot accumulate in the MMA) and the MMA's
completion formed a serial chain longer than a tile's load. So above one row every op runs
its chain. KILN_FP8_FUSED_GEMV=0 in the environment (read once, at import) runs the chains
at one row too.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kiln.kernels.fp8 import FP8_DTYPE
from kiln.kernels.fp8_fused_linear import (add_offset_rms_norm_fp8_linear, add_offset_rms_norm_fp8_linear_chain,
                                           add_rms_norm_fp8_linear, add_rms_norm_fp8_linear_chain,
                                           check_fused_weight, check_silu_and_mul_args, gelu_tanh_and_mul_fp8_linear,
                                           gelu_tanh_and_mul_fp8_linear_chain, offset_rms_norm_fp8_linear,
                                           offset_rms_norm_fp8_linear_chain, quantize_fp8_linear,
                                           quantize_fp8_linear_chain, rms_norm_fp8_linear, rms_norm_fp8_linear_chain,
                                           silu_and_mul_fp8_linear, silu_and_mul_fp8_linear_chain)
from kiln.kernels.rms_norm import check_rms_norm_args
from kiln.kernels.triton_activation import gated_activation
from kiln.kernels.triton_common import GEMV_EARLY_TILE, pdl_launch_args, wait_for_previous_kernel
from kiln.kernels.triton_linear import GemvConfig, fit_block_k

FUSED_GEMV = os.environ.get("KILN_FP8_FUSED_GEMV", "1") != "0"

# One-row tilings, (largest N, largest K, config or None: the chain); the first row that
# fits wins. From the H200 sweep of 2026-12-03 (module doc): wider column tiles than the
# unfused row kernel's for QKV (each program builds the input once for more columns).
FUSED_ROW_TABLE: tuple[tuple[float, float, GemvConfig | None], ...] = (
    (4096, 4096, GemvConfig(4, 1024, 4, 3)),       # o 4096 x 4096
    (4096, math.inf, GemvConfig(8, 1024, 8, 3)),   # down 4096 x 14336
    (8192, math.inf, GemvConfig(16, 512, 8, 3)),   # qkv 6144 x 4096
    (math.inf, math.inf, None),                    # gate/up 28672 x 4096: the chain
)

# What the K loop computes from the op's inputs (module doc).
PLAIN, RMS_NORM, ADD_RMS_NORM, SILU_AND_MUL, GELU_TANH_AND_MUL = 0, 1, 2, 3, 4
# The same as the kernels see them (a global a kernel reads must be a constexpr).
_PLAIN, _RMS_NORM, _ADD_RMS_NORM, _SILU_AND_MUL, _GELU_TANH_AND_MUL = (
    tl.constexpr(v) for v in (PLAIN, RMS_NORM, ADD_RMS_NORM, SILU_AND_MUL, GELU_TANH_AND_MUL))
_INPUT_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _input_tile(x_ptr, r_ptr, g_ptr, x_offs, r_offs, ks, mask, PROLOGUE: tl.constexpr,
                OFFSET_WEIGHT: tl.constexpr = False, offset=0.0):
    """(a, s) in float32 for the input elements at x_offs: a the projection's input (before
    1/rms), s the residual sum whose squares give the rms (RMS_NORM / ADD_RMS_NORM). Each
    value is rounded to the activation dtype where the unfused chain rounds it."""
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if PROLOGUE == _SILU_AND_MUL or PROLOGUE == _GELU_TANH_AND_MUL:
        g = x.to(tl.float32)
        u = tl.load(r_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
        a = (gated_activation(g, PROLOGUE == _GELU_TANH_AND_MUL).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        s = a
    elif PROLOGUE == _PLAIN:
        a = x.to(tl.float32)
        s = a
    else:
        if PROLOGUE == _ADD_RMS_NORM:
            r = tl.load(r_ptr + r_offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # summed = x + residual, in dt
        s = x.to(tl.float32)
        if OFFSET_WEIGHT:
            a = s * (offset + tl.load(g_ptr + ks).to(tl.float32))
        else:
            a = s * tl.load(g_ptr + ks).to(tl.float32)
    return a, s


@triton.jit
def _accumulate(acc, squares, w, x_ptr, r_ptr, g_ptr, sum_ptr, ks, K, tile, PROLOGUE: tl.constexpr,
                OFFSET_WEIGHT: tl.constexpr, offset):
    """One K tile: the input at ks built and multiplied with the weight tile w; the squares
    of the residual sum kept for the rms; program 0 writes that sum (ADD_RMS_NORM)."""
    a, s = _input_tile(x_ptr, r_ptr, g_ptr, ks, ks, ks, ks < K, PROLOGUE, OFFSET_WEIGHT, offset)
    acc += w.to(tl.float32) * a[None, :]
    if PROLOGUE == _RMS_NORM or PROLOGUE == _ADD_RMS_NORM:
        squares += s * s
    if PROLOGUE == _ADD_RMS_NORM:
        if tile == 0:
            tl.store(sum_ptr + ks, s.to(sum_ptr.dtype.element_ty))
    return acc, squares


@triton.jit
def _fused_gemv_row_kernel(x_ptr, r_ptr, g_ptr, sum_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, eps,
                           PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, EARLY_TILE: tl.constexpr = False,
                           OFFSET_WEIGHT: tl.constexpr = False, offset=0.0):
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
        acc, squares = _accumulate(acc, squares, w_first, x_ptr, r_ptr, g_ptr, sum_ptr, first, K, tile, PROLOGUE,
                                   OFFSET_WEIGHT, offset)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :])
        acc, squares = _accumulate(acc, squares, w, x_ptr, r_ptr, g_ptr, sum_ptr, ks, K, tile, PROLOGUE,
                                   OFFSET_WEIGHT, offset)
    sums = tl.sum(acc, axis=1)
    if PROLOGUE == _RMS_NORM or PROLOGUE == _ADD_RMS_NORM:
        sums = sums * tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
    out = sums * tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)


def fused_gemv_config(n: int, k: int, m: int) -> GemvConfig | None:
    """The fused GEMV's tiling for m rows of [n, k], or None (the op runs its chain): one
    row, FUSED_ROW_TABLE, a K tile that divides k."""
    if m != 1 or not FUSED_GEMV:
        return None
    config = next(c for max_n, max_k, c in FUSED_ROW_TABLE if n <= max_n and k <= max_k)
    return None if config is None else fit_block_k(config, k)


def _applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
             config: GemvConfig | None, m: int, *others: torch.Tensor) -> bool:
    return (config is not None and m == 1 and x.dtype in _INPUT_DTYPES
            and weight.shape[1] % config.block_k == 0  # the K loop's weight loads are unmasked
            and weight.dtype == FP8_DTYPE and weight.is_contiguous() and weight_scale.is_contiguous()
            and (bias is None or bias.is_contiguous())
            and all(t.dtype == x.dtype and t.device == x.device for t in others))


def _row(t: torch.Tensor, k: int) -> torch.Tensor:
    """The one row of t as a contiguous [k] (a view when it is one already)."""
    return t.reshape(k).contiguous()


def _launch(prologue: int, x: torch.Tensor, other: torch.Tensor | None, norm_weight: torch.Tensor | None,
            weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
            eps: float, config: GemvConfig, offset: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [..., N] (and x + other for ADD_RMS_NORM) of one row, by one fused GEMV launch;
    `offset` (not None): the norms' offset form."""
    n, k = weight.shape
    x1 = _row(x, k)
    r1 = _row(other, k) if other is not None else x1
    g = norm_weight.contiguous() if norm_weight is not None else x1
    y = torch.empty((1, n), dtype=out_dtype, device=x.device)
    summed = torch.empty((1, k), dtype=x.dtype, device=x.device) if prologue == ADD_RMS_NORM else None
    b = bias if bias is not None else y  # never read without HAS_BIAS
    _fused_gemv_row_kernel[(triton.cdiv(n, config.block_n),)](
        x1, r1, g, summed if summed is not None else y, weight, weight_scale.float(), b, y, n, k, float(eps),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, EARLY_TILE=GEMV_EARLY_TILE,
        OFFSET_WEIGHT=offset is not None, offset=float(offset or 0.0), **pdl_launch_args(x.device, "fp8"))
    return y.view(*x.shape[:-1], n), (summed.view(x.shape) if summed is not None else None)


def _config_for(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None) -> tuple[int, GemvConfig | None]:
    n, k = weight.shape
    m = x.numel() // k if k else 0
    return m, config or fused_gemv_config(n, k, m)


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


def offset_rms_norm_fp8_linear_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float,
                                      weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                      out_dtype: torch.dtype, config: GemvConfig | None = None) -> torch.Tensor:
    m, config = _config_for(x, weight, config)
    if not _applies(x, weight, weight_scale, bias, config, m):  # (the offset forms' norm weight: any dtype)
        return offset_rms_norm_fp8_linear_chain(x, norm_weight, eps, offset, weight, weight_scale, bias, out_dtype)
    return _launch(RMS_NORM, x, None, norm_weight, weight, weight_scale, bias, out_dtype, eps, config, offset)[0]


def add_offset_rms_norm_fp8_linear_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                                          eps: float, offset: float, weight: torch.Tensor,
                                          weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                          out_dtype: torch.dtype, config: GemvConfig | None = None
                                          ) -> tuple[torch.Tensor, torch.Tensor]:
    m, config = _config_for(x, weight, config)
    if not _applies(x, weight, weight_scale, bias, config, m, residual):
        return add_offset_rms_norm_fp8_linear_chain(x, residual, norm_weight, eps, offset, weight, weight_scale,
                                                    bias, out_dtype)
    return _launch(ADD_RMS_NORM, x, residual, norm_weight, weight, weight_scale, bias, out_dtype, eps, config,
                   offset)


def silu_and_mul_fp8_linear_triton(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                                   weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                                   config: GemvConfig | None = None, gelu_tanh: bool = False) -> torch.Tensor:
    """With `gelu_tanh`, Gemma's GELU(gate) * up (`kiln::gelu_tanh_and_mul_fp8_linear`)."""
    m, config = _config_for(gate, weight, config)
    if not _applies(gate, weight, weight_scale, bias, config, m, up):
        chain = gelu_tanh_and_mul_fp8_linear_chain if gelu_tanh else silu_and_mul_fp8_linear_chain
        return chain(gate, up, weight, weight_scale, bias, out_dtype)
    prologue = GELU_TANH_AND_MUL if gelu_tanh else SILU_AND_MUL
    return _launch(prologue, gate, up, None, weight, weight_scale, bias, out_dtype, 0.0, config)[0]


def gelu_tanh_and_mul_fp8_linear_triton(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                                        weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                                        config: GemvConfig | None = None) -> torch.Tensor:
    return silu_and_mul_fp8_linear_triton(gate, up, weight, weight_scale, bias, out_dtype, config, gelu_tanh=True)


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


@offset_rms_norm_fp8_linear.register_kernel("cuda")
def _offset_rms_norm_fp8_linear_cuda(x, norm_weight, eps, offset, weight, weight_scale, bias, out_dtype):
    check_rms_norm_args(x, norm_weight)
    check_fused_weight(x, weight, weight_scale, bias, "offset_rms_norm_fp8_linear")
    return offset_rms_norm_fp8_linear_triton(x, norm_weight, eps, offset, weight, weight_scale, bias, out_dtype)


@add_offset_rms_norm_fp8_linear.register_kernel("cuda")
def _add_offset_rms_norm_fp8_linear_cuda(x, residual, norm_weight, eps, offset, weight, weight_scale, bias, out_dtype):
    check_rms_norm_args(x, norm_weight, residual)
    check_fused_weight(x, weight, weight_scale, bias, "add_offset_rms_norm_fp8_linear")
    return add_offset_rms_norm_fp8_linear_triton(x, residual, norm_weight, eps, offset, weight, weight_scale, bias,
                                                 out_dtype)


@silu_and_mul_fp8_linear.register_kernel("cuda")
def _silu_and_mul_fp8_linear_cuda(gate, up, weight, weight_scale, bias, out_dtype):
    check_silu_and_mul_args(gate, up, "silu_and_mul_fp8_linear")
    check_fused_weight(gate, weight, weight_scale, bias, "silu_and_mul_fp8_linear")
    return silu_and_mul_fp8_linear_triton(gate, up, weight, weight_scale, bias, out_dtype)


@gelu_tanh_and_mul_fp8_linear.register_kernel("cuda")
def _gelu_tanh_and_mul_fp8_linear_cuda(gate, up, weight, weight_scale, bias, out_dtype):
    check_silu_and_mul_args(gate, up, "gelu_tanh_and_mul_fp8_linear")
    check_fused_weight(gate, weight, weight_scale, bias, "gelu_tanh_and_mul_fp8_linear")
    return gelu_tanh_and_mul_fp8_linear_triton(gate, up, weight, weight_scale, bias, out_dtype)


@quantize_fp8_linear.register_kernel("cuda")
def _quantize_fp8_linear_cuda(x, weight, weight_scale, bias, out_dtype):
    check_fused_weight(x, weight, weight_scale, bias, "quantize_fp8_linear")
    return quantize_fp8_linear_triton(x, weight, weight_scale, bias, out_dtype)
