"""Triton kernel of a Mamba2 decode step (CUDA): the SSM's recurrence over the states in place.

As for the gated DeltaNet (kiln.kernels.triton_gated_delta_net), a decode step of a Mamba2
layer reads and writes every running sequence's SSM state (head_dim x state_size float32 per
head: 4 MiB a layer a sequence for Nemotron-H-56B's 128 heads of 64 x 128), which dominates its
memory traffic. The torch form (`kiln.kernels.mamba2.scan_step` between a gather and a scatter
by slot) makes ~6 passes over them; this kernel reads each state tile once and writes it once:
program (row, head, block of BLOCK_P head_dim rows) loads its [BLOCK_P, state_size] tile,
decays it by exp(dt A), adds dt x B^T, stores it, and writes y = S C + D x for its rows.

A row whose sequence has no earlier tokens starts from zeros whatever its slot holds; padded
rows share the null slot 0. Tested under the Triton interpreter against the reference
(tests/test_recurrent_layers.py); registered as `kiln::paged_mamba2_scan`'s CUDA implementation,
which runs the rest (the convolution, prefills) as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.mamba2 import paged_mamba2_scan, paged_mamba2_scan_reference
from kiln.kernels.triton_causal_conv import conv_single_tokens_triton

# head_dim rows a program takes: a [16, 128] float32 tile over 4 warps.
BLOCK_P = 16


@triton.jit
def _mamba2_decode_kernel(
    x_ptr, b_ptr, c_ptr, dt_ptr, decay_ptr, d_ptr, state_ptr, slots_ptr, continuing_ptr, out_ptr,
    stride_xt, stride_bt, stride_dtt, stride_st_slot, stride_st_head, stride_st_p, stride_ot,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, STATE: tl.constexpr, STATE_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, STATE_PAD)
    p_mask = ps < HEAD_DIM
    n_mask = ns < STATE
    group = head // HEADS_PER_GROUP

    slot = tl.load(slots_ptr + row).to(tl.int64)
    continuing = tl.load(continuing_ptr + row) != 0
    x = tl.load(x_ptr + row * stride_xt + head * HEAD_DIM + ps, mask=p_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bt + group * STATE + ns, mask=n_mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * stride_bt + group * STATE + ns, mask=n_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * stride_dtt + head)
    decay = tl.load(decay_ptr + row * stride_dtt + head)
    skip = tl.load(d_ptr + head).to(tl.float32)

    tile = state_ptr + slot * stride_st_slot + head * stride_st_head + ps[:, None] * stride_st_p + ns[None, :]
    mask = p_mask[:, None] & n_mask[None, :]
    state = tl.where(continuing, tl.load(tile, mask=mask, other=0.0), 0.0)
    state = state * tl.exp(decay) + (dt * x)[:, None] * b[None, :]
    tl.store(tile, state, mask=mask)
    y = tl.sum(state * c[None, :], axis=1) + skip * x
    tl.store(out_ptr + row * stride_ot + head * HEAD_DIM + ps, y, mask=p_mask)


def mamba2_decode_triton(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, log_decay: torch.Tensor,
                         D: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, continuing: torch.Tensor
                         ) -> torch.Tensor:
    """One token a row: x [R, H, P], B, C [R, G, N] (per group), dt, log_decay [R, H] float32,
    D [H], ssm_state [slots, H, P, N] float32 (written in place), slots [R], continuing [R]
    bool. Returns y = S C + D x as [R, H * P] float32."""
    rows, heads, head_dim = x.shape
    groups, state = B.shape[1], B.shape[2]
    if ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous():
        raise ValueError("mamba2_decode_triton: the SSM state must be contiguous float32")
    out = torch.empty((rows, heads * head_dim), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    x, B, C = x.reshape(rows, -1).contiguous(), B.reshape(rows, -1).contiguous(), C.reshape(rows, -1).contiguous()
    dt, log_decay = dt.float().contiguous(), log_decay.float().contiguous()
    block_p = min(BLOCK_P, triton.next_power_of_2(head_dim))
    _mamba2_decode_kernel[(rows, heads, triton.cdiv(head_dim, block_p))](
        x, B, C, dt, log_decay, D.contiguous(), ssm_state, slots.to(torch.int32).contiguous(),
        continuing.to(torch.int32).contiguous(), out,
        x.stride(0), B.stride(0), dt.stride(0), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        out.stride(0),
        HEADS_PER_GROUP=heads // groups, HEAD_DIM=head_dim, STATE=state, STATE_PAD=triton.next_power_of_2(state),
        BLOCK_P=block_p, num_warps=4,
    )
    return out


@paged_mamba2_scan.register_kernel("cuda")
def _paged_mamba2_scan_cuda(x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, conv_state, ssm_state, state_slots,
                            seq_lens, query_start_loc, num_heads, head_dim, n_groups, state_size):
    return paged_mamba2_scan_reference(x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, conv_state, ssm_state,
                                       state_slots, seq_lens, query_start_loc, num_heads, head_dim, n_groups,
                                       state_size, decode_rule=mamba2_decode_triton,
                                       conv_rule=conv_single_tokens_triton)
