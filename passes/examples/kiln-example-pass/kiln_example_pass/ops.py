"""`kiln_example::gelu_tanh_and_mul(gate, up)` = `gelu(gate, approximate="tanh") * up`.

    gate, up  [..., I]  same shape and dtype
Returns a new contiguous [..., I] tensor. Rounding follows the eager graph it replaces: the
activation is rounded to the dtype, then multiplied by `up` and rounded again, so on CPU
(where this reference runs) the fused graph computes exactly what the unfused one did.

Three implementations, as every Kiln custom op has:
- the CPU reference below (plain torch; also the ground truth in tests);
- a fake implementation (`register_fake`): shape and dtype only, used while tracing;
- a CUDA implementation in Triton (`kiln_example_pass.triton_ops`), registered for the
  CUDA dispatch key when a GPU and Triton are present.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("kiln_example_pass")


def gelu_tanh_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.gelu(gate, approximate="tanh") * up).contiguous()


def check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"gelu_tanh_and_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.dtype != up.dtype:
        raise ValueError(f"gelu_tanh_and_mul: gate is {gate.dtype} but up is {up.dtype}")


@torch.library.custom_op("kiln_example::gelu_tanh_and_mul", mutates_args=())
def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_inputs(gate, up)
    return gelu_tanh_and_mul_reference(gate, up)


@gelu_tanh_and_mul.register_fake
def _gelu_tanh_and_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_inputs(gate, up)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def _register_cuda_kernel() -> bool:
    """Import the Triton module (which registers the CUDA kernel) when it can run."""
    if not torch.cuda.is_available():
        return False
    try:
        import kiln_example_pass.triton_ops  # noqa: F401
    except ImportError as e:
        logger.warning("CUDA is present but Triton is not (%s): gelu_tanh_and_mul uses its reference", e)
        return False
    return True


CUDA_KERNEL_REGISTERED = _register_cuda_kernel()
