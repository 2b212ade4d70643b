"""Triton kernel of Mamba's selective scan (CUDA): any step, prefills, chunks and decodes alike.

The reference (kiln.kernels.mamba) scans token by token in torch: per token a handful of
kernels over [sequences, intermediate, state_size] tensors, and per step a host read of the
rows (`step_rows`) to sort decodes from prefills. Here program (sequence, block of BLOCK_D
channels) holds its channels' [BLOCK_D, state_size] float32 state in registers: it loads it
from the sequence's slot (zeros where the sequence starts this step), walks the sequence's
tokens of the step (`query_start_loc`, read on the device) computing dt = softplus(dt_raw +
dt_bias), decaying by exp(dt A), adding dt x B, and writing y = (S . C + D x) * silu(z), then
stores the state once. Nothing is read on the host, so every step kind is one launch and a
decode step captures into a CUDA graph.

Rows of no sequence (a mixed step's padding) stay zero. A decode step's padded rows (no
earlier tokens) share the null slot 0. Tested under the Triton interpreter against the
reference (tests/test_mamba.py); registered as `kiln::paged_selective_scan`'s CUDA
implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.mamba import paged_selective_scan

# Channels a program: [32, 16] float32 state tiles (Mamba's state_size is 16) on one warp;
# Falcon-Mamba-7B's 8,192 channels make 256 programs a sequence.
BLOCK_D = 32


@triton.jit
def _selective_scan_kernel(
    x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, a_log_ptr, d_ptr, dt_bias_ptr, state_ptr, slots_ptr, seq_lens_ptr, starts_ptr,
    out_ptr, channels, stride_x, stride_dt, stride_b, stride_c, stride_z, stride_st_slot, stride_st_d, stride_out,
    STATE: tl.constexpr, STATE_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ns = tl.arange(0, STATE_PAD)
    d_mask = ds < channels
    n_mask = ns < STATE
    mask = d_mask[:, None] & n_mask[None, :]

    start = tl.load(starts_ptr + seq).to(tl.int64)  # int64 bounds: an int64 token index in the loop
    end = tl.load(starts_ptr + seq + 1).to(tl.int64)
    continuing = tl.load(seq_lens_ptr + seq) > end - start  # tokens before this step's
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    A = -tl.exp(tl.load(a_log_ptr + ds[:, None] * STATE + ns[None, :], mask=mask, other=0.0).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    skip = tl.load(d_ptr + ds, mask=d_mask, other=0.0).to(tl.float32)
    tile = state_ptr + slot * stride_st_slot + ds[:, None] * stride_st_d + ns[None, :]
    state = tl.where(continuing, tl.load(tile, mask=mask, other=0.0), 0.0)
    for t64 in range(start, end):
        x = tl.load(x_ptr + t64 * stride_x + ds, mask=d_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + t64 * stride_z + ds, mask=d_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + t64 * stride_b + ns, mask=n_mask, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t64 * stride_c + ns, mask=n_mask, other=0.0).to(tl.float32)
        # dt = softplus(dt_raw + dt_bias) (torch's: linear past 20).
        pre = tl.load(dt_ptr + t64 * stride_dt + ds, mask=d_mask, other=0.0).to(tl.float32) + dt_bias
        dt = tl.where(pre > 20.0, pre, tl.log(1.0 + tl.exp(tl.minimum(pre, 20.0))))
        state = state * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * b[None, :]
        y = (tl.sum(state * c[None, :], axis=1) + skip * x) * (z * tl.sigmoid(z))
        tl.store(out_ptr + t64 * stride_out + ds, y.to(out_ptr.dtype.element_ty), mask=d_mask)
    tl.store(tile, state, mask=mask)


def selective_scan_triton(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor,
                          A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                          state_slots: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
                          ) -> torch.Tensor:
    """`kiln.kernels.mamba.paged_selective_scan_reference` as one kernel: x, dt, z [T, D] (unit
    last stride; views of a wider tensor are fine), B, C [T, N], ssm_state [slots, D, N] float32
    (written in place). Returns [T, D] in x's dtype."""
    if ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous():
        raise ValueError("selective_scan_triton: the SSM state must be contiguous float32")
    tokens, channels = x.shape
    state_size = A_log.shape[-1]
    out = torch.zeros((tokens, channels), dtype=x.dtype, device=x.device)
    num_seqs = seq_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    x, dt, B, C, z = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, dt, B, C, z))
    block_d = min(BLOCK_D, triton.next_power_of_2(channels))
    _selective_scan_kernel[(num_seqs, triton.cdiv(channels, block_d))](
        x, dt, B, C, z, A_log.contiguous(), D.contiguous(), dt_bias.contiguous(), ssm_state, state_slots.contiguous(),
        seq_lens.contiguous(), query_start_loc.contiguous(), out, channels,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0), z.stride(0), ssm_state.stride(0), ssm_state.stride(1),
        out.stride(0),
        STATE=state_size, STATE_PAD=triton.next_power_of_2(state_size), BLOCK_D=block_d, num_warps=1,
    )
    return out


@paged_selective_scan.register_kernel("cuda")
def _paged_selective_scan_cuda(x, dt, B, C, z, A_log, D, dt_bias, ssm_state, state_slots, seq_lens, query_start_loc):
    return selective_scan_triton(x, dt, B, C, z, A_log, D, dt_bias, ssm_state, state_slots, seq_lens,
                                 query_start_loc)
