"""Triton kernel of a gated DeltaNet decode step (CUDA): the delta rule over the states in place.

A decode step of a gated DeltaNet layer reads and writes every running sequence's recurrent
state (head_k x head_v float32 per value head: 2 MiB a layer a sequence for Qwen3-Next), which
dominates the layer's memory traffic. The torch form (`decode_rule_reference`) gathers the
states by slot, runs ~8 elementwise passes over them and scatters them back; this kernel reads
each state tile once and writes it once: program (row, value head, block of BLOCK_V value
columns) loads its [head_k, BLOCK_V] tile of the row's slot, decays it, applies the delta
update with the token's k, v and beta, stores it and writes the output columns.

A row whose sequence has no earlier tokens (seq_len <= 1: a one-token prompt, or a padded row
with seq_len 0 and the null slot) starts from zeros whatever its slot holds. Padded rows share
slot 0 and race on it: nothing reads it.

Tested under the Triton interpreter against the reference (tests/test_recurrent_layers.py);
registered as `kiln::paged_gated_delta_net`'s CUDA implementation, which runs everything else
of the op (the convolution, prefills) as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.gated_delta_net import paged_gated_delta_net, paged_gated_delta_net_reference

# Value columns a program takes: a [128, 32] float32 tile is 16 KiB of registers over 4 warps.
BLOCK_V = 32


@triton.jit
def _gated_delta_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, continuing_ptr, out_ptr,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_st_slot, stride_st_head, stride_st_k,
    stride_ot, stride_oh,
    V_PER_K: tl.constexpr, HEAD_K: tl.constexpr, HEAD_V: tl.constexpr, K_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
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
    q = tl.load(q_ptr + row * stride_qt + key_head * stride_qh + ks, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_qt + key_head * stride_qh + ks, mask=k_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * stride_vt + head * stride_vh + cols, mask=v_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gt + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_gt + head).to(tl.float32)

    tile = state_ptr + slot * stride_st_slot + head * stride_st_head + ks[:, None] * stride_st_k + cols[None, :]
    mask = k_mask[:, None] & v_mask[None, :]
    state = tl.where(continuing, tl.load(tile, mask=mask, other=0.0), 0.0)
    state = state * tl.exp(g)
    remembered = tl.sum(state * k[:, None], axis=0)  # S^T k over this tile's value columns
    delta = (v - remembered) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(tile, state, mask=mask)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + cols, out, mask=v_mask)


def gated_delta_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              recurrent_state: torch.Tensor, slots: torch.Tensor, continuing: torch.Tensor
                              ) -> torch.Tensor:
    """`kiln.kernels.gated_delta_net.decode_rule_reference` as one kernel: q, k [B, Hk, Dk],
    v [B, Hv, Dv], g, beta [B, Hv] (float32), recurrent_state [slots, Hv, Dk, Dv] float32
    (written in place), slots [B], continuing [B] bool. Returns o [B, Hv, Dv] float32."""
    rows, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    if recurrent_state.dtype != torch.float32 or not recurrent_state.is_contiguous():
        raise ValueError("gated_delta_decode_triton: the recurrent state must be contiguous float32")
    out = torch.empty((rows, num_v_heads, head_v), dtype=torch.float32, device=v.device)
    if rows == 0:
        return out
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    continuing = continuing.to(torch.int32).contiguous()  # 0: the row's state starts as zeros
    block_v = min(BLOCK_V, triton.next_power_of_2(head_v))
    _gated_delta_decode_kernel[(rows, num_v_heads, triton.cdiv(head_v, block_v))](
        q, k, v, g, beta, recurrent_state, slots.to(torch.int32).contiguous(), continuing, out,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
        recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
        out.stride(0), out.stride(1),
        V_PER_K=num_v_heads // num_k_heads, HEAD_K=head_k, HEAD_V=head_v, K_PAD=triton.next_power_of_2(head_k),
        BLOCK_V=block_v, num_warps=4,
    )
    return out


@paged_gated_delta_net.register_kernel("cuda")
def _paged_gated_delta_net_cuda(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, recurrent_state,
                                state_slots, seq_lens, query_start_loc, num_k_heads, head_k_dim, head_v_dim):
    return paged_gated_delta_net_reference(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, recurrent_state,
                                           state_slots, seq_lens, query_start_loc, num_k_heads, head_k_dim,
                                           head_v_dim, decode_rule=gated_delta_decode_triton)
