"""`kiln::silu_and_mul` and `kiln::gelu_tanh_and_mul`: the gated MLP's activation,
`act(gate) * up`, in one pass (SiLU: Llama and most; GELU with the tanh approximation: Gemma).

    gate, up  [..., I]  same shape; may be strided views (the two halves of a merged
                        gate/up projection), the last dimension contiguous or not
Returns a contiguous [..., I] tensor. Arithmetic follows the eager graph: silu is computed
in float32 and rounded to the dtype, then multiplied by `up` and rounded again.

The CPU implementation is the reference below; `kiln.kernels.triton_activation` registers
the CUDA one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.library import kiln_op


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate) * up).contiguous()


@kiln_op("kiln::silu_and_mul", mutates_args=())
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return silu_and_mul_reference(gate, up)


@silu_and_mul.register_fake
def _silu_and_mul_fake(gate, up):
    return torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)


def gelu_tanh_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.gelu(gate, approximate="tanh") * up).contiguous()


@kiln_op("kiln::gelu_tanh_and_mul", mutates_args=())
def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gelu_tanh_and_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return gelu_tanh_and_mul_reference(gate, up)


@gelu_tanh_and_mul.register_fake
def _gelu_tanh_and_mul_fake(gate, up):
    return torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
