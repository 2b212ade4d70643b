"""The Triton kernel of `kiln_example::gelu_tanh_and_mul`, registered for CUDA on import.

One program handles BLOCK contiguous elements of the flattened tensors. Importing this
module defines the kernel; to run it on CPU tensors (tests), set `TRITON_INTERPRET=1`
before Triton is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_example_pass.ops import check_inputs, gelu_tanh_and_mul

BLOCK = 1024
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a global a kernel reads must be constexpr


@triton.jit
def _gelu_tanh_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inner = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
    tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
    dt = out_ptr.dtype.element_ty
    activated = (0.5 * g * (1.0 + tanh)).to(dt)  # rounded like the eager gelu's output
    tl.store(out_ptr + offs, (activated.to(tl.float32) * u).to(dt), mask=mask)


def gelu_tanh_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_inputs(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _gelu_tanh_and_mul_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK)
    return out


@gelu_tanh_and_mul.register_kernel("cuda")
def _gelu_tanh_and_mul_cuda(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gelu_tanh_and_mul_triton(gate, up)
