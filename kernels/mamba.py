"""Mamba's selective scan (Mamba, Falcon-Mamba, Jamba): the state-keeping part of a Mamba
(selective state-space) mixer after its convolution.

A Mamba mixer projects each token to [x; z] (`intermediate` channels each), convolves x over
the sequence (depthwise, SiLU after: `kiln::short_conv` with `silu`, whose conv state is the
layer's "<layer>.conv"), projects the convolved x to a low-rank dt and B, C (`state_size`
each, shared by the channels), widens dt to the channels, and scans. Per channel d and token t,
with dt = softplus(dt_raw + dt_bias) and A = -exp(A_log) ([intermediate, state_size]: a decay
per channel *and* state column, where Mamba2's is one per head):

    S_d <- S_d * exp(dt_d A_d) + dt_d x_d B_t;   y_d = (S_d . C_t + D_d x_d) * silu(z_d)

S ([intermediate, state_size] float32 a sequence) is the layer's "<layer>.recurrent" state.
`kiln::selective_scan` is the capture marker (one sequence from a zero state),
`kiln::paged_selective_scan` what `kiln.passes.recurrent_state` puts in its place: any mix of
sequences over the states in their `state_slots` rows (kiln.kernels.recurrent_steps).

The decay varies along the state columns, so the chunked form Mamba2 uses (one scalar decay a
head, kiln.kernels.mamba2) does not apply: the reference scans token by token, as transformers'
own torch path does, on every row of a padded batch at once. On CUDA one Triton kernel scans any
step (kiln.kernels.triton_mamba). Padding has dt = 0: no decay and no input.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kiln.kernels.library import kiln_op
from kiln.kernels.recurrent_steps import PaddedRows, run_step


def scan_parameters(dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt = softplus(dt_raw + dt_bias), A = -exp(A_log)), float32."""
    return F.softplus(dt.float() + dt_bias.float()), -A_log.float().exp()


def scan_tokens(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over n tokens of S sequences: x, dt [S, n, D] (dt after softplus), B, C [S, n, N],
    A [D, N], state [S, D, N], all float32. Returns (S . C per token [S, n, D], final state)."""
    outputs = []
    for t in range(x.shape[1]):
        step = dt[:, t].unsqueeze(-1)  # [S, D, 1]
        state = state * (step * A).exp() + (step * x[:, t].unsqueeze(-1)) * B[:, t].unsqueeze(1)
        outputs.append((state * C[:, t].unsqueeze(1)).sum(dim=-1))
    return torch.stack(outputs, dim=1), state


def gated_output(y: torch.Tensor, x: torch.Tensor, z: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """(y + D x) * silu(z) in float32."""
    return (y + D.float() * x.float()) * F.silu(z.float())


def decode_rule_reference(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor,
                          A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                          slots: torch.Tensor, continuing: torch.Tensor) -> torch.Tensor:
    """One token of each of R rows (x, dt, z [R, D]; B, C [R, N]) from its slot's state (zeros
    where not `continuing`), the state written back. Returns [R, D] in x's dtype."""
    step, A = scan_parameters(dt, A_log, dt_bias)
    state = torch.where(continuing.view(-1, 1, 1), ssm_state[slots], 0.0)
    y, ssm_state[slots] = scan_tokens(x.float().unsqueeze(1), step.unsqueeze(1), B.float().unsqueeze(1),
                                      C.float().unsqueeze(1), A, state)
    return gated_output(y[:, 0], x, z, D).to(x.dtype)


def selective_scan_reference(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor,
                             A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """One sequence of T tokens from a zero state: [T, D] in x's dtype."""
    step, A = scan_parameters(dt, A_log, dt_bias)
    y, _ = scan_tokens(x.float().unsqueeze(0), step.unsqueeze(0), B.float().unsqueeze(0), C.float().unsqueeze(0), A,
                       x.new_zeros(1, *A.shape, dtype=torch.float32))
    return gated_output(y[0], x, z, D).to(x.dtype)


def paged_selective_scan_reference(
    x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor, A_log: torch.Tensor,
    D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor, state_slots: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    decode_rule: Callable[..., torch.Tensor] = decode_rule_reference,
) -> torch.Tensor:
    """A step of any mix of sequences (kiln.kernels.recurrent_steps); writes the states in place.
    `decode_rule` runs the single tokens (`decode_rule_reference`'s contract)."""

    def singles(rows: torch.Tensor | None, slots: torch.Tensor, continuing: torch.Tensor) -> torch.Tensor:
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        return decode_rule(pick(x), pick(dt), pick(B), pick(C), pick(z), A_log, D, dt_bias, ssm_state, slots,
                           continuing)

    def prefills(rows: PaddedRows, out: torch.Tensor) -> None:
        step, A = scan_parameters(rows.padded(dt), A_log, dt_bias)
        step = step * rows.real.unsqueeze(-1)  # padding: dt = 0, no decay and no input
        state = torch.where(rows.continuing.view(-1, 1, 1), ssm_state[rows.slots], 0.0)
        xs = rows.padded(x)
        y, ssm_state[rows.slots] = scan_tokens(xs.float(), step, rows.padded(B).float(), rows.padded(C).float(), A,
                                               state)
        rows.scatter(out, gated_output(y, xs, rows.padded(z), D))

    return run_step(x.shape[0], query_start_loc, seq_lens, state_slots, singles, prefills, lambda: torch.zeros_like(x))


@kiln_op("kiln::selective_scan", mutates_args=())
def selective_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor,
                   A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return selective_scan_reference(x, dt, B, C, z, A_log, D, dt_bias)


@selective_scan.register_fake
def _selective_scan_fake(x, dt, B, C, z, A_log, D, dt_bias, layer_idx):
    return torch.empty_like(x)


@kiln_op("kiln::paged_selective_scan", mutates_args=("ssm_state",))
def paged_selective_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor,
                         A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                         state_slots: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
                         ) -> torch.Tensor:
    return paged_selective_scan_reference(x, dt, B, C, z, A_log, D, dt_bias, ssm_state, state_slots, seq_lens,
                                          query_start_loc)


@paged_selective_scan.register_fake
def _paged_selective_scan_fake(x, dt, B, C, z, A_log, D, dt_bias, ssm_state, state_slots, seq_lens, query_start_loc):
    return torch.empty_like(x)
