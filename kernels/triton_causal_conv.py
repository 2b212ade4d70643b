"""A decode step's causal convolutions as one Triton kernel (CUDA): `conv_single_tokens`
(kiln.kernels.recurrent_steps) for the gated DeltaNet, Mamba2, Mamba and short-convolution layers.

The torch form gathers each row's conv state, concatenates the new input, multiplies, sums,
applies SiLU and scatters the shifted state back: about ten kernels a layer, each a few
microseconds at batch 1, where the data is a few KiB (Qwen3-Next-80B's 8,192 channels x 4
taps). Here one program takes BLOCK_C channels of one row: it reads the row's last
kernel - 1 inputs from its slot (zeros where the sequence starts this step), writes the
shifted ones back, and stores SiLU(conv) (or the conv alone) rounded to x's dtype, as the torch
form rounds. `kiln::paged_short_conv`'s CUDA implementation runs its decodes here; the gated
DeltaNet and Mamba2 CUDA implementations pass it as their `conv_rule`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.recurrent_steps import conv_single_tokens
from kiln.kernels.short_conv import paged_short_conv, paged_short_conv_reference

BLOCK_C = 256  # channels a program: Qwen3-Next-80B's 8,192 make 32 programs a row


@triton.jit
def _conv_single_tokens_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, slots_ptr, continuing_ptr, out_ptr, channels,
                               stride_x, stride_state_slot, stride_state_channel, stride_out,
                               WIDTH: tl.constexpr, W_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
                               HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    row = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_mask = ch < channels
    taps = tl.arange(0, W_PAD)
    past_mask = ch_mask[:, None] & (taps[None, :] < WIDTH - 1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    continuing = tl.load(continuing_ptr + row) != 0
    x = tl.load(x_ptr + row * stride_x + ch, mask=ch_mask, other=0.0)
    state_rows = state_ptr + slot * stride_state_slot + ch.to(tl.int64)[:, None] * stride_state_channel
    # The slot's last WIDTH - 1 inputs (taps 0 .. WIDTH - 2), and the same shifted by one tap:
    # the state this step leaves, its last tap the new input. Both loads come before the store.
    past = tl.load(state_rows + taps[None, :], mask=past_mask, other=0.0)
    shifted = tl.load(state_rows + taps[None, :] + 1, mask=past_mask & (taps[None, :] < WIDTH - 2), other=0.0)
    past = tl.where(continuing, past, 0.0)
    shifted = tl.where(continuing, shifted, 0.0)
    # As the torch form: the past inputs in x's dtype, products and sum in float32.
    w = tl.load(w_ptr + ch[:, None] * WIDTH + taps[None, :], mask=ch_mask[:, None] & (taps[None, :] < WIDTH),
                other=0.0).to(tl.float32)
    past_x = past.to(x.dtype).to(tl.float32)
    last = taps[None, :] == WIDTH - 1
    extended = tl.where(last, x.to(tl.float32)[:, None], past_x)
    out = tl.sum(extended * w, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)
    if SILU:
        out = out * tl.sigmoid(out)
    new_state = tl.where(taps[None, :] == WIDTH - 2, x[:, None].to(tl.float32), shifted.to(x.dtype).to(tl.float32))
    tl.store(state_rows + taps[None, :], new_state.to(state_ptr.dtype.element_ty), mask=past_mask)
    tl.store(out_ptr + row * stride_out + ch, out.to(out_ptr.dtype.element_ty), mask=ch_mask)


def conv_single_tokens_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              conv_state: torch.Tensor, slots: torch.Tensor, continuing: torch.Tensor,
                              silu: bool = True) -> torch.Tensor:
    """`conv_single_tokens` (x [B, C], weight [C, K], conv_state [slots, C, K - 1], written in
    place) as one kernel; tensors it cannot take (no unit last stride, a kernel of one tap) go
    to the torch form."""
    rows, channels = x.shape
    width = weight.shape[-1]
    if (width < 2 or x.stride(-1) != 1 or conv_state.stride(-1) != 1 or not weight.is_contiguous()
            or (bias is not None and not bias.is_contiguous())):
        return conv_single_tokens(x, weight, bias, conv_state, slots, continuing, silu)
    out = torch.empty((rows, channels), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_c = min(BLOCK_C, triton.next_power_of_2(channels))
    _conv_single_tokens_kernel[(rows, triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, conv_state, slots.contiguous(), continuing.contiguous(), out,
        channels, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), out.stride(0), WIDTH=width, W_PAD=triton.next_power_of_2(width), BLOCK_C=block_c,
        HAS_BIAS=bias is not None, SILU=silu, num_warps=4,
    )
    return out


@paged_short_conv.register_kernel("cuda")
def _paged_short_conv_cuda(bx, weight, bias, conv_state, state_slots, seq_lens, query_start_loc, silu=False):
    return paged_short_conv_reference(bx, weight, bias, conv_state, state_slots, seq_lens, query_start_loc, silu,
                                      conv_rule=conv_single_tokens_triton)
