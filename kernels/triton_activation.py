"""Triton kernel for `kiln::silu_and_mul` (registered for CUDA).

Grid: (rows, column blocks). gate and up are read with their own row strides, so the two
halves of a merged gate/up projection are consumed in place, without a split copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.activation import silu_and_mul as silu_and_mul_op
from kiln.kernels.activation import silu_and_mul_reference

BLOCK_COLS = 1024


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    activated = (g * tl.sigmoid(g)).to(dt)  # rounded like the eager silu's output
    tl.store(out_ptr + row * n_cols + cols, (activated.to(tl.float32) * u).to(dt), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, n)
    except RuntimeError:  # leading dims not mergeable
        return x.reshape(-1, n)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.dtype != up.dtype:
        return silu_and_mul_reference(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.shape[-1] if gate.dim() else 1
    if out.numel() == 0:
        return out
    g2, u2 = _rows(gate), _rows(up)
    block = min(BLOCK_COLS, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
        g2, u2, out, n, g2.stride(0), u2.stride(0), BLOCK=block, num_warps=4,
    )
    return out


@silu_and_mul_op.register_kernel("cuda")
def _silu_and_mul_cuda(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(gate, up)
