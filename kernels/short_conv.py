"""Causal convolutions whose only state is their last inputs: LFM2's short convolutions, and
Mamba's (with SiLU after; kiln.kernels.mamba).

An LFM2 "conv" layer projects each token to [B; C; x], convolves B * x over the sequence
(depthwise, `conv_L_cache` wide, no activation) and gates the result with C. Its state per
sequence is the convolution's last `L_cache - 1` inputs. `kiln::short_conv` is the capture
marker (one sequence from zero inputs), `kiln::paged_short_conv` the op `kiln.passes.recurrent_state`
puts in its place, any mix of sequences over the states in their `state_slots` rows
(kiln.kernels.recurrent_steps). A Mamba mixer's convolution is the same op with `silu` (the
activation after it, as `conv_single_tokens` applies it). Plain torch on every device: a handful
of elementwise ops.
"""

from __future__ import annotations

import torch

from kiln.kernels.library import kiln_op
from kiln.kernels.recurrent_steps import ConvRule, PaddedRows, causal_conv, conv_single_tokens, run_step


@kiln_op("kiln::short_conv", mutates_args=())
def short_conv(bx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer_idx: int,
               silu: bool = False) -> torch.Tensor:
    return causal_conv(bx, weight, bias, silu=silu)


@short_conv.register_fake
def _short_conv_fake(bx, weight, bias, layer_idx, silu=False):
    return torch.empty_like(bx)


def paged_short_conv_reference(bx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               conv_state: torch.Tensor, state_slots: torch.Tensor, seq_lens: torch.Tensor,
                               query_start_loc: torch.Tensor, silu: bool = False,
                               conv_rule: ConvRule = conv_single_tokens) -> torch.Tensor:
    """A step of any mix of sequences; writes the conv states in place. `conv_rule` runs the
    single tokens' convolution (`conv_single_tokens`' contract; on CUDA one Triton kernel)."""

    def singles(rows: torch.Tensor | None, slots: torch.Tensor, continuing: torch.Tensor) -> torch.Tensor:
        return conv_rule(bx if rows is None else bx[rows], weight, bias, conv_state, slots, continuing, silu=silu)

    def prefills(rows: PaddedRows, out: torch.Tensor) -> None:
        rows.scatter(out, rows.conv(bx, weight, bias, conv_state, silu=silu))

    return run_step(bx.shape[0], query_start_loc, seq_lens, state_slots, singles, prefills,
                    lambda: torch.zeros_like(bx))


@kiln_op("kiln::paged_short_conv", mutates_args=("conv_state",))
def paged_short_conv(bx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                     state_slots: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     silu: bool = False) -> torch.Tensor:
    return paged_short_conv_reference(bx, weight, bias, conv_state, state_slots, seq_lens, query_start_loc, silu)


@paged_short_conv.register_fake
def _paged_short_conv_fake(bx, weight, bias, conv_state, state_slots, seq_lens, query_start_loc, silu=False):
    return torch.empty_like(bx)
