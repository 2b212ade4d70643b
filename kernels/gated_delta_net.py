"""Gated DeltaNet (Qwen3-Next, Qwen3.5): a linear-attention layer with a recurrent state per sequence.

A gated DeltaNet layer keeps, per sequence, two states instead of K/V for every token:

- the **conv state**: the last `kernel - 1` inputs of its causal depthwise convolution over the
  token mix [q; k; v] (`conv_dim` channels, the model's dtype), and
- the **recurrent state** S: one `head_k_dim x head_v_dim` matrix per value head (float32).

Per token t of a sequence, after the convolution (SiLU) and L2-normalised q and k (q also
scaled by head_k_dim^-0.5), with decay g_t = -exp(A_log) * softplus(a_t + dt_bias) and
beta_t = sigmoid(b_t):

    S <- S * exp(g_t);   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

which is the gated delta rule (Yang et al., "Gated Delta Networks", 2024). A query/key head
serves `num_v_heads / num_k_heads` consecutive value heads.

Two ops:

- `kiln::gated_delta_net`: the capture marker (one sequence from a zero state, like
  `kiln::attention`); `kiln.passes.recurrent_state` replaces it with
- `kiln::paged_gated_delta_net`: any mix of prefills, chunks and decodes in one step, each
  sequence's states in row `state_slots[i]` of the layer's state caches (read where the
  sequence has tokens before this step, written after it). A step whose every sequence has
  one token (a decode bucket, which CUDA graphs capture) runs without a host sync; other
  steps read the sequences' token counts on the host.

The reference here (plain torch, every device; the step's split into single tokens and padded
prefill groups is kiln.kernels.recurrent_steps') computes prefills in chunks of `CHUNK` with the
WY form of the delta rule (every chunk's triangular solves at once, then only the state's chain
chunk by chunk, as matrix products); single tokens by the recurrence itself.
On CUDA the single tokens of a step run as two Triton kernels: the convolution
(kiln.kernels.triton_causal_conv) and everything after it (q/k normalisation, the gates, the
delta rule over the states in place: kiln.kernels.triton_gated_delta_net); chunked prefills run
as torch ops there too.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kiln.kernels.library import kiln_op
from kiln.kernels.recurrent_steps import ConvRule, PaddedRows, causal_conv, conv_single_tokens, run_step

CHUNK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _split_heads(mixed: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convolved [T, conv_dim] -> q, k [T, Hv, Dk] (normalised, q scaled, repeated per value
    head), v [T, Hv, Dv], all float32."""
    t = mixed.shape[0]
    key_dim = num_k_heads * head_k_dim
    q, k, v = mixed.float().split([key_dim, key_dim, mixed.shape[1] - 2 * key_dim], dim=-1)
    v = v.reshape(t, -1, head_v_dim)
    repeat = v.shape[1] // num_k_heads
    q = _l2norm(q.reshape(t, num_k_heads, head_k_dim)) * head_k_dim ** -0.5
    k = _l2norm(k.reshape(t, num_k_heads, head_k_dim))
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    return q, k, v


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, beta_scale: float = 1.0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, Hv] float32: the log decay and the write strength of each token and value
    head (beta = beta_scale * sigmoid(b): OLMo Hybrid's 2, eigenvalues of the update in [-1, 1])."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    return g, beta * beta_scale if beta_scale != 1.0 else beta


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the tokens of one sequence, or of B sequences of one (padded)
    length, from `state` [(B,) Hv, Dk, Dv] (float32): q, k [(B,) n, Hv, Dk], v [(B,) n, Hv, Dv],
    g, beta [(B,) n, Hv]. Returns (o like v, final state). A token with beta = 0 and g = 0 (a
    sequence's right padding) leaves the state as it is.

    Within a chunk of L tokens (cumulative log decay c_i, D_ij = exp(c_i - c_j) for j <= i),
    with A = (I + strictly_lower((beta k k^T) * D))^-1: the chunk's corrected values are
    U - W S for U = A (beta v) and W = A (beta k exp(c)), both computed for every chunk at once;
    outputs are (q exp(c)) S + ((q k^T) * D) (U - W S), and the state after the chunk is
    S exp(c_L) + (k exp(c_L - c))^T (U - W S). Only those last two lines run chunk by chunk."""
    single = q.dim() == 3
    if single:
        q, k, v, g, beta, state = (x.unsqueeze(0) for x in (q, k, v, g, beta, state))
    n = q.shape[1]
    pad = -n % CHUNK  # right padding with beta = g = 0: no state change, outputs cut off
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    batch, heads = q.shape[0], q.shape[2]
    chunks = (n + pad) // CHUNK

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, n, Hv, ...] -> [B, Hv, chunks, L, ...]
        return x.transpose(1, 2).reshape(batch, heads, chunks, CHUNK, *x.shape[3:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    c = g.cumsum(dim=-1)  # [B, Hv, N, L]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [B, Hv, N, L, L]
    kb = k * beta.unsqueeze(-1)
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp().unsqueeze(-1)
    k_decayed = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    chunk_decay = c[..., -1].exp()[..., None, None]  # [B, Hv, N, 1, 1]
    out = torch.empty_like(v)
    for i in range(chunks):
        corrected = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ corrected
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ corrected
    out = out.reshape(batch, heads, chunks * CHUNK, -1)[:, :, :n].transpose(1, 2)
    return (out[0], state[0]) if single else (out, state)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, Hv, Dk], v [B, Hv, Dv], g, beta [B, Hv],
    state [B, Hv, Dk, Dv] (float32). Returns (o [B, Hv, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k.unsqueeze(-1)).sum(dim=-2)  # S^T k: [B, Hv, Dv]
    state = state + k.unsqueeze(-1) * ((v - remembered) * beta.unsqueeze(-1)).unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def gated_delta_net_reference(mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                              A_log: torch.Tensor, dt_bias: torch.Tensor, num_k_heads: int, head_k_dim: int,
                              head_v_dim: int, beta_scale: float = 1.0) -> torch.Tensor:
    """One sequence of T tokens from zero states: [T, Hv, Dv] in mixed_qkv's dtype."""
    mixed = causal_conv(mixed_qkv, conv_weight)
    q, k, v = _split_heads(mixed, num_k_heads, head_k_dim, head_v_dim)
    g, beta = gates(a, b, A_log, dt_bias, beta_scale)
    state = q.new_zeros(v.shape[1], head_k_dim, head_v_dim)
    out, _ = delta_rule_chunked(q, k, v, g, beta, state)
    return out.to(mixed_qkv.dtype)


def decode_rule_reference(conv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
                          continuing: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
                          beta_scale: float = 1.0) -> torch.Tensor:
    """One token of each of B rows after its convolution (conv [B, conv_dim], SiLU applied; a, b
    [B, Hv]) from its slot's recurrent state (zeros where not `continuing`), the state written
    back. Returns o [B, Hv, Dv] float32 (the CUDA kernel, kiln.kernels.triton_gated_delta_net:
    in conv's dtype)."""
    g, beta = gates(a, b, A_log, dt_bias, beta_scale)
    q, k, v = _split_heads(conv, num_k_heads, head_k_dim, head_v_dim)
    state = torch.where(continuing.view(-1, 1, 1, 1), recurrent_state[slots], 0.0)
    o, state = delta_rule_step(q, k, v, g, beta, state)
    recurrent_state[slots] = state
    return o


DecodeRule = Callable[..., torch.Tensor]


def paged_gated_delta_net_reference(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, state_slots: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int,
    beta_scale: float = 1.0, decode_rule: DecodeRule = decode_rule_reference, conv_rule: ConvRule = conv_single_tokens,
) -> torch.Tensor:
    """A step of any mix of sequences (kiln.kernels.recurrent_steps); writes the states in place.
    `conv_rule` runs the single tokens' convolution (`conv_single_tokens`' contract),
    `decode_rule` everything after it (`decode_rule_reference`'s)."""
    heads = (num_k_heads, head_k_dim, head_v_dim)

    def singles(rows: torch.Tensor | None, slots: torch.Tensor, continuing: torch.Tensor) -> torch.Tensor:
        pick = (lambda x: x) if rows is None else (lambda x: x[rows])
        conv = conv_rule(pick(mixed_qkv), conv_weight, None, conv_state, slots, continuing)
        o = decode_rule(conv, pick(a), pick(b), A_log, dt_bias, recurrent_state, slots, continuing, *heads,
                        beta_scale=beta_scale)
        return o.to(mixed_qkv.dtype)

    def prefills(rows: PaddedRows, out: torch.Tensor) -> None:
        # Padding: zero inputs, g = 0 and beta = 0, which change no state.
        g, beta = gates(rows.padded(a), rows.padded(b), A_log, dt_bias, beta_scale)
        real = rows.real.unsqueeze(-1)
        conv = rows.conv(mixed_qkv, conv_weight, None, conv_state)  # [S, L, C]
        num_seqs, length, channels = conv.shape
        q, k, v = _split_heads(conv.reshape(num_seqs * length, channels), *heads)
        q, k, v = (x.view(num_seqs, length, *x.shape[1:]) for x in (q, k, v))
        state = torch.where(rows.continuing.view(-1, 1, 1, 1), recurrent_state[rows.slots], 0.0)
        o, recurrent_state[rows.slots] = delta_rule_chunked(q, k, v, g * real, beta * real, state)
        rows.scatter(out, o)

    return run_step(mixed_qkv.shape[0], query_start_loc, seq_lens, state_slots, singles, prefills,
                    lambda: mixed_qkv.new_zeros(mixed_qkv.shape[0], recurrent_state.shape[1], head_v_dim))


@kiln_op("kiln::gated_delta_net", mutates_args=())
def gated_delta_net(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    layer_idx: int,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    beta_scale: float = 1.0,
) -> torch.Tensor:
    return gated_delta_net_reference(mixed_qkv, a, b, conv_weight, A_log, dt_bias, num_k_heads, head_k_dim, head_v_dim,
                                     beta_scale)


@gated_delta_net.register_fake
def _gated_delta_net_fake(mixed_qkv, a, b, conv_weight, A_log, dt_bias, layer_idx, num_k_heads, head_k_dim,
                          head_v_dim, beta_scale=1.0):
    return mixed_qkv.new_empty(mixed_qkv.shape[0], a.shape[1], head_v_dim)


@kiln_op("kiln::paged_gated_delta_net", mutates_args=("conv_state", "recurrent_state"))
def paged_gated_delta_net(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    state_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    beta_scale: float = 1.0,
) -> torch.Tensor:
    return paged_gated_delta_net_reference(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, recurrent_state,
                                           state_slots, seq_lens, query_start_loc, num_k_heads, head_k_dim, head_v_dim,
                                           beta_scale)


@paged_gated_delta_net.register_fake
def _paged_gated_delta_net_fake(mixed_qkv, a, b, conv_weight, A_log, dt_bias, conv_state, recurrent_state, state_slots,
                                seq_lens, query_start_loc, num_k_heads, head_k_dim, head_v_dim, beta_scale=1.0):
    return mixed_qkv.new_empty(mixed_qkv.shape[0], a.shape[1], head_v_dim)
