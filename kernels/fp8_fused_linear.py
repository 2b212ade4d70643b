"""FP8 projections fused with the op that produces their input: one op where the graph had two.

    rms_norm_fp8_linear(x, norm_weight, eps, weight, weight_scale, bias, out_dtype) -> y
    add_rms_norm_fp8_linear(x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype)
        -> (y, summed)                    summed = x + residual, the residual stream onwards
    offset_rms_norm_fp8_linear(x, norm_weight, eps, offset, weight, weight_scale, bias, out_dtype) -> y
    add_offset_rms_norm_fp8_linear(x, residual, norm_weight, eps, offset, weight, weight_scale, bias,
                                   out_dtype) -> (y, summed)     the norm form of kiln::offset_rms_norm
    silu_and_mul_fp8_linear(gate, up, weight, weight_scale, bias, out_dtype) -> y
    gelu_tanh_and_mul_fp8_linear(gate, up, weight, weight_scale, bias, out_dtype) -> y   (Gemma's GeGLU)
    quantize_fp8_linear(x, weight, weight_scale, bias, out_dtype) -> y

Each is the `kiln::*_quant_fp8` op (kiln.kernels.fp8) followed by `kiln::fp8_linear`, and
the references below call exactly that chain (each op on its device's kernel): on CPU, and
on CUDA above one row, the numbers are the unfused graph's. Why fuse: at decode (one to a
few rows) every projection is bound by reading its weight, and the small kernel before it
(the RMSNorm and its quantization, SiLU-and-mul and its quantization, the attention output's
quantization) costs a launch of 2-3.5 us of latency for a few KB of work: ~0.34 ms of a 2.9
ms FP8 decode step of Llama-3-8B at batch 1 on the H200 (bench/RESULTS.md R2).

On CUDA at one row (kiln.kernels.triton_fp8_fused_linear) the GEMV reads the producer's
inputs itself, computes the projection's input on the fly and multiplies it, unquantized,
with the e4m3 weight widened in registers (weight-only FP8 at decode, as Marlin's FP8
kernels do): there is no row-wide maximum to find first, so the input never needs a pass of
its own. That is at least as precise as the chain it replaces (the e4m3 rounding of the
activation is gone), not bit-equal to it; the RMSNorm's 1/rms factor, one number per row, is
applied to the GEMV's sums at the end.
"""

from __future__ import annotations

import torch

from kiln.kernels.fp8 import (add_offset_rms_norm_quant_fp8, add_rms_norm_quant_fp8, check_fp8_linear_args, fp8_linear,
                              gelu_tanh_and_mul_quant_fp8, offset_rms_norm_quant_fp8, quantize_fp8_per_token,
                              rms_norm_quant_fp8, silu_and_mul_quant_fp8)
from kiln.kernels.library import kiln_op
from kiln.kernels.rms_norm import check_rms_norm_args


def check_fused_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       op: str) -> None:
    """ValueError naming what does not fit (the input is not quantized yet: its shape only)."""
    if x.dim() < 1:
        raise ValueError(f"{op}: the input must have at least one dimension")
    xq = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="meta")
    try:
        check_fp8_linear_args(xq, xq.new_empty((*x.shape[:-1], 1), dtype=torch.float32), weight, weight_scale, bias)
    except ValueError as e:
        raise ValueError(f"{op}: {str(e).removeprefix('fp8_linear: ')}") from None


def check_silu_and_mul_args(gate: torch.Tensor, up: torch.Tensor, op: str) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")


def _projected_fake(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


# ---- the chains each op stands for (the references; the CUDA kernels' fallback) ----------------

def rms_norm_fp8_linear_chain(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              weight_scale: torch.Tensor, bias: torch.Tensor | None,
                              out_dtype: torch.dtype) -> torch.Tensor:
    xq, xs = rms_norm_quant_fp8(x, norm_weight, eps)
    return fp8_linear(xq, xs, weight, weight_scale, bias, out_dtype)


def add_rms_norm_fp8_linear_chain(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                  weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    xq, xs, summed = add_rms_norm_quant_fp8(x, residual, norm_weight, eps)
    return fp8_linear(xq, xs, weight, weight_scale, bias, out_dtype), summed


def offset_rms_norm_fp8_linear_chain(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float,
                                     weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                     out_dtype: torch.dtype) -> torch.Tensor:
    xq, xs = offset_rms_norm_quant_fp8(x, norm_weight, eps, offset)
    return fp8_linear(xq, xs, weight, weight_scale, bias, out_dtype)


def add_offset_rms_norm_fp8_linear_chain(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                                         eps: float, offset: float, weight: torch.Tensor, weight_scale: torch.Tensor,
                                         bias: torch.Tensor | None, out_dtype: torch.dtype
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    xq, xs, summed = add_offset_rms_norm_quant_fp8(x, residual, norm_weight, eps, offset)
    return fp8_linear(xq, xs, weight, weight_scale, bias, out_dtype), summed


def silu_and_mul_fp8_linear_chain(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                                  weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                  out_dtype: torch.dtype) -> torch.Tensor:
    xq, xs = silu_and_mul_quant_fp8(gate, up)
    return fp8_linear(xq, xs, weight, weight_scale, bias, out_dtype)


def gelu_tanh_and_mul_fp8_linear_chain(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                                       weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                       out_dtype: torch.dtype) -> torch.Tensor:
    xq, xs = gelu_tanh_and_mul_quant_fp8(gate, up)
    return fp8_linear(xq, xs, weight, weight_scale, bias, out_dtype)


def quantize_fp8_linear_chain(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    xq, xs = quantize_fp8_per_token(x)
    return fp8_linear(xq, xs, weight, weight_scale, bias, out_dtype)


@kiln_op("kiln::rms_norm_fp8_linear")
def rms_norm_fp8_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                        weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    check_rms_norm_args(x, norm_weight)
    check_fused_weight(x, weight, weight_scale, bias, "rms_norm_fp8_linear")
    return rms_norm_fp8_linear_chain(x, norm_weight, eps, weight, weight_scale, bias, out_dtype)


@rms_norm_fp8_linear.register_fake
def _rms_norm_fp8_linear_fake(x, norm_weight, eps, weight, weight_scale, bias, out_dtype):
    return _projected_fake(x, weight, out_dtype)


@kiln_op("kiln::add_rms_norm_fp8_linear")
def add_rms_norm_fp8_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, norm_weight, residual)
    check_fused_weight(x, weight, weight_scale, bias, "add_rms_norm_fp8_linear")
    return add_rms_norm_fp8_linear_chain(x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype)


@add_rms_norm_fp8_linear.register_fake
def _add_rms_norm_fp8_linear_fake(x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype):
    summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return _projected_fake(x, weight, out_dtype), summed


@kiln_op("kiln::offset_rms_norm_fp8_linear")
def offset_rms_norm_fp8_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, offset: float,
                               weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                               out_dtype: torch.dtype) -> torch.Tensor:
    check_rms_norm_args(x, norm_weight)
    check_fused_weight(x, weight, weight_scale, bias, "offset_rms_norm_fp8_linear")
    return offset_rms_norm_fp8_linear_chain(x, norm_weight, eps, offset, weight, weight_scale, bias, out_dtype)


@offset_rms_norm_fp8_linear.register_fake
def _offset_rms_norm_fp8_linear_fake(x, norm_weight, eps, offset, weight, weight_scale, bias, out_dtype):
    return _projected_fake(x, weight, out_dtype)


@kiln_op("kiln::add_offset_rms_norm_fp8_linear")
def add_offset_rms_norm_fp8_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                   offset: float, weight: torch.Tensor, weight_scale: torch.Tensor,
                                   bias: torch.Tensor | None, out_dtype: torch.dtype
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, norm_weight, residual)
    check_fused_weight(x, weight, weight_scale, bias, "add_offset_rms_norm_fp8_linear")
    return add_offset_rms_norm_fp8_linear_chain(x, residual, norm_weight, eps, offset, weight, weight_scale, bias,
                                                out_dtype)


@add_offset_rms_norm_fp8_linear.register_fake
def _add_offset_rms_norm_fp8_linear_fake(x, residual, norm_weight, eps, offset, weight, weight_scale, bias,
                                         out_dtype):
    return _add_rms_norm_fp8_linear_fake(x, residual, norm_weight, eps, weight, weight_scale, bias, out_dtype)


@kiln_op("kiln::silu_and_mul_fp8_linear")
def silu_and_mul_fp8_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    check_silu_and_mul_args(gate, up, "silu_and_mul_fp8_linear")
    check_fused_weight(gate, weight, weight_scale, bias, "silu_and_mul_fp8_linear")
    return silu_and_mul_fp8_linear_chain(gate, up, weight, weight_scale, bias, out_dtype)


@silu_and_mul_fp8_linear.register_fake
def _silu_and_mul_fp8_linear_fake(gate, up, weight, weight_scale, bias, out_dtype):
    return _projected_fake(gate, weight, out_dtype)


@kiln_op("kiln::gelu_tanh_and_mul_fp8_linear")
def gelu_tanh_and_mul_fp8_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                                 weight_scale: torch.Tensor, bias: torch.Tensor | None,
                                 out_dtype: torch.dtype) -> torch.Tensor:
    check_silu_and_mul_args(gate, up, "gelu_tanh_and_mul_fp8_linear")
    check_fused_weight(gate, weight, weight_scale, bias, "gelu_tanh_and_mul_fp8_linear")
    return gelu_tanh_and_mul_fp8_linear_chain(gate, up, weight, weight_scale, bias, out_dtype)


@gelu_tanh_and_mul_fp8_linear.register_fake
def _gelu_tanh_and_mul_fp8_linear_fake(gate, up, weight, weight_scale, bias, out_dtype):
    return _projected_fake(gate, weight, out_dtype)


@kiln_op("kiln::quantize_fp8_linear")
def quantize_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
    check_fused_weight(x, weight, weight_scale, bias, "quantize_fp8_linear")
    return quantize_fp8_linear_chain(x, weight, weight_scale, bias, out_dtype)


@quantize_fp8_linear.register_fake
def _quantize_fp8_linear_fake(x, weight, weight_scale, bias, out_dtype):
    return _projected_fake(x, weight, out_dtype)
