"""FP8 (e4m3) GEMMs: `kiln::quantize_fp8_per_token` and `kiln::fp8_linear`, and the
quantization fused into the ops that produce a projection's input: `kiln::rms_norm_quant_fp8`,
`kiln::add_rms_norm_quant_fp8`, `kiln::silu_and_mul_quant_fp8`, and the offset norm form's
(`kiln::offset_rms_norm_quant_fp8`, `kiln::add_offset_rms_norm_quant_fp8`: Gemma's, Qwen3-Next's
and the weight-in-float32 norms) and Gemma's GeGLU (`kiln::gelu_tanh_and_mul_quant_fp8`).

    quantize_fp8_per_token(x [..., K]) -> (xq [..., K] float8_e4m3fn, scale [..., 1] float32)
        x ~= xq * scale, one scale per row (token): max|row| / 448, the e4m3 range.
    fp8_linear(xq, x_scale, weight [N, K] float8_e4m3fn, weight_scale [N] float32, bias, out_dtype)
        -> [..., N] = (xq * x_scale) @ (weight * weight_scale[:, None]).T (+ bias), in out_dtype.

Weights carry one scale per output channel (`quantize_fp8_rowwise`, at load; a pre-quantized
checkpoint's per-tensor scale is the same scale repeated). Activations are quantized per
token at run time, so the pair is two ops in the graph: a pass can fuse the quantization
into the kernel that produces the activation. Both references run `torch._scaled_mm` with
row-wise scales, which torch runs on CPU (2.13) and on CUDA (Hopper); where it refuses the
arguments (a torch build without it on this device, K or N not a multiple of 16 on CUDA) they
compute the same product from the dequantized operands in float32.

On CUDA the row-wise `_scaled_mm` runs with `use_fast_accum=True` (FP8_FAST_ACCUM): Hopper's
FP8 tensor cores then accumulate a whole K loop in their own (reduced-precision) accumulator,
without promoting partial sums to float32 every few K steps. That is what vLLM's and
TensorRT-LLM's FP8 GEMMs do (torch 2.11 on the H200 runs cuBLASLt's row-scaled kernels, which
honour the flag). The error it adds is small beside the e4m3 rounding of both operands
(bench/fp8_gemm.py measures both; bench/RESULTS.md, N1).
KILN_FP8_FAST_ACCUM=0 in the environment (read once, at import) turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kiln.kernels.activation import gelu_tanh_and_mul_reference, silu_and_mul_reference
from kiln.kernels.library import kiln_op
from kiln.kernels.rms_norm import (add_offset_rms_norm_reference, add_rms_norm_reference, check_rms_norm_args,
                                   offset_rms_norm_reference, rms_norm_reference)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Rows of zeros get this scale (not 0), so dequantizing never divides by zero.
MIN_SCALE = 1e-12
FP8_FAST_ACCUM = os.environ.get("KILN_FP8_FAST_ACCUM", "1") != "0"


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) e4m3 quantization in plain torch: (xq, scale [..., 1] float32).

    Each element is multiplied by the row's reciprocal scale (computed once, IEEE), not
    divided by the scale: the Triton kernels do the same, where a division per element made
    them bound by arithmetic instead of memory (SiLU-and-mul-quant at 16k rows: 476 against
    326 us on the H200, bench/RESULTS.md O4). The two differ in a few e4m3 values in 10^5,
    each by one step."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    xq = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def quantize_fp8_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight as e4m3 with one float32 scale per output channel ([N])."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8_rowwise: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    wq, scale = quantize_fp8_rows(weight)
    return wq, scale.squeeze(-1)


@kiln_op("kiln::quantize_fp8_per_token")
def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() < 1:
        raise ValueError("quantize_fp8_per_token: x must have at least one dimension")
    return quantize_fp8_rows(x)


@quantize_fp8_per_token.register_fake
def _quantize_fp8_per_token_fake(x):
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def check_fp8_linear_args(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                          weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError naming the argument that does not fit."""
    if xq.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear: xq and weight must be {FP8_DTYPE}, got {xq.dtype} and {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != xq.shape[-1]:
        raise ValueError(f"fp8_linear: weight of shape {tuple(weight.shape)} does not match x {tuple(xq.shape)}")
    if tuple(x_scale.shape) != (*xq.shape[:-1], 1):
        raise ValueError(f"fp8_linear: x_scale must have shape {(*xq.shape[:-1], 1)}, got {tuple(x_scale.shape)}")
    if tuple(weight_scale.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_linear: weight_scale must have shape ({weight.shape[0]},), got "
                         f"{tuple(weight_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias of shape {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")


def _scaled_mm_2d(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  out_dtype: torch.dtype, fast_accum: bool | None = None) -> torch.Tensor:
    m, (n, k) = xq.shape[0], weight.shape
    on_cpu = xq.device.type == "cpu"
    if m > 0 and (on_cpu or (k % 16 == 0 and n % 16 == 0)):
        # Row-wise scaled_mm produces bfloat16 on CUDA; other dtypes are cast from it.
        mm_dtype = out_dtype if on_cpu else torch.bfloat16
        fast = (FP8_FAST_ACCUM if fast_accum is None else fast_accum) and not on_cpu
        try:
            y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.float().contiguous(),
                                 scale_b=weight_scale.float().view(1, n), out_dtype=mm_dtype,
                                 use_fast_accum=fast)
            return y.to(out_dtype)
        except (RuntimeError, NotImplementedError):
            pass  # this torch build or device lacks row-wise scaled_mm: the float32 product below
    return ((xq.float() * x_scale.float()) @ (weight.float() * weight_scale.float()[:, None]).t()).to(out_dtype)


def fp8_linear_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype,
                         fast_accum: bool | None = None) -> torch.Tensor:
    """`fast_accum`: None follows FP8_FAST_ACCUM (CUDA only; bench/fp8_gemm.py sets it)."""
    k = weight.shape[1]
    lead = xq.shape[:-1]
    y = _scaled_mm_2d(xq.reshape(-1, k), x_scale.reshape(-1, 1), weight, weight_scale, out_dtype, fast_accum)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.view(*lead, weight.shape[0])


@kiln_op("kiln::fp8_linear")
def fp8_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    check_fp8_linear_args(xq, x_scale, weight, weight_scale, bias)
    return fp8_linear_reference(xq, x_scale, weight, weight_scale, bias, out_dtype)


@fp8_linear.register_fake
def _fp8_linear_fake(xq, x_scale, weight, weight_scale, bias, out_dtype):
    check_fp8_linear_args(xq, x_scale, weight, weight_scale, bias)
    return xq.new_empty((*xq.shape[:-1], weight.shape[0]), dtype=out_dtype)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight * scale, broadcast per output channel ([N] or [N, 1]) or per tensor ([] or [1])."""
    s = scale.float()
    if s.numel() != 1:
        s = s.reshape(-1, *([1] * (weight.dim() - 1)))
    return (weight.float() * s).to(dtype)


def linear_fp8_dequantized(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same projection with the weight dequantized (tests: what fp8_linear approximates)."""
    return F.linear(x, dequantize_fp8(weight, weight_scale, x.dtype), bias)


# ---- the quantization fused into the kernel producing the activation ---------------------------
# Each returns what `quantize_fp8_per_token` of the unfused op's output returns (the norm's
# or activation's output rounded to its dtype first, as the unfused graph rounds it), so the
# `quantize_fp8` pass swaps one for the other without changing a number.

def _fake_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@kiln_op("kiln::rms_norm_quant_fp8")
def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight)
    return quantize_fp8_rows(rms_norm_reference(x, weight, eps))


@rms_norm_quant_fp8.register_fake
def _rms_norm_quant_fp8_fake(x, weight, eps):
    return _fake_quantized(x)


@kiln_op("kiln::add_rms_norm_quant_fp8")
def add_rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    out, summed = add_rms_norm_reference(x, residual, weight, eps)
    return (*quantize_fp8_rows(out), summed)


@add_rms_norm_quant_fp8.register_fake
def _add_rms_norm_quant_fp8_fake(x, residual, weight, eps):
    return (*_fake_quantized(x), torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype),
                                             device=x.device))


@kiln_op("kiln::offset_rms_norm_quant_fp8")
def offset_rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight)
    return quantize_fp8_rows(offset_rms_norm_reference(x, weight, eps, offset))


@offset_rms_norm_quant_fp8.register_fake
def _offset_rms_norm_quant_fp8_fake(x, weight, eps, offset):
    return _fake_quantized(x)


@kiln_op("kiln::add_offset_rms_norm_quant_fp8")
def add_offset_rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                  offset: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    out, summed = add_offset_rms_norm_reference(x, residual, weight, eps, offset)
    return (*quantize_fp8_rows(out), summed)


@add_offset_rms_norm_quant_fp8.register_fake
def _add_offset_rms_norm_quant_fp8_fake(x, residual, weight, eps, offset):
    return _add_rms_norm_quant_fp8_fake(x, residual, weight, eps)


@kiln_op("kiln::silu_and_mul_quant_fp8")
def silu_and_mul_quant_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if gate.shape != up.shape:
        raise ValueError(f"silu_and_mul_quant_fp8: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return quantize_fp8_rows(silu_and_mul_reference(gate, up))


@silu_and_mul_quant_fp8.register_fake
def _silu_and_mul_quant_fp8_fake(gate, up):
    return _fake_quantized(gate)


@kiln_op("kiln::gelu_tanh_and_mul_quant_fp8")
def gelu_tanh_and_mul_quant_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if gate.shape != up.shape:
        raise ValueError(f"gelu_tanh_and_mul_quant_fp8: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ "
                         "in shape")
    return quantize_fp8_rows(gelu_tanh_and_mul_reference(gate, up))


@gelu_tanh_and_mul_quant_fp8.register_fake
def _gelu_tanh_and_mul_quant_fp8_fake(gate, up):
    return _fake_quantized(gate)

