"""Mamba2 mixers (SSD) of hybrid models: Granite 4.0-H, Nemotron-H, Bamba.

A Mamba2 layer keeps, per sequence, a conv state (the last `kernel - 1` inputs of its causal
depthwise convolution over [x; B; C]) and an SSM state (head_dim x state_size per head, float32).
Per token t, after the convolution (SiLU), with dt_t = softplus(dt_raw + dt_bias) and
A = -exp(A_log) per head, B and C shared by the heads of a group:

    S <- S * exp(dt_t A) + dt_t x_t B_t^T;   y_t = S C_t + D x_t

Two ops, as for the gated DeltaNet (kiln.kernels.gated_delta_net): `kiln::mamba2_scan`, the
capture marker (one sequence from zero states), which `kiln.passes.recurrent_state` replaces with
`kiln::paged_mamba2_scan`, any mix of sequences over the states in their `state_slots` rows
(kiln.kernels.recurrent_steps). Both return float32 (transformers keeps the scan's output in
float32 through the gated norm). Prefills run in chunks of CHUNK tokens: within a chunk the
outputs are a masked product (C B^T weighted by the decay between positions) and the state
enters through one product; only the state's chain runs chunk by chunk. Padding has dt = 0:
no decay and no input. `dt_min` clamps dt from below after softplus (Zamba2's
`time_step_limit`; 0, a no-op, for the others). Plain torch on every device.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kiln.kernels.library import kiln_op
from kiln.kernels.recurrent_steps import ConvRule, PaddedRows, causal_conv, conv_single_tokens, run_step

CHUNK = 64


def ssm_inputs(x_bc: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int,
               head_dim: int, n_groups: int, state_size: int, dt_min: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convolved [..., conv_dim] and raw dt [..., H] -> x [..., H, P], B, C [..., H, N] (each
    head's group's), dt (at least `dt_min`: Zamba2's time_step_limit) and the log decay
    dt * A [..., H], all float32."""
    lead = x_bc.shape[:-1]
    x, B, C = x_bc.float().split([num_heads * head_dim, n_groups * state_size, n_groups * state_size], dim=-1)
    B, C = B.reshape(*lead, n_groups, state_size), C.reshape(*lead, n_groups, state_size)
    B, C = (t.repeat_interleave(num_heads // n_groups, dim=-2) for t in (B, C))
    dt = F.softplus(dt.float() + dt_bias.float())
    if dt_min:
        dt = dt.clamp(min=dt_min)
    return x.reshape(*lead, num_heads, head_dim), B, C, dt, dt * -A_log.float().exp()


def scan_chunked(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, log_decay: torch.Tensor,
                 state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over one sequence's tokens (x [n, H, P], B, C [n, H, N], dt, log_decay [n, H]) or
    B sequences' of one padded length (a leading batch dim), from `state` [(B,) H, P, N].
    Returns (S C per token [(B,) n, H, P] without the D term, final state)."""
    single = x.dim() == 3
    if single:
        x, B, C, dt, log_decay, state = (t.unsqueeze(0) for t in (x, B, C, dt, log_decay, state))
    n = x.shape[1]
    pad = -n % CHUNK
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt, log_decay = (F.pad(t, (0, 0, 0, pad)) for t in (dt, log_decay))
    batch, heads = x.shape[0], x.shape[2]
    chunks = (n + pad) // CHUNK

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [B, n, H, ...] -> [B, H, chunks, L, ...]
        return t.transpose(1, 2).reshape(batch, heads, chunks, CHUNK, *t.shape[3:])

    x, B, C, dt, log_decay = (chunked(t) for t in (x, B, C, dt, log_decay))
    c = log_decay.cumsum(dim=-1)  # [B, H, N, L]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    x_dt = x * dt.unsqueeze(-1)
    within = ((C @ B.transpose(-1, -2)) * decay) @ x_dt  # [B, H, N, L, P]
    C_decayed = C * c.exp().unsqueeze(-1)
    B_decayed = B * (c[..., -1:] - c).exp().unsqueeze(-1)
    chunk_decay = c[..., -1].exp()[..., None, None]
    out = torch.empty_like(x)
    for i in range(chunks):
        out[:, :, i] = within[:, :, i] + C_decayed[:, :, i] @ state.transpose(-1, -2)
        state = state * chunk_decay[:, :, i] + x_dt[:, :, i].transpose(-1, -2) @ B_decayed[:, :, i]
    out = out.reshape(batch, heads, chunks * CHUNK, -1)[:, :, :n].transpose(1, 2)
    return (out[0], state[0]) if single else (out, state)


def scan_step(x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, log_decay: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B rows: x [B, H, P], B, C [B, H, N], dt, log_decay [B, H], state
    [B, H, P, N]. Returns (S C [B, H, P], new state)."""
    state = state * log_decay.exp()[..., None, None] + (x * dt.unsqueeze(-1)).unsqueeze(-1) * B.unsqueeze(-2)
    return (state * C.unsqueeze(-2)).sum(dim=-1), state


def decode_rule_reference(conv: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                          D: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, continuing: torch.Tensor,
                          num_heads: int, head_dim: int, n_groups: int, state_size: int, dt_min: float = 0.0
                          ) -> torch.Tensor:
    """One token of each of R rows after its convolution (conv [R, conv_dim]; dt [R, H] as the
    projection gives it) from its slot's SSM state (zeros where not `continuing`), the state
    written back. Returns y = S C + D x as [R, H * P] float32. (The CUDA kernel:
    kiln.kernels.triton_mamba2.)"""
    x, B, C, dt, log_decay = ssm_inputs(conv, dt, A_log, dt_bias, num_heads, head_dim, n_groups, state_size, dt_min)
    state = torch.where(continuing.view(-1, 1, 1, 1), ssm_state[slots], 0.0)
    y, ssm_state[slots] = scan_step(x, B, C, dt, log_decay, state)
    return (y + D.float()[:, None] * x).reshape(x.shape[0], -1)


def mamba2_scan_reference(x_bc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                          conv_bias: torch.Tensor | None, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                          num_heads: int, head_dim: int, n_groups: int, state_size: int, dt_min: float = 0.0
                          ) -> torch.Tensor:
    """One sequence of T tokens from zero states: [T, H * P] float32."""
    x, B, C, dt, log_decay = ssm_inputs(causal_conv(x_bc, conv_weight, conv_bias), dt, A_log, dt_bias, num_heads,
                                        head_dim, n_groups, state_size, dt_min)
    y, _ = scan_chunked(x, B, C, dt, log_decay, x.new_zeros(num_heads, head_dim, state_size))
    return (y + D.float()[:, None] * x).reshape(x.shape[0], -1)


def paged_mamba2_scan_reference(
    x_bc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
    A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
    state_slots: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_heads: int, head_dim: int,
    n_groups: int, state_size: int, dt_min: float = 0.0,
    decode_rule: Callable[..., torch.Tensor] = decode_rule_reference,
    conv_rule: ConvRule = conv_single_tokens,
) -> torch.Tensor:
    """A step of any mix of sequences (kiln.kernels.recurrent_steps); writes the states in place.
    `decode_rule` runs the single tokens' recurrence (`decode_rule_reference`'s contract),
    `conv_rule` their convolution (`conv_single_tokens`')."""
    shape = (num_heads, head_dim, n_groups, state_size)
    skip = D.float()[:, None]

    def singles(rows: torch.Tensor | None, slots: torch.Tensor, continuing: torch.Tensor) -> torch.Tensor:
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        conv = conv_rule(pick(x_bc), conv_weight, conv_bias, conv_state, slots, continuing)
        return decode_rule(conv, pick(dt), A_log, dt_bias, D, ssm_state, slots, continuing, *shape, dt_min=dt_min)

    def prefills(rows: PaddedRows, out: torch.Tensor) -> None:
        conv = rows.conv(x_bc, conv_weight, conv_bias, conv_state)  # [S, L, conv_dim]
        x, B, C, step, log_decay = ssm_inputs(conv, rows.padded(dt), A_log, dt_bias, *shape, dt_min)
        step = step * rows.real.unsqueeze(-1)  # padding: dt = 0, no decay and no input
        state = torch.where(rows.continuing.view(-1, 1, 1, 1), ssm_state[rows.slots], 0.0)
        y, ssm_state[rows.slots] = scan_chunked(x, B, C, step, log_decay * rows.real.unsqueeze(-1), state)
        rows.scatter(out, (y + skip * x).flatten(-2))

    return run_step(x_bc.shape[0], query_start_loc, seq_lens, state_slots, singles, prefills,
                    lambda: torch.zeros(x_bc.shape[0], num_heads * head_dim, dtype=torch.float32, device=x_bc.device))


@kiln_op("kiln::mamba2_scan", mutates_args=())
def mamba2_scan(
    x_bc: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    layer_idx: int,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    state_size: int,
    dt_min: float = 0.0,
) -> torch.Tensor:
    return mamba2_scan_reference(x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, num_heads, head_dim, n_groups,
                                 state_size, dt_min)


@mamba2_scan.register_fake
def _mamba2_scan_fake(x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, layer_idx, num_heads, head_dim, n_groups,
                      state_size, dt_min=0.0):
    return x_bc.new_empty(x_bc.shape[0], num_heads * head_dim, dtype=torch.float32)


@kiln_op("kiln::paged_mamba2_scan", mutates_args=("conv_state", "ssm_state"))
def paged_mamba2_scan(
    x_bc: torch.Tensor,
    dt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    state_size: int,
    dt_min: float = 0.0,
) -> torch.Tensor:
    return paged_mamba2_scan_reference(x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, conv_state, ssm_state,
                                       state_slots, seq_lens, query_start_loc, num_heads, head_dim, n_groups,
                                       state_size, dt_min)


@paged_mamba2_scan.register_fake
def _paged_mamba2_scan_fake(x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, conv_state, ssm_state, state_slots,
                            seq_lens, query_start_loc, num_heads, head_dim, n_groups, state_size, dt_min=0.0):
    return x_bc.new_empty(x_bc.shape[0], num_heads * head_dim, dtype=torch.float32)
