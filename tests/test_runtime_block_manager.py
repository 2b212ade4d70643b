"""Block manager: allocation, the prefix cache (hash chain, LRU), forks, and its invariant.

The property test at the end drives the scheduler and block manager with a fake model step
that writes (token, position) into a fake KV cache, so it checks not only the bookkeeping
but that every block a sequence reads holds that sequence's tokens.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.runtime.block_manager import BlockInvariantError, BlockManager, hash_block
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence

_ids = iter(range(10**9))


def make_seq(tokens: list[int], **params) -> Sequence:
    return Sequence(seq_id=next(_ids), request_id=f"r{next(_ids)}", prompt_token_ids=list(tokens),
                    params=SamplingParams(**params))


def run_prefill(bm: BlockManager, seq: Sequence, from_cache: bool = True) -> None:
    """Admit `seq` with its prefix-cache hits and 'compute' the rest of its prompt."""
    shared = bm.match_prefix(seq) if from_cache else []
    n = seq.num_tokens - len(shared) * bm.block_size
    assert bm.can_admit(seq, shared, n)
    bm.admit(seq, shared, n, from_cache=from_cache)
    seq.num_computed_tokens += n
    bm.commit(seq)


def test_allocate_and_free_keep_counts():
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=False)
    a, b = make_seq(range(10)), make_seq(range(5))
    run_prefill(bm, a)
    run_prefill(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_used_blocks == 5 and bm.num_free_blocks == 3
    bm.check_invariants([a, b])
    assert 0 not in a.block_table + b.block_table  # the null block is never handed out
    bm.free(a)
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 6 and bm.num_cached_blocks == 0
    bm.check_invariants([b])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(make_seq([1]), 100)


def test_hash_chain_covers_every_token_before_the_block():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == h0


def test_prefix_hit_shares_full_blocks_and_counts_tokens():
    bm = BlockManager(num_blocks=32, block_size=4)
    shared = list(range(1, 13))  # 3 full blocks
    a = make_seq(shared + [50, 51])
    run_prefill(bm, a)
    b = make_seq(shared + [60])
    assert bm.match_prefix(b) == a.block_table[:3]
    run_prefill(bm, b)
    assert b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [bm.ref_counts[x] for x in a.block_table[:3]] == [2, 2, 2]
    assert bm.prefix_stats.queries == a.num_tokens + b.num_tokens
    assert bm.prefix_stats.hits == 12
    bm.check_invariants([a, b])
    # Same block content after a different prefix is a different block.
    c = make_seq([99, 98, 97, 96] + shared[4:] + [1])
    assert bm.match_prefix(c) == []


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 9))  # exactly 2 full blocks
    a = make_seq(prompt)
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq(prompt)
    matched = bm.match_prefix(b)
    assert len(matched) == 1, "the last block must be recomputed so that its last token gives logits"
    run_prefill(bm, b)
    assert b.num_cached_tokens == 4


def test_cached_blocks_survive_until_space_is_needed_lru_first():
    bm = BlockManager(num_blocks=7, block_size=2)  # 6 usable blocks
    a = make_seq([1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    b = make_seq([11, 12, 13, 14, 15])
    run_prefill(bm, a)
    bm.free(a)
    run_prefill(bm, b)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 2  # partial blocks are not cached
    # Needing 4 blocks: the 2 free ones first, then the LRU cached ones (a's, tail first).
    c = make_seq(list(range(100, 108)))
    run_prefill(bm, c)
    assert bm.num_evictions == 2
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == []
    assert len(bm.match_prefix(make_seq([11, 12, 13, 14, 15]))) == 2  # b's blocks survived
    bm.check_invariants([c])


def test_cache_hit_on_an_evictable_block_takes_it_out_of_the_lru():
    bm = BlockManager(num_blocks=5, block_size=2)  # 4 usable
    a = make_seq([1, 2, 3, 4, 9])
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 7])
    shared = bm.match_prefix(b)
    assert len(shared) == 2
    # 1 new block needed; 4 available, but 2 of them are the ones b is about to own.
    assert bm.can_admit(b, shared, 1)
    assert not bm.can_admit(b, shared, 7)
    run_prefill(bm, b)
    assert bm.num_cached_blocks == 0 and bm.num_used_blocks == 3
    bm.check_invariants([b])


def test_prefix_caching_off_caches_nothing():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(1, 13))
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0 and bm.match_prefix(make_seq(range(1, 13))) == []
    bm.check_invariants([])


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(1, 13))
    run_prefill(bm, a)
    bm.free(a)
    assert bm.reset_prefix_cache() == 3
    assert bm.num_free_blocks == 15
    bm.check_invariants([])


def test_invariant_check_catches_corruption():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(1, 10))
    run_prefill(bm, a)
    bm.check_invariants([a])
    bm.ref_counts[a.block_table[0]] += 1
    with pytest.raises(BlockInvariantError, match="owners but ref count"):
        bm.check_invariants([a])
    bm.ref_counts[a.block_table[0]] -= 1
    bm.free_blocks.append(a.block_table[1])  # owned and free at once
    with pytest.raises(BlockInvariantError, match="states"):
        bm.check_invariants([a])
    bm.free_blocks.pop()
    with pytest.raises(BlockInvariantError):
        bm.check_invariants([])  # a's blocks are owned by nobody the check knows


# ---- the property test: 1,000 random requests with random aborts -------------------------

class FakeModel:
    """Stands in for the model: 'computing' a token writes (token, position) to its KV slot,
    and every step first checks that each scheduled sequence's cached context is its own."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.kv: list[tuple[int, int] | None] = [None] * (bm.num_blocks * bm.block_size)

    def step(self, scheduled) -> None:
        bm = self.bm
        for item in scheduled:
            seq = item.seq
            tokens = seq.all_token_ids
            for pos in range(seq.num_computed_tokens):
                slot = bm.slot(seq, pos)
                assert self.kv[slot] == (tokens[pos], pos), f"seq {seq.seq_id} reads a foreign slot at {pos}"
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens):
                slot = bm.slot(seq, pos)
                assert slot // bm.block_size != 0
                self.kv[slot] = (tokens[pos], pos)


def run_random_workload(rng: random.Random, num_requests: int, num_blocks: int, block_size: int,
                        max_num_seqs: int, budget: int, caching: bool) -> tuple[BlockManager, Scheduler]:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    model = FakeModel(bm)
    capacity = (num_blocks - 1) * block_size
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 3 * block_size))] for _ in range(4)]
    requests: dict[str, list[Sequence]] = {}
    arrived = 0
    while arrived < num_requests or sched.has_unfinished():
        for _ in range(rng.randint(0, 4)):  # new arrivals this step
            if arrived == num_requests:
                break
            arrived += 1
            prompt = (rng.choice(prefixes) if rng.random() < 0.5 else []) + \
                [rng.randrange(1, 50) for _ in range(rng.randint(1, 40))]
            max_tokens = rng.randint(1, min(30, capacity // 2))
            prompt = prompt[: capacity - max_tokens]
            n = rng.choice([1, 1, 1, 2, 3])
            params = SamplingParams(max_tokens=max_tokens, n=n)
            rid = f"req{arrived}"
            seqs = [Sequence(seq_id=next(_ids), request_id=rid, prompt_token_ids=prompt, params=params, index=i)
                    for i in range(n)]
            for s in seqs[1:]:
                s.fork_parent = seqs[0]
            requests[rid] = seqs
            for s in seqs:
                sched.add(s)
        if requests and rng.random() < 0.15:  # abort a random request, wherever it is
            rid = rng.choice(list(requests))
            for s in requests.pop(rid):
                if not s.is_finished:
                    sched.finish(s, "abort")
        out = sched.schedule()
        assert out.num_tokens <= budget and len(sched.running) <= max_num_seqs
        model.step(out.scheduled)
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            bm.commit(seq)
            if item.samples:
                seq.append_token(rng.randrange(1, 50))
                if seq.num_output_tokens >= seq.params.max_tokens or rng.random() < 0.03:
                    sched.finish(seq, "stop")
        for rid in [r for r, seqs in requests.items() if all(s.is_finished for s in seqs)]:
            del requests[rid]
        bm.check_invariants(sched.live_sequences())
        assert sched.stats.num_steps < 200_000, "the workload does not drain"
    return bm, sched


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(12, 80), block_size=st.sampled_from([1, 2, 4, 8]),
       max_num_seqs=st.integers(1, 16), budget=st.integers(8, 96), caching=st.booleans())
def test_no_block_leaks_after_1000_random_requests(seed, num_blocks, block_size, max_num_seqs, budget, caching):
    bm, sched = run_random_workload(random.Random(seed), 1000, num_blocks, block_size, max_num_seqs,
                                    budget, caching)
    assert not sched.has_unfinished()
    bm.check_invariants([])
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks + bm.num_cached_blocks == num_blocks - 1
    assert sum(bm.ref_counts) == 0


@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_exercises_preemption_prefix_hits_and_forks(caching):
    """One fixed workload under pressure, to make sure the property test's paths are taken."""
    bm, sched = run_random_workload(random.Random(7), 1000, num_blocks=24, block_size=4, max_num_seqs=8,
                                    budget=32, caching=caching)
    assert sched.stats.num_preemptions > 0
    if caching:
        assert bm.prefix_stats.hits > 0 and bm.num_evictions > 0
    else:  # with the cache, siblings find their prompt there; without it they fork
        assert sched.stats.num_forked_tokens > 0 and bm.prefix_stats.hits == 0
    assert bm.num_used_blocks == 0 and not sched.live_sequences()


def test_step_inputs_tokens_lengths_and_logits_rows():
    # The per-sequence numbers of a step (computed with numpy from one pass over the
    # sequences): token ids (a continuation's token still on the device is a 0 placeholder),
    # lengths, offsets, and the logits rows: sampled rows first, then prompt-logprob rows.
    from kiln.runtime.model_runner import prepare_step_inputs
    from kiln.runtime.scheduler import ScheduledSequence, SchedulerOutput

    bm = BlockManager(num_blocks=64, block_size=4)
    chunked = Sequence(0, "0", list(range(100, 110)), SamplingParams(max_tokens=8, prompt_logprobs=1))
    decode = Sequence(1, "1", [5, 6, 7], SamplingParams(max_tokens=8))
    decode.output_token_ids.append(8)
    continuation = Sequence(2, "2", [9, 10], SamplingParams(max_tokens=8))
    whole = Sequence(3, "3", [11, 12, 13], SamplingParams(max_tokens=8, prompt_logprobs=0))
    plan = [(chunked, 4, 5, False), (decode, 3, 1, True), (continuation, 2, 1, True), (whole, 0, 3, True)]
    items = []
    for seq, computed, n, samples in plan:
        bm.admit(seq, [], computed + n, from_cache=False)
        seq.num_computed_tokens = computed
        items.append(ScheduledSequence(seq, n, samples=samples))
    inputs = prepare_step_inputs(SchedulerOutput(scheduled=items), bm, "cpu")
    assert inputs["input_ids"][0].tolist() == [104, 105, 106, 107, 108, 8, 0, 11, 12, 13]
    assert inputs["seq_lens"].tolist() == [9, 4, 3, 3]
    assert inputs["query_start_loc"].tolist() == [0, 5, 6, 7, 10]
    # Sampled: the last rows of decode, continuation and whole (6 - 1, 7 - 1, 10 - 1); then the
    # prompt rows: chunked's positions 4-8 (rows 0-4), whole's positions 0-1 (rows 7-8).
    assert inputs["logits_indices"].tolist() == [5, 6, 9, 0, 1, 2, 3, 4, 7, 8]


def test_step_inputs_slots_and_tables_follow_the_block_tables():
    # prepare_step_inputs gathers slots from the padded block-table tensor in one op: they
    # must be what the block manager's own mapping says, for prefill chunks that start
    # mid-block, single decode tokens, and sequences whose tables differ in length.
    import torch

    from kiln.runtime.model_runner import prepare_step_inputs
    from kiln.runtime.scheduler import ScheduledSequence, SchedulerOutput

    bm = BlockManager(num_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=8)
    plan = [(list(range(1, 11)), 0, 10), (list(range(20, 27)), 6, 1), (list(range(30, 43)), 5, 6), ([7], 0, 1)]
    items = []
    for i, (prompt, computed, n) in enumerate(plan):
        seq = Sequence(i, str(i), prompt, params)
        bm.admit(seq, [], computed + n, from_cache=False)
        seq.num_computed_tokens = computed
        items.append(ScheduledSequence(seq, n, samples=computed + n == len(prompt)))
    # Interleave the allocations so that tables are not in block order.
    bm.allocate(items[0].seq, 3)
    inputs = prepare_step_inputs(SchedulerOutput(scheduled=items), bm, "cpu")
    expected = [bm.slot(item.seq, p) for item in items
                for p in range(item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_new_tokens)]
    assert inputs["slot_mapping"].tolist() == expected
    assert inputs["position_ids"][0].tolist() == [p for item in items for p in range(
        item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_new_tokens)]
    width = max(len(item.seq.block_table) for item in items)
    assert inputs["block_tables"].tolist() == [item.seq.block_table + [0] * (width - len(item.seq.block_table))
                                               for item in items]
    assert inputs["block_tables"].dtype == torch.int32 and inputs["slot_mapping"].dtype == torch.long
