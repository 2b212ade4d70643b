"""The sampler: next tokens for a batch of logits rows, on the logits' device."""

from __future__ import annotations

import torch

from kiln.runtime.sequence import Sequence


class Sampler:
    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` [S, V] (float32), row i belonging to seqs[i]."""
        greedy = logits.argmax(dim=-1)
        temps = torch.tensor([max(s.params.temperature, 1e-5) for s in seqs], device=logits.device)
        is_greedy = [s.params.greedy for s in seqs]
        if all(is_greedy):
            return greedy.tolist()
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        chosen = greedy.clone()
        for i, s in enumerate(seqs):
            if is_greedy[i]:
                continue
            gen = None
            if s.params.seed is not None:
                gen = torch.Generator(device=logits.device).manual_seed(s.params.seed + s.index * 7919 + len(s.output_token_ids))
            chosen[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return chosen.tolist()
