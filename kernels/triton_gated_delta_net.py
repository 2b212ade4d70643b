"""Triton kernel of a gated DeltaNet decode step (CUDA): everything after the convolution.

A decode step of a gated DeltaNet layer reads and writes every running sequence's recurrent
state (head_k x head_v float32 per value head: 2 MiB a layer a sequence for Qwen3-Next), which
dominates the layer's memory traffic at batch sizes past a few; at batch 1 its torch form is
~40 small kernels a layer (splitting the heads, the L2 norms, the gates' softplus and sigmoid,
gathering and scattering the states). This kernel is all of that: program (row, value head,
block of BLOCK_V value columns) loads its key head's q and k from the convolved row and
normalises them, computes the head's decay and write strength from a and b, loads its
[head_k, BLOCK_V] tile of the row's slot, decays it, applies the delta update, stores it and
writes the output columns. (The convolution before it: kiln.kernels.triton_causal_conv.)

A row whose sequence has no earlier tokens (seq_len <= 1: a one-token prompt, or a padded row
with seq_len 0 and the null slot) starts from zeros whatever its slot holds. Padded rows share
slot 0 and race on it: nothing reads it.

Tested under the Triton interpreter against the reference (tests/test_recurrent_layers.py);
registered as `kiln::paged_gated_delta_net`'s CUDA implementation, which runs prefills as the
reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.gated_delta_net import paged_gated_delta_net, paged_gated_delta_net_reference
from kiln.kernels.triton_causal_conv import conv_single_tokens_triton

# Value columns a program takes: a [128, 32] float32 tile is 16 KiB of registers over 4 warps.
BLOCK_V = 32


@triton.jit
def _gated_delta_decode_kernel(
    conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, continuing_ptr, out_ptr,
    stride_ct, stride_at, stride_ah, stride_bt, stride_bh, stride_st_slot, stride_st_head, stride_st_k,
    stride_ot, stride_oh, q_scale, beta_scale,
    NUM_K_HEADS: tl.constexpr, V_PER_K: tl.constexpr, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr,
    K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, K_PAD)
    k_mask = ks < HEAD_K
    v_mask = cols < HEAD_V
    key_head = head // V_PER_K

    slot = tl.load(slots_ptr + row).to(tl.int64)
    continuing = tl.load(continuing_ptr + row) != 0
    conv_row = conv_ptr + row * stride_ct
    # The convolved row is [q (Hk x Dk); k (Hk x Dk); v (Hv x Dv)], rounded to the model's dtype.
    q = tl.load(conv_row + key_head * HEAD_K + ks, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(conv_row + (NUM_K_HEADS + key_head) * HEAD_K + ks, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(conv_row + 2 * NUM_K_HEADS * HEAD_K + head * HEAD_V + cols, mask=v_mask, other=0.0).to(tl.float32)
    q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    # g = -exp(A_log) * softplus(a + dt_bias) (torch's softplus: linear past 20), beta =
    # beta_scale * sigmoid(b).
    pre = (tl.load(a_ptr + row * stride_at + head * stride_ah).to(tl.float32)
           + tl.load(dt_bias_ptr + head).to(tl.float32))
    softplus = tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus
    beta = tl.sigmoid(tl.load(b_ptr + row * stride_bt + head * stride_bh).to(tl.float32)) * beta_scale

    tile = state_ptr + slot * stride_st_slot + head * stride_st_head + ks[:, None] * stride_st_k + cols[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    state = tl.where(continuing, tl.load(tile, mask=mask, other=0.0), 0.0)
    state = state * tl.exp(g)
    remembered = tl.sum(state * k[:, None], axis=0)  # S^T k over this tile's value columns
    delta = (v - remembered) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(tile, state, mask=mask)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + cols, out.to(out_ptr.dtype.element_ty), mask=v_mask)


def gated_delta_decode_triton(conv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                              dt_bias: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
                              continuing: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                              beta_scale: float = 1.0) -> torch.Tensor:
    """`kiln.kernels.gated_delta_net.decode_rule_reference` as one kernel: conv [B, conv_dim]
    (the convolved rows), a, b [B, Hv], recurrent_state [slots, Hv, Dk, Dv] float32 (written in
    place), slots [B], continuing [B] bool. Returns o [B, Hv, Dv] in conv's dtype (the float32
    sums rounded once, as the op's output is)."""
    rows = conv.shape[0]
    num_v_heads = a.shape[1]
    if recurrent_state.dtype != torch.float32 or not recurrent_state.is_contiguous():
        raise ValueError("gated_delta_decode_triton: the recurrent state must be contiguous float32")
    out = torch.empty((rows, num_v_heads, head_v_dim), dtype=conv.dtype, device=conv.device)
    if rows == 0:
        return out
    conv = conv if conv.stride(-1) == 1 else conv.contiguous()
    block_v = min(BLOCK_V, triton.next_power_of_2(head_v_dim))
    _gated_delta_decode_kernel[(rows, num_v_heads, triton.cdiv(head_v_dim, block_v))](
        conv, a, b, A_log, dt_bias, recurrent_state, slots.contiguous(), continuing.contiguous(), out,
        conv.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
        out.stride(0), out.stride(1), head_k_dim ** -0.5, float(beta_scale),
        NUM_K_HEADS=num_k_heads, V_PER_K=num_v_heads // num_k_heads, HEAD_K=head_k_dim, HEAD_V=head_v_dim,
        K_PAD=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v, num_warps=4,
    )
    return out


@paged_gated_delta_net.register_kernel("cuda")
def _paged_gated_delta_net_cuda(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, recurrent_state,
                                state_slots, seq_lens, query_start_loc, num_k_heads, head_k_dim, head_v_dim,
                                beta_scale=1.0):
    return paged_gated_delta_net_reference(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, recurrent_state,
                                           state_slots, seq_lens, query_start_loc, num_k_heads, head_k_dim,
                                           head_v_dim, beta_scale, decode_rule=gated_delta_decode_triton,
                                           conv_rule=conv_single_tokens_triton)
