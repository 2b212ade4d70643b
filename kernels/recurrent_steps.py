"""How a step of any mix of sequences reaches per-sequence recurrent states (gated DeltaNet,
Mamba2): the parts the recurrent layers' ops share.

A layer with a recurrent state keeps, per sequence, a row of its state caches (the sequence's
`state_slots` entry; row 0 is the null slot padded rows write). A step's rows are sorted into:

- **single tokens** (decodes; a whole decode step, where token i is row i's, padded rows last),
  run as one batch: each row's state is read where the sequence has earlier tokens and zeros
  where it does not (`continuing`), then written back;
- **prefills** (rows of several tokens: prompts and their chunks), run as batches padded on the
  right to the longest of each `padding_groups` group. A layer's op gives padding inputs that
  change no state (zero inputs, a zero step), so padding changes nothing real.

Both causal convolutions (depthwise, SiLU after, the last `kernel - 1` inputs as the state)
are here; each layer's op does its own scan on what they return. A decode step reads nothing on
the host (`one_token_a_row`), so CUDA graphs capture it; other steps read their offsets on the
host once a step, for all their layers (`step_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def one_token_a_row(num_tokens: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    state_slots: torch.Tensor) -> bool:
    """Whether every sequence of the step has at most one token and the step as many tokens as
    rows (a decode step, padded or not), from `step_rows` (read once a step). While a CUDA graph
    is being captured (only decode buckets are) that is taken as given: checking would read the
    offsets on the host."""
    if num_tokens != query_start_loc.shape[0] - 1:
        return False
    if query_start_loc.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    starts = step_rows(query_start_loc, seq_lens, state_slots)[0]
    return all(b - a <= 1 for a, b in zip(starts, starts[1:]))


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (None for inference tensors, which keep none)."""
    return None if t.is_inference() else t._version


def step_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_slots: torch.Tensor
              ) -> tuple[list[int], list[int], list[int]]:
    """The step's token offsets, sequence lengths and state slots as host lists, read once a
    step: every recurrent layer of a step gets the same three input tensors, so the lists are
    kept on the offsets tensor (an attribute of that one step's tensor, keyed by the three
    tensors' identities, storage and, outside inference mode, versions: an in-place write reads
    them again). The runtime makes a step's inputs for that step (`prepare_step_inputs`, padded
    copies); the inputs it reuses, a decode graph's static ones, reach these ops only in the
    capture's warm-up run. Read per layer, each of a step's 30-50 recurrent layers made the host
    wait for the device three times, the GPU idle while the host launched the next layer."""
    key = tuple((id(t), t.data_ptr(), _version(t)) for t in (query_start_loc, seq_lens, state_slots))
    cached = getattr(query_start_loc, "_kiln_step_rows", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    n = seq_lens.shape[0]
    flat = torch.cat([query_start_loc.to(torch.int64), seq_lens.to(torch.int64), state_slots.to(torch.int64)]).tolist()
    rows = (flat[:n + 1], flat[n + 1:2 * n + 1], flat[2 * n + 1:])
    query_start_loc._kiln_step_rows = (key, rows)
    return rows


def padding_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` (longest first) in groups run as one padded batch each: a group
    grows while padding every member to its longest keeps it under twice its real tokens (a
    16k-token prompt beside short chunks is not padded 16k times)."""
    groups: list[list[int]] = []
    real = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= 2 * (real + n):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


def conv_single_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                       slots: torch.Tensor, continuing: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """SiLU(causal conv) (without `silu`: the conv alone) of one token a row (x [B, C]) after its
    slot's last inputs (zeros where not `continuing`); the slots' conv states become their last
    kernel - 1 inputs. [B, C] in x's dtype."""
    past = torch.where(continuing.view(-1, 1, 1), conv_state[slots],
                       torch.zeros((), dtype=conv_state.dtype, device=conv_state.device))
    extended = torch.cat([past.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (extended.float() * weight.float().unsqueeze(0)).sum(dim=-1)
    if bias is not None:
        out = out + bias.float()
    conv_state[slots] = extended[..., 1:].to(conv_state.dtype)
    return (F.silu(out) if silu else out).to(x.dtype)


# `conv_single_tokens`' contract: (x, weight, bias, conv_state, slots, continuing, silu) -> [B, C]
# (the layers' ops take it as their `conv_rule`: on CUDA, kiln.kernels.triton_causal_conv).
ConvRule = Callable[..., torch.Tensor]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu: bool = True
                ) -> torch.Tensor:
    """SiLU(causal conv) (without `silu`: the conv alone) of one sequence from zero inputs before
    it: x [n, C] -> [n, C]."""
    width = weight.shape[-1]
    out = F.conv1d(F.pad(x.t().float(), (width - 1, 0)).unsqueeze(0), weight.float().view(x.shape[1], 1, width),
                   bias.float() if bias is not None else None, groups=x.shape[1])[0]
    return (F.silu(out) if silu else out).t().to(x.dtype)


@dataclass
class PaddedRows:
    """Sequences of several tokens each, laid out [S, L] padded on the right to the longest."""

    index: torch.Tensor  # [S, L]: each position's token in the step, or T (a zero row) for padding
    real: torch.Tensor  # [S, L] bool
    counts: torch.Tensor  # [S]
    slots: torch.Tensor  # [S]
    continuing: torch.Tensor  # [S] bool: the sequence has tokens before this step's

    @staticmethod
    def of(rows: list[tuple[int, int, int, bool]], num_tokens: int, device: torch.device) -> "PaddedRows":
        """From (first token, token count, slot, continuing) per sequence."""
        begins, counts, slots, continuing = (torch.tensor(col, device=device) for col in zip(*rows))
        offsets = torch.arange(int(counts.max()), device=device)
        real = offsets < counts.unsqueeze(1)
        return PaddedRows(torch.where(real, begins.unsqueeze(1) + offsets, num_tokens), real, counts, slots,
                          continuing)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token x [T, ...] as [S, L, ...], padding zeros."""
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.index]

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """out[token] = values[s, l] for every real position."""
        out[self.index[self.real]] = values[self.real].to(out.dtype)

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             conv_state: torch.Tensor, silu: bool = True) -> torch.Tensor:
        """SiLU(causal conv) (without `silu`: the conv alone) of each sequence's tokens (x [T, C])
        after its slot's last inputs; the slots' conv states become each sequence's last
        kernel - 1 inputs. [S, L, C]."""
        width = weight.shape[-1]
        past = torch.where(self.continuing.view(-1, 1, 1), conv_state[self.slots],
                           torch.zeros((), dtype=conv_state.dtype, device=x.device))
        extended = torch.cat([past.to(x.dtype), self.padded(x).transpose(1, 2)], dim=2)  # [S, C, K-1+L]
        channels = extended.shape[1]
        out = F.conv1d(extended.float(), weight.float().view(channels, 1, width),
                       bias.float() if bias is not None else None, groups=channels)
        # Each sequence's last K-1 inputs: extended's columns count .. count + K - 2.
        last = (self.counts.unsqueeze(1) + torch.arange(width - 1, device=x.device)).unsqueeze(1)
        conv_state[self.slots] = extended.gather(2, last.expand(-1, channels, -1)).to(conv_state.dtype)
        return (F.silu(out) if silu else out).transpose(1, 2).to(x.dtype)


def run_step(num_tokens: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_slots: torch.Tensor,
             singles: Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor],
             prefills: Callable[[PaddedRows, torch.Tensor], None], zeros: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A step's rows through a layer's two paths: `singles(rows, slots, continuing)` for one
    token a row (`rows`: their tokens' indices, None when token i is row i's, the whole step)
    returns their outputs; `prefills(padded, out)` writes its rows' outputs into `out`, which
    `zeros()` makes ([T, ...], rows of no sequence left zero). A decode step returns what
    `singles` returns: no output to clear, nothing copied (on CUDA its kernels write the
    layer's output themselves)."""
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return zeros()
    if one_token_a_row(num_tokens, query_start_loc, seq_lens, state_slots):
        return singles(None, state_slots, seq_lens > 1)
    out = zeros()
    starts, lens, slots = step_rows(query_start_loc, seq_lens, state_slots)
    counts = [starts[i + 1] - starts[i] for i in range(num_seqs)]
    device = out.device
    single = [i for i in range(num_seqs) if counts[i] == 1]
    if single:  # the decodes of a mixed step, all at once
        rows = torch.tensor([starts[i] for i in single], device=device)
        out[rows] = singles(rows, torch.tensor([slots[i] for i in single], device=device),
                            torch.tensor([lens[i] > 1 for i in single], device=device)).to(out.dtype)
    multi = sorted((i for i in range(num_seqs) if counts[i] > 1), key=lambda i: -counts[i])
    for group in padding_groups([counts[i] for i in multi]):  # prefills and their chunks
        prefills(PaddedRows.of([(starts[multi[j]], counts[multi[j]], slots[multi[j]], lens[multi[j]] > counts[multi[j]])
                                for j in group], num_tokens, device), out)
    return out
