"""`kiln::add_gated_shared_expert` as one Triton kernel (CUDA).

Qwen2-MoE, Qwen3-Next and Qwen3.5's MoE blocks add a shared expert to the routed experts,
scaled by a sigmoid gate of one column: `out + sigmoid(hidden @ w_gate.T) * shared`. In torch
that is four launches a layer (a one-column GEMV, the sigmoid, the product, the sum) of a few
microseconds each for a few KB of work, which a batch-1 decode of Qwen3-Next-80B pays 48
times a step. Here one program takes one token: the gate's dot product over the hidden row in
float32, then the gated sum, each value rounded to the activation dtype where the torch chain
rounds it (the logit, the sigmoid, the product, the sum). Only the dot product's summation
order differs from the chain's GEMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.moe import add_gated_shared_expert as add_gated_shared_expert_op
from kiln.kernels.moe import add_gated_shared_expert_reference, check_gated_shared_expert_args
from kiln.kernels.triton_activation import _rows
from kiln.kernels.triton_common import num_warps_for, pdl_launch_args, pow2_at_least, wait_for_previous_kernel


@triton.jit
def _add_gated_shared_expert_kernel(out_ptr, shared_ptr, hidden_ptr, w_ptr, y_ptr, n_cols, k_cols,
                                    stride_out, stride_shared, stride_hidden,
                                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    dt = hidden_ptr.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + ks, mask=ks < k_cols, other=0.0).to(tl.float32)  # no kernel's output: before the wait
    wait_for_previous_kernel(PDL)
    h = tl.load(hidden_ptr + row * stride_hidden + ks, mask=ks < k_cols, other=0.0).to(tl.float32)
    logit = tl.sum(h * w, axis=0).to(dt).to(tl.float32)
    gate = tl.sigmoid(logit).to(dt).to(tl.float32)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    s = tl.load(shared_ptr + row * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(out_ptr + row * stride_out + cols, mask=mask, other=0.0).to(tl.float32)
    y = o + (gate * s).to(dt).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_gated_shared_expert_triton(out: torch.Tensor, shared: torch.Tensor, hidden: torch.Tensor,
                                   gate_weight: torch.Tensor) -> torch.Tensor:
    dtypes = {out.dtype, shared.dtype, hidden.dtype, gate_weight.dtype}
    if len(dtypes) != 1:  # mixed precisions: the torch chain, with its promotions
        return add_gated_shared_expert_reference(out, shared, hidden, gate_weight)
    y = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    rows = out.numel() // out.shape[-1] if out.shape[-1] else 0
    if rows == 0:
        return y
    o2, s2, h2 = _rows(out), _rows(shared), _rows(hidden)
    n, k = out.shape[-1], hidden.shape[-1]
    block_n, block_k = pow2_at_least(n), pow2_at_least(k)
    _add_gated_shared_expert_kernel[(rows,)](
        o2, s2, h2, gate_weight.reshape(k).contiguous(), y, n, k, o2.stride(0), s2.stride(0), h2.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps_for(max(block_n, block_k)),
        **pdl_launch_args(out.device, "moe"))
    return y


@add_gated_shared_expert_op.register_kernel("cuda")
def _add_gated_shared_expert_cuda(out: torch.Tensor, shared: torch.Tensor, hidden: torch.Tensor,
                                  gate_weight: torch.Tensor) -> torch.Tensor:
    check_gated_shared_expert_args(out, shared, hidden, gate_weight)
    return add_gated_shared_expert_triton(out, shared, hidden, gate_weight)
