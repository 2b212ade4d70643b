"""`kiln::rms_norm` and `kiln::add_rms_norm`: RMSNorm, alone or fused with the residual add.

Both normalise over the last dimension with the arithmetic of Hugging Face's Llama/Qwen
RMSNorm, so a graph rewritten by the `fuse_rmsnorm` pass computes what the model computed:

    h   = x.float() * rsqrt(mean(x.float()**2, -1) + eps)
    out = weight * h.to(x.dtype)            # the product is rounded to x.dtype

`add_rms_norm(x, residual, weight, eps)` first forms `s = x + residual` (rounded to the
dtype, as the eager add is), normalises `s`, and returns `(out, s)`: `s` is the residual
stream the next layer adds to. The same op serves Qwen3's per-head q/k norm (a leading
dimension more; the weight has head_dim entries).

`kiln::offset_rms_norm(x, weight, eps, offset)` and `kiln::add_offset_rms_norm` are the form of
Gemma's, Qwen3-Next's and Qwen3.5's RMSNorm, whose weights are stored as offsets from 1: the
weight joins in float32 and the product is rounded once,

    out = (h * (offset + weight.float())).to(x.dtype)     # Gemma, Qwen3-Next: offset = 1

and, with offset 0, GPT-OSS's, OLMo 2/3's, Helium's and Nemotron-H's `(weight * h).to(x.dtype)`.

`kiln::gated_rms_norm(x, gate, weight, eps)` is Qwen3-Next's and Qwen3.5's gated norm after a
gated DeltaNet layer: the RMSNorm above, times SiLU(gate) in float32, rounded to x's dtype.

Outputs are contiguous tensors of x's shape. The CPU implementation is the plain-torch
reference below; `kiln.kernels.triton_norm` registers the Triton one for CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.library import kiln_op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).contiguous()


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x + residual).contiguous()
    return rms_norm_reference(summed, weight, eps), summed


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match the last "
                         f"dimension of x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape")


@kiln_op("kiln::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm_args(x, weight)
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


@kiln_op("kiln::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    return add_rms_norm_reference(x, residual, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(summed_dtype, weight.dtype), device=x.device)
    return out, torch.empty(x.shape, dtype=summed_dtype, device=x.device)


def offset_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (offset + weight.to(torch.float32))).to(x.dtype).contiguous()


def add_offset_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                  offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x + residual).contiguous()
    return offset_rms_norm_reference(summed, weight, eps, offset), summed


@kiln_op("kiln::offset_rms_norm", mutates_args=())
def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    check_rms_norm_args(x, weight)
    return offset_rms_norm_reference(x, weight, eps, offset)


@offset_rms_norm.register_fake
def _offset_rms_norm_fake(x, weight, eps, offset):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@kiln_op("kiln::add_offset_rms_norm", mutates_args=())
def add_offset_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    return add_offset_rms_norm_reference(x, residual, weight, eps, offset)


@add_offset_rms_norm.register_fake
def _add_offset_rms_norm_fake(x, residual, weight, eps, offset):
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (torch.empty(x.shape, dtype=summed_dtype, device=x.device),
            torch.empty(x.shape, dtype=summed_dtype, device=x.device))


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms_norm_reference(x, weight, eps) * F.silu(gate.to(torch.float32))).to(x.dtype).contiguous()


@kiln_op("kiln::gated_rms_norm", mutates_args=())
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm_args(x, weight)
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} and x {tuple(x.shape)} differ in shape")
    return gated_rms_norm_reference(x, gate, weight, eps)


@gated_rms_norm.register_fake
def _gated_rms_norm_fake(x, gate, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
