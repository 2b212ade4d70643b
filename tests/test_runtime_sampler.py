"""Sampler on hand-made logits: every option, logprobs, and seeds independent of the batch.

Each test runs on CPU and, where there is one, on a CUDA GPU: the sampler works on the
device of the logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence

V = 50
EOS = 3
_ids = iter(range(10**9))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    return torch.device(request.param)


def seq(prompt=(1, 2), output=(), index=0, **params) -> Sequence:
    s = Sequence(seq_id=next(_ids), request_id="r", prompt_token_ids=list(prompt),
                 params=SamplingParams(**params), index=index)
    for t in output:
        s.append_token(t)
    return s


def logits_rows(n: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n, V), generator=g) * 3).to(device)


def test_greedy_is_argmax_and_input_logits_are_untouched(device):
    logits = logits_rows(4, device=device)
    before = logits.clone()
    out = Sampler([EOS]).sample(logits, [seq(temperature=0) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4
    assert torch.equal(logits, before)


def manual_penalized(row: torch.Tensor, prompt, output, rep, presence, frequency) -> torch.Tensor:
    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(output):
        row[t] -= presence + frequency * output.count(t)
    return row


def test_penalties_and_logprobs_equal_log_softmax_of_what_the_sampler_saw(device):
    prompt, output = [5, 6, 7], [7, 8, 8, 8, 9]
    seqs = [
        seq(prompt, output, temperature=0, repetition_penalty=1.7, logprobs=5),
        seq(prompt, output, temperature=0, presence_penalty=1.5, frequency_penalty=0.5, logprobs=2),
        seq(prompt, output, temperature=0.8, seed=3, logprobs=0),  # no penalties, sampled
    ]
    out = Sampler([EOS]).sample(logits_rows(3, seed=1, device=device), seqs)
    logits = logits_rows(3, seed=1)  # the reference is computed independently, on CPU
    expected_seen = [
        manual_penalized(logits[0], prompt, output, 1.7, 0.0, 0.0),
        manual_penalized(logits[1], prompt, output, 1.0, 1.5, 0.5),
        logits[2],
    ]
    assert not torch.allclose(expected_seen[0], logits[0])  # the penalty did something
    for i, (seen, lp) in enumerate(zip(expected_seen, out.logprobs)):
        ref = torch.log_softmax(seen, -1)
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-5)
        assert lp.rank == int((ref > ref[token]).sum()) + 1
        want_n = seqs[i].params.logprobs
        top_vals, top_ids = ref.topk(want_n) if want_n else (torch.tensor([]), torch.tensor([]))
        assert [t.token_id for t in lp.top] == top_ids.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top_vals.tolist(), abs=1e-5)
    # Greedy rows pick the argmax of the penalized logits.
    assert out.token_ids[0] == int(expected_seen[0].argmax())
    assert out.token_ids[1] == int(expected_seen[1].argmax())


def test_repetition_penalty_steers_greedy_away_from_a_seen_token(device):
    logits = torch.zeros((1, V))
    logits[0, 10] = 2.0
    logits[0, 11] = 1.5
    logits = logits.to(device)
    assert Sampler().sample(logits, [seq(temperature=0)]).token_ids == [10]
    assert Sampler().sample(logits, [seq(prompt=[10], temperature=0, repetition_penalty=2.0)]).token_ids == [11]


def draws(logits_row: torch.Tensor, n: int, **params) -> list[int]:
    """n independent samples of one distribution, in one batch (unseeded rows)."""
    logits = logits_row.expand(n, -1).contiguous()
    return Sampler().sample(logits, [seq(**params) for _ in range(n)]).token_ids


def test_temperature_sampling_follows_the_softmax(device):
    row = logits_rows(1, seed=2)[0] / 3
    n = 20000
    temp = 0.7
    counts = torch.bincount(torch.tensor(draws(row.to(device), n, temperature=temp)), minlength=V).float() / n
    expected = torch.softmax(row / temp, -1)
    # 4 standard errors of a binomial proportion, per token.
    tolerance = 4 * torch.sqrt(expected * (1 - expected) / n) + 1e-3
    assert torch.all((counts - expected).abs() <= tolerance)


def test_top_k_top_p_min_p_keep_only_the_allowed_tokens(device):
    row = torch.linspace(4, -4, V)  # token 0 most likely, then 1, 2, ...
    probs = torch.softmax(row, -1)
    assert set(draws(row.to(device), 3000, temperature=1.0, top_k=3)) == {0, 1, 2}
    # top_p: the smallest prefix whose mass reaches p.
    cum = probs.cumsum(0)
    nucleus = int((cum < 0.6).sum()) + 1
    assert set(draws(row.to(device), 3000, temperature=1.0, top_p=0.6)) == set(range(nucleus))
    # min_p: tokens with probability >= min_p * p(top).
    allowed = {i for i in range(V) if probs[i] >= 0.3 * probs[0]}
    assert set(draws(row.to(device), 3000, temperature=1.0, min_p=0.3)) == allowed
    # top_k then top_p over the renormalized survivors.
    k_probs = torch.softmax(row[:5], -1)
    both = int((k_probs.cumsum(0) < 0.9).sum()) + 1
    assert set(draws(row.to(device), 3000, temperature=1.0, top_k=5, top_p=0.9)) == set(range(both))


def test_seed_reproducible_whatever_else_is_in_the_batch(device):
    logits = logits_rows(6, seed=4, device=device) / 3
    target = logits[2]
    params = dict(temperature=1.0, seed=1234)
    alone = Sampler().sample(target[None], [seq(**params)]).token_ids[0]
    # Same row at another position, with other rows (seeded, unseeded, greedy) around it.
    batch = torch.stack([logits[0], logits[1], target, logits[3]])
    others = [seq(temperature=1.0), seq(temperature=0), seq(**params), seq(temperature=1.0, seed=9)]
    assert Sampler().sample(batch, others).token_ids[2] == alone
    batch2 = torch.stack([target, logits[5]])
    assert Sampler().sample(batch2, [seq(**params), seq(temperature=0.5)]).token_ids[0] == alone
    # The draw depends on the output position and the completion index, not only the seed.
    row = target.expand(64, -1)
    by_position = Sampler().sample(row, [seq(output=[1] * i, **params) for i in range(64)]).token_ids
    by_index = Sampler().sample(row, [seq(index=i, **params) for i in range(64)]).token_ids
    assert len(set(by_position)) > 5 and len(set(by_index)) > 5


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(device):
    logits = torch.zeros((1, V))
    logits[0, EOS] = 10.0
    logits[0, 20] = 9.0
    logits[0, 21] = 8.0
    logits = logits.to(device)
    s = Sampler([EOS])
    assert s.sample(logits, [seq(temperature=0, min_tokens=2, stop_token_ids=[20])]).token_ids == [21]
    assert s.sample(logits, [seq(output=[5, 5], temperature=0, min_tokens=2)]).token_ids == [EOS]
    # ignore_eos: EOS is not a stop token, so min_tokens does not mask it.
    assert s.sample(logits, [seq(temperature=0, min_tokens=2, ignore_eos=True)]).token_ids == [EOS]
    lp = s.sample(logits, [seq(temperature=0, min_tokens=1, logprobs=1)]).logprobs[0]
    assert lp.token_id == 20 and lp.top[0].token_id == 20 and math.isfinite(lp.logprob)


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="do not match"):
        Sampler().sample(torch.zeros((2, V)), [seq()])
