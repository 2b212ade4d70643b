"""The sampler: next tokens for a batch of logits rows, on the logits' device.

Everything is batched tensor work on the device of the logits; Python loops only over rows
to collect parameters (and, for seeded rows, to seed one generator per row), never over the
vocabulary. The single device-to-host copy is the final `.tolist()`.

Per row, in this order:
  1. penalties: repetition (prompt + output tokens), presence and frequency (output tokens);
     then logit_bias, allowed_token_ids (every other token -inf) and bad_words (the last
     token of a bad word -inf when the output ends with the word's other tokens);
  2. the min_tokens mask: EOS (unless ignore_eos) and stop_token_ids get -inf while the
     output is shorter than min_tokens;
  -> these are "the logits the sampler saw": logprobs are their log-softmax, and greedy
     rows (temperature 0) take their argmax;
  3. temperature, then top-k, then top-p over what top-k kept, then min-p;
  4. a draw by the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d., which picks token
     i with probability p_i. A row with a seed draws E from a generator seeded by
     (seed, completion index, output length), so its tokens depend on nothing else in the
     batch, survive preemption, and differ between the n completions of one request.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from kiln.runtime.outputs import TokenLogprobs, TopLogprob
from kiln.runtime.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request did not ask


@dataclass
class PendingSample:
    """A launched draw: the tokens still on the device (read them with `Sampler.collect`).

    On CUDA the tokens' copy to the host is queued right behind the draw, into pinned
    memory, with an event after it: `collect` waits for that event only. A plain `.tolist()`
    would queue its copy at collect time, behind whatever was launched since (the next
    step's whole graph, with async scheduling) and wait for all of it.
    """

    tokens: torch.Tensor  # [S] int64, on the logits' device (the next step's input ids)
    logprobs: list[TokenLogprobs | None]
    host_tokens: torch.Tensor | None = None  # pinned copy being filled (CUDA)
    copied: Any = None  # torch.cuda.Event recorded after that copy


def row_seed(seed: int, index: int, position: int) -> int:
    """A 63-bit generator seed for one draw of one completion of a seeded request."""
    digest = hashlib.blake2b(f"{seed}/{index}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int] = (), seed: int | None = None):
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        # One generator per device for seeded rows (re-seeded before each row's draw) and one
        # for unseeded rows, seeded from the OS, or from `seed` (the engine's seed option:
        # the same requests in the same order draw the same tokens): no state shared with
        # anything else.
        self.seed = seed
        self._seeded: dict[torch.device, torch.Generator] = {}
        self._unseeded: dict[torch.device, torch.Generator] = {}

    def _generator(self, pool: dict[torch.device, torch.Generator], device: torch.device) -> torch.Generator:
        gen = pool.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is not None and pool is self._unseeded:
                gen.manual_seed(row_seed(self.seed, 0, 0))
            else:
                gen.manual_seed(int.from_bytes(os.urandom(8), "little") & (2**63 - 1))
            pool[device] = gen
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """One token per row of `logits` [S, V] (float32), row i belonging to seqs[i]."""
        return self.collect(self.launch(logits, seqs))

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample:
        """Queue the draw on the logits' device without waiting for it (`collect` reads it).

        Rows asking for logprobs are read back here already (they never run deferred:
        see `can_defer`)."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} sequences")
        seen = self.process_logits(logits, seqs)
        greedy = seen.argmax(dim=-1)
        is_greedy = [s.params.greedy for s in seqs]
        if all(is_greedy):
            tokens = greedy
        else:
            drawn = self._draw(seen, seqs)
            mask = torch.tensor(is_greedy, device=seen.device)
            tokens = torch.where(mask, greedy, drawn)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if any(s.params.logprobs is not None for s in seqs):
            logprobs = self._logprobs(seen, tokens, seqs)
        pending = PendingSample(tokens, logprobs)
        if tokens.device.type == "cuda":
            pending.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            pending.host_tokens.copy_(tokens, non_blocking=True)
            pending.copied = torch.cuda.Event()
            pending.copied.record()
        return pending

    @staticmethod
    def collect(pending: PendingSample) -> SamplerOutput:
        """The tokens of a launched draw, on the host (waits for the draw, nothing after it)."""
        if pending.host_tokens is not None:
            pending.copied.synchronize()
            return SamplerOutput(token_ids=pending.host_tokens.tolist(), logprobs=pending.logprobs)
        return SamplerOutput(token_ids=pending.tokens.tolist(), logprobs=pending.logprobs)

    @staticmethod
    def can_defer(seqs: list[Sequence]) -> bool:
        """Whether these rows can be drawn before their previous token is on the host.

        Penalties and logprobs need the host's token lists (and logprobs a read-back at
        launch); the min_tokens mask is exact with in-flight tokens counted, but only worth
        deferring once it no longer applies. Seeded draws count in-flight tokens (`_draw`).
        """
        return not any(s.params.has_penalties or s.params.logprobs is not None or s.bad_words_token_ids
                       or s.num_sampled_tokens < s.params.min_tokens for s in seqs)

    # ---- step 1-2: what the sampler sees ------------------------------------------------
    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Penalties and the min_tokens mask applied to a copy of `logits` (`logits` itself,
        unchanged, when no row has either: the copy of a 128K-vocabulary batch per step is
        host time and a kernel for nothing)."""
        if not any(s.params.has_penalties or s.params.has_token_masks or s.num_sampled_tokens < s.params.min_tokens
                   for s in seqs):
            return logits.float()
        out = logits.float().clone()
        self._apply_penalties(out, seqs)
        self._apply_token_masks(out, seqs)
        self._apply_min_tokens(out, seqs)
        return out

    @staticmethod
    def _apply_token_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logit_bias, allowed_token_ids, bad_words (ids beyond the vocabulary were refused at
        admission; the graph's vocabulary may be padded wider than the tokenizer's)."""
        device = logits.device
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=device)
                logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                                          device=device))
            if p.allowed_token_ids is not None:
                keep = torch.full_like(logits[i], float("-inf"))
                ids = torch.tensor(p.allowed_token_ids, device=device)
                keep[ids] = 0.0
                logits[i] += keep
            if seq.bad_words_token_ids:
                out = seq.output_token_ids
                banned = [w[-1] for w in seq.bad_words_token_ids
                          if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])]
                if banned:
                    logits[i, torch.tensor(banned, device=device)] = float("-inf")

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return
        device, vocab = logits.device, logits.shape[1]
        r = len(rows)
        out_rows: list[int] = []
        out_tokens: list[int] = []
        seen_rows: list[int] = []
        seen_tokens: list[int] = []
        for j, i in enumerate(rows):
            seq = seqs[i]
            out_rows += [j] * seq.num_output_tokens
            out_tokens += seq.output_token_ids
            if seq.params.repetition_penalty != 1.0:
                seen_rows += [j] * seq.num_prompt_tokens
                seen_tokens += seq.prompt_token_ids
        counts = torch.zeros((r, vocab), dtype=torch.float32, device=device)
        if out_tokens:
            counts.index_put_(
                (torch.tensor(out_rows, device=device), torch.tensor(out_tokens, device=device)),
                torch.ones(len(out_tokens), device=device), accumulate=True,
            )
        in_prompt = torch.zeros((r, vocab), dtype=torch.bool, device=device)
        if seen_tokens:
            in_prompt[torch.tensor(seen_rows, device=device), torch.tensor(seen_tokens, device=device)] = True

        def col(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

        params = [seqs[i].params for i in rows]
        rep = col([p.repetition_penalty for p in params])
        presence = col([p.presence_penalty for p in params])
        frequency = col([p.frequency_penalty for p in params])
        index = torch.tensor(rows, device=device)
        sub = logits.index_select(0, index)
        in_output = counts > 0
        repeated = in_prompt | in_output
        sub = torch.where(repeated, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - frequency * counts - presence * in_output.float()
        logits.index_copy_(0, index, sub)

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_sampled_tokens >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops.update(self.eos_token_ids)
            for t in stops:
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
        if rows:
            device = logits.device
            logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")

    # ---- step 3-4: the draw -------------------------------------------------------------
    def _draw(self, seen: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = seen.device
        params = [s.params for s in seqs]
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                             dtype=torch.float32, device=device)
        scaled = self.truncate(seen / temps[:, None], seqs)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self._generator(self._unseeded, device))
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
        if seeded:
            gen = self._generator(self._seeded, device)
            for i in seeded:
                seq = seqs[i]
                # In-flight tokens count: a deferred draw is for the same position as a
                # synchronous one would be.
                gen.manual_seed(row_seed(params[i].seed, seq.index, seq.num_sampled_tokens))
                noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def truncate(scaled: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """top-k, then top-p over the top-k survivors, then min-p: dropped tokens get -inf."""
        params = [s.params for s in seqs]
        device = scaled.device
        vocab = scaled.shape[1]
        use_top_k = any(0 < p.top_k < vocab for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            ordered, order = scaled.sort(dim=-1, descending=True)
            drop = torch.zeros_like(ordered, dtype=torch.bool)
            if use_top_k:
                k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
                drop |= torch.arange(vocab, device=device)[None, :] >= k[:, None]
                ordered = ordered.masked_fill(drop, float("-inf"))
            if use_top_p:
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
                sorted_probs = torch.softmax(ordered, dim=-1)
                # Keep a token while the mass before it is below top_p (the first always stays).
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
                drop |= mass_before >= top_p[:, None]
                ordered = ordered.masked_fill(drop, float("-inf"))
            scaled = torch.empty_like(scaled).scatter_(1, order, ordered)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            probs = torch.softmax(scaled, dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        return scaled

    # ---- logprobs -----------------------------------------------------------------------
    @staticmethod
    def _logprobs(seen: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> list[TokenLogprobs | None]:
        logprobs = torch.log_softmax(seen, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        wanted = [s.params.logprobs for s in seqs]
        top_n = max(n or 0 for n in wanted)
        top_values = top_ids = None
        if top_n:
            top_values, top_ids = logprobs.topk(top_n, dim=-1)
            top_values, top_ids = top_values.tolist(), top_ids.tolist()
        chosen_list, rank_list, token_list = chosen[:, 0].tolist(), ranks.tolist(), tokens.tolist()
        result: list[TokenLogprobs | None] = []
        for i, n in enumerate(wanted):
            if n is None:
                result.append(None)
                continue
            top = [TopLogprob(top_ids[i][j], top_values[i][j]) for j in range(n)] if n else []
            result.append(TokenLogprobs(token_id=token_list[i], logprob=chosen_list[i], rank=rank_list[i], top=top))
        return result
