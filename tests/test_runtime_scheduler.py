"""Scheduler: FCFS, token budget, sequence cap, chunked prefill, preemption, abort, n > 1 forks."""

from __future__ import annotations

import pytest

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence, SequenceStatus

_ids = iter(range(10**9))


def seq_of(num_tokens: int, first: int = 1, n: int = 1) -> list[Sequence]:
    rid = f"r{next(_ids)}"
    params = SamplingParams(max_tokens=50, n=n)
    seqs = [Sequence(seq_id=next(_ids), request_id=rid, prompt_token_ids=list(range(first, first + num_tokens)),
                     params=params, index=i) for i in range(n)]
    for s in seqs[1:]:
        s.fork_parent = seqs[0]
    return seqs


def advance(sched: Scheduler, out, token: int = 7) -> None:
    """What the engine does after the model ran: count computed tokens, sample."""
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.commit(item.seq)
        if item.samples:
            item.seq.append_token(token)


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, caching=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=caching),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def test_chunked_prefill_mixes_with_decodes_and_respects_the_budget():
    sched = make(budget=16)
    (short,) = seq_of(5)
    sched.add(short)
    advance(sched, out := sched.schedule())
    assert [(i.seq, i.num_new_tokens, i.samples) for i in out.scheduled] == [(short, 5, True)]
    (long,) = seq_of(40, first=100)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = sched.schedule()
        assert out.num_tokens <= 16
        # The running decode is never stalled by the long prompt.
        assert out.scheduled[0].seq is short and out.scheduled[0].num_new_tokens == 1
        chunks.append(out.scheduled[1].num_new_tokens)
        advance(sched, out)
        sched.block_manager.check_invariants(sched.live_sequences())
    assert chunks == [15, 15, 10]
    assert short.num_output_tokens == 1 + len(chunks)


def test_first_come_first_served_and_max_num_seqs():
    sched = make(max_num_seqs=2, budget=100)
    a, b, c = seq_of(3)[0], seq_of(3)[0], seq_of(3)[0]
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a, b]
    assert list(sched.waiting) == [c]
    advance(sched, out)
    sched.finish(a, "stop")
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [b, c]


def test_head_of_queue_is_not_overtaken_when_it_does_not_fit():
    sched = make(num_blocks=6, block_size=4, budget=100)  # 5 usable blocks
    (a,) = seq_of(12)
    (big,) = seq_of(12, first=50)
    (small,) = seq_of(2, first=90)
    for s in (a, big, small):
        sched.add(s)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a]  # big needs 3 blocks, 2 are left; small waits behind it
    assert list(sched.waiting) == [big, small]


def test_preemption_takes_the_newest_and_keeps_its_tokens():
    sched = make(num_blocks=5, block_size=2, budget=100)  # 4 usable blocks = 8 tokens
    (old,) = seq_of(3)
    (new,) = seq_of(3, first=20)
    sched.add(old)
    sched.add(new)
    advance(sched, sched.schedule())  # both prefilled: 2 blocks each, 4 tokens each
    out = sched.schedule()  # both still fit (4 tokens in 2 blocks)
    advance(sched, out)
    out = sched.schedule()  # old needs a 3rd block -> new is preempted
    assert out.preempted == [new] and [i.seq for i in out.scheduled] == [old]
    assert new.status == SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert new.output_token_ids == [7, 7] and sched.waiting[0] is new
    assert sched.stats.num_preemptions == 1
    sched.block_manager.check_invariants(sched.live_sequences())
    advance(sched, out)
    sched.finish(old, "stop")
    out = sched.schedule()
    # Recomputed from prompt + generated tokens; with prefix caching its first block is still cached.
    assert out.scheduled[0].seq is new and out.scheduled[0].samples
    assert new.num_cached_tokens + out.scheduled[0].num_new_tokens == 5


def test_the_newest_sequence_preempts_itself_when_only_it_needs_a_block():
    sched = make(num_blocks=5, block_size=2, budget=100, caching=False)  # 4 usable blocks
    (a,) = seq_of(3)  # 2 blocks, room for one more token
    (b,) = seq_of(4, first=40)  # 2 full blocks
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a] and out.preempted == [b]
    assert b.status == SequenceStatus.WAITING and b.output_token_ids == [7]
    sched.block_manager.check_invariants(sched.live_sequences())
    advance(sched, out)
    sched.finish(a, "stop")
    out = sched.schedule()
    assert out.scheduled[0].seq is b and out.scheduled[0].num_new_tokens == 5


def test_abort_frees_blocks_wherever_the_sequence_is():
    sched = make(max_num_seqs=1)
    (a,) = seq_of(10)
    (b,) = seq_of(10, first=30)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert not sched.has_unfinished()
    assert a.finish_reason == b.finish_reason == "abort"
    bm = sched.block_manager
    assert bm.num_used_blocks == 0
    bm.check_invariants([])


@pytest.mark.parametrize("caching", [True, False])
def test_n_completions_share_the_prompt_blocks(caching):
    sched = make(budget=8, caching=caching)
    parent, s1, s2 = seq_of(13, n=3)  # 3 full blocks of 4 + 1 token
    for s in (parent, s1, s2):
        sched.add(s)
    out = sched.schedule()
    # The siblings wait while the first completion computes the prompt in chunks.
    assert [i.seq for i in out.scheduled] == [parent]
    advance(sched, out)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [parent]
    advance(sched, out)
    assert parent.num_output_tokens == 1
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [parent, s1, s2]
    for s in (s1, s2):
        assert s.block_table[:3] == parent.block_table[:3]
        assert s.block_table[3] != parent.block_table[3]  # the partial block is each one's own
        item = next(i for i in out.scheduled if i.seq is s)
        assert item.num_new_tokens == 1 and item.samples  # only the prompt's last token
    assert all(sched.block_manager.ref_counts[b] == 3 for b in parent.block_table[:3])
    if caching:
        assert s1.num_cached_tokens == 12
    else:
        assert sched.stats.num_forked_tokens == 24
    sched.block_manager.check_invariants(sched.live_sequences())
    advance(sched, out)
    sched.finish(parent, "stop")
    assert all(sched.block_manager.ref_counts[b] == 2 for b in s1.block_table[:3])
    sched.block_manager.check_invariants(sched.live_sequences())


def test_siblings_start_alone_when_the_first_completion_finished_early():
    sched = make(caching=False)
    parent, sib = seq_of(9, n=2)
    sched.add(parent)
    sched.add(sib)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [parent]
    advance(sched, out)
    sched.finish(parent, "stop")
    out = sched.schedule()
    assert out.scheduled[0].seq is sib and out.scheduled[0].num_new_tokens == 9
