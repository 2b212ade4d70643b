"""Triton kernels for `kiln::silu_and_mul` and `kiln::gelu_tanh_and_mul` (registered for CUDA).

Grid: (rows, column blocks). gate and up are read with their own row strides, so the two
halves of a merged gate/up projection are consumed in place, without a split copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.activation import gelu_tanh_and_mul as gelu_tanh_and_mul_op
from kiln.kernels.activation import gelu_tanh_and_mul_reference
from kiln.kernels.activation import silu_and_mul as silu_and_mul_op
from kiln.kernels.activation import silu_and_mul_reference
from kiln.kernels.triton_common import pdl_launch_args, wait_for_previous_kernel

BLOCK_COLS = 1024


@triton.jit
def gated_activation(g, GELU_TANH: tl.constexpr):
    """act(g) in float32 (g float32): SiLU, or GELU with the tanh approximation."""
    if GELU_TANH:
        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), with 1 + tanh(y) = 2 sigmoid(2y).
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g * tl.sigmoid(2.0 * inner)
    else:
        return g * tl.sigmoid(g)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr,
                         GELU_TANH: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    activated = gated_activation(g, GELU_TANH).to(dt)  # rounded like the eager activation's output
    tl.store(out_ptr + row * n_cols + cols, (activated.to(tl.float32) * u).to(dt), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, n)
    except RuntimeError:  # leading dims not mergeable
        return x.reshape(-1, n)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """act(gate) * up with act = SiLU, or GELU (tanh approximation) with `gelu_tanh`."""
    name = "gelu_tanh_and_mul" if gelu_tanh else "silu_and_mul"
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.dtype != up.dtype:
        return (gelu_tanh_and_mul_reference if gelu_tanh else silu_and_mul_reference)(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.shape[-1] if gate.dim() else 1
    if out.numel() == 0:
        return out
    g2, u2 = _rows(gate), _rows(up)
    block = min(BLOCK_COLS, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
        g2, u2, out, n, g2.stride(0), u2.stride(0), BLOCK=block, GELU_TANH=gelu_tanh, num_warps=4,
        **pdl_launch_args(out.device, "activation"),
    )
    return out


def gelu_tanh_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(gate, up, gelu_tanh=True)


@silu_and_mul_op.register_kernel("cuda")
def _silu_and_mul_cuda(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(gate, up)


@gelu_tanh_and_mul_op.register_kernel("cuda")
def _gelu_tanh_and_mul_cuda(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gelu_tanh_and_mul_triton(gate, up)
