"""Triton kernel of a Mamba2 decode step (CUDA): everything after the convolution.

As for the gated DeltaNet (kiln.kernels.triton_gated_delta_net), a decode step of a Mamba2
layer reads and writes every running sequence's SSM state (head_dim x state_size float32 per
head: 4 MiB a layer a sequence for Nemotron-H-56B's 128 heads of 64 x 128), which dominates its
memory traffic past a few sequences; at batch 1 its torch form is mostly small kernels
(splitting x, B and C, dt's softplus and the decay, the states' gather and scatter). This
kernel is all of that: program (row, head, block of BLOCK_P head_dim rows) loads its x, its
group's B and C from the convolved row, computes dt and the decay from the raw dt, loads its
[BLOCK_P, state_size] state tile, decays it by exp(dt A), adds dt x B^T, stores it, and writes
y = S C + D x for its rows. (The convolution before it: kiln.kernels.triton_causal_conv.)

A row whose sequence has no earlier tokens starts from zeros whatever its slot holds; padded
rows share the null slot 0. Tested under the Triton interpreter against the reference
(tests/test_recurrent_layers.py); registered as `kiln::paged_mamba2_scan`'s CUDA implementation,
which runs prefills as the reference does.
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
    conv_ptr, dt_ptr, a_log_ptr, dt_bias_ptr, d_ptr, state_ptr, slots_ptr, continuing_ptr, out_ptr,
    stride_ct, stride_dtt, stride_dth, stride_st_slot, stride_st_head, stride_st_p, stride_ot, dt_min,
    NUM_HEADS: tl.constexpr, N_GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, STATE: tl.constexpr,
    STATE_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, STATE_PAD)
    p_mask = ps < HEAD_DIM
    n_mask = ns < STATE
    group = head // (NUM_HEADS // N_GROUPS)

    slot = tl.load(slots_ptr + row).to(tl.int64)
    continuing = tl.load(continuing_ptr + row) != 0
    # The convolved row is [x (H x P); B (G x N); C (G x N)], rounded to the model's dtype.
    conv_row = conv_ptr + row * stride_ct
    x = tl.load(conv_row + head * HEAD_DIM + ps, mask=p_mask, other=0.0).to(tl.float32)
    b = tl.load(conv_row + NUM_HEADS * HEAD_DIM + group * STATE + ns, mask=n_mask, other=0.0).to(tl.float32)
    c = tl.load(conv_row + NUM_HEADS * HEAD_DIM + (N_GROUPS + group) * STATE + ns, mask=n_mask,
                other=0.0).to(tl.float32)
    # dt = softplus(dt + dt_bias) (torch's: linear past 20); the log decay dt * -exp(A_log).
    pre = (tl.load(dt_ptr + row * stride_dtt + head * stride_dth).to(tl.float32)
           + tl.load(dt_bias_ptr + head).to(tl.float32))
    dt = tl.maximum(tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0)))), dt_min)
    decay = dt * -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    skip = tl.load(d_ptr + head).to(tl.float32)

    tile = state_ptr + slot * stride_st_slot + head * stride_st_head + ps[:, None] * stride_st_p + ns[None, :]
    mask = p_mask[:, None] & n_mask[None, :]
    state = tl.where(continuing, tl.load(tile, mask=mask, other=0.0), 0.0)
    state = state * tl.exp(decay) + (dt * x)[:, None] * b[None, :]
    tl.store(tile, state, mask=mask)
    y = tl.sum(state * c[None, :], axis=1) + skip * x
    tl.store(out_ptr + row * stride_ot + head * HEAD_DIM + ps, y, mask=p_mask)


def mamba2_decode_triton(conv: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         D: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, continuing: torch.Tensor,
                         num_heads: int, head_dim: int, n_groups: int, state_size: int, dt_min: float = 0.0
                         ) -> torch.Tensor:
    """`kiln.kernels.mamba2.decode_rule_reference` as one kernel: conv [R, conv_dim] (the
    convolved rows), dt [R, H] (before softplus), ssm_state [slots, H, P, N] float32 (written in
    place), slots [R], continuing [R] bool. Returns y = S C + D x as [R, H * P] float32."""
    rows = conv.shape[0]
    if ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous():
        raise ValueError("mamba2_decode_triton: the SSM state must be contiguous float32")
    out = torch.empty((rows, num_heads * head_dim), dtype=torch.float32, device=conv.device)
    if rows == 0:
        return out
    conv = conv if conv.stride(-1) == 1 else conv.contiguous()
    block_p = min(BLOCK_P, triton.next_power_of_2(head_dim))
    _mamba2_decode_kernel[(rows, num_heads, triton.cdiv(head_dim, block_p))](
        conv, dt, A_log, dt_bias, D, ssm_state, slots.contiguous(), continuing.contiguous(), out,
        conv.stride(0), dt.stride(0), dt.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        out.stride(0), float(dt_min),
        NUM_HEADS=num_heads, N_GROUPS=n_groups, HEAD_DIM=head_dim, STATE=state_size,
        STATE_PAD=triton.next_power_of_2(state_size), BLOCK_P=block_p, num_warps=4,
    )
    return out


@paged_mamba2_scan.register_kernel("cuda")
def _paged_mamba2_scan_cuda(x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, conv_state, ssm_state, state_slots,
                            seq_lens, query_start_loc, num_heads, head_dim, n_groups, state_size, dt_min=0.0):
    return paged_mamba2_scan_reference(x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, conv_state, ssm_state,
                                       state_slots, seq_lens, query_start_loc, num_heads, head_dim, n_groups,
                                       state_size, dt_min, decode_rule=mamba2_decode_triton,
                                       conv_rule=conv_single_tokens_triton)
