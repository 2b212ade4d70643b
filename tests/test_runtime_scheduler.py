"""Scheduler: FCFS, token budget, sequence cap, chunked prefill, preemption, abort, n > 1 forks."""

from __future__ import annotations

import pytest

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.kv_projection import BlockProfile, KVProjection
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


# ---- admission's KV reservation (kv_reserve_ratio) -----------------------------------------

def _length_only(num_tokens: int, max_tokens: int, first: int = 1, stop: bool = False) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=not stop, stop_token_ids=[3] if stop else [])
    return Sequence(seq_id=next(_ids), request_id=f"r{next(_ids)}", prompt_token_ids=list(range(first, first + num_tokens)),
                    params=params)


def _run_to_end(sched: Scheduler, seqs: list[Sequence], lengths: dict[int, int] | None = None) -> int:
    """Step until every sequence has its output (its max_tokens, or `lengths[seq_id]`, ended by
    a stop); returns the steps taken. Block invariants hold after every step."""
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.scheduled, "nothing scheduled: admission is stuck"
        advance(sched, out, token=5)
        for item in out.scheduled:
            s = item.seq
            want = (lengths or {}).get(s.seq_id, s.params.max_tokens)
            if item.samples and s.num_output_tokens >= want:
                sched.finish(s, "length" if want == s.params.max_tokens else "stop")
        sched.block_manager.check_invariants(sched.live_sequences())
        steps += 1
    return steps


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_reservation_admits_only_what_can_grow_to_its_end(ratio):
    # 10 sequences of 12 prompt + 20 output tokens (8 blocks of 4 each at the end) in 40
    # blocks: all prompts fit at once (3 blocks each), their outputs do not. Admitting them all
    # preempts as they grow; reserving what ignore_eos sequences will generate never does.
    sched = Scheduler(BlockManager(41, 4, enable_prefix_caching=False), max_num_seqs=16,
                      max_num_batched_tokens=256, reserve_ratio=ratio)
    seqs = [_length_only(12, 20, first=100 * i + 1) for i in range(10)]
    _run_to_end(sched, seqs)
    assert all(s.num_output_tokens == 20 for s in seqs)
    if ratio == 0.0:
        assert sched.stats.num_preemptions > 0
    else:
        assert sched.stats.num_preemptions == 0
        assert sched.stats.num_scheduled_tokens == 10 * (12 + 20 - 1)  # nothing recomputed


def test_projection_peaks_just_before_an_end_and_counts_what_the_end_frees():
    # Blocks of 4 tokens. `ending`: 8 tokens in 2 blocks, 4 more to come, ends after 5 steps
    # and frees its 2 blocks; `growing`: 4 tokens in 1 block, 12 more, end unknown.
    ending = BlockProfile(tokens=8, growth=4, table_blocks=2, ends_after=5, freed_blocks=2)
    growing = BlockProfile(tokens=4, growth=12, table_blocks=1)
    projection = KVProjection([ending, growing], block_size=4)
    # Step 5: 12 tokens (1 block more) and 9 (2 more); after it: -2 and 16 tokens (3 more).
    assert projection.peak() == 3
    newcomer = BlockProfile(tokens=0, growth=8, table_blocks=0)  # 5 tokens at step 5, 8 after
    assert projection.peak(newcomer) == 5
    projection.add(newcomer)
    assert projection.peak() == 5


def test_reservation_admits_past_the_final_sizes_when_ends_are_staggered():
    # 12 sequences of 8 prompt tokens and 4..48 output tokens (ignore_eos) in 60 blocks of 4:
    # their final sizes sum to 102 blocks. The shortest end first and hand their blocks to the
    # rest, so more run at once than their final sizes fit, and none is preempted.
    sched = Scheduler(BlockManager(61, 4, enable_prefix_caching=False), max_num_seqs=16,
                      max_num_batched_tokens=64, reserve_ratio=0.5)
    seqs = [_length_only(8, 4 * k, first=100 * k) for k in range(1, 13)]
    for s in seqs:
        sched.add(s)
    most_final_blocks = 0
    while sched.has_unfinished():
        out = sched.schedule()
        most_final_blocks = max(most_final_blocks, sum(-(-(8 + s.params.max_tokens) // 4) for s in sched.running))
        advance(sched, out, token=5)
        for item in out.scheduled:
            if item.samples and item.seq.num_output_tokens >= item.seq.params.max_tokens:
                sched.finish(item.seq, "length")
        sched.block_manager.check_invariants(sched.live_sequences())
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.stats.num_preemptions == 0
    assert most_final_blocks > 60, most_final_blocks


def test_a_sequence_larger_than_its_reservation_room_runs_alone():
    # Its prompt fits, prompt + reservation do not: with nothing running it is admitted anyway.
    sched = Scheduler(BlockManager(9, 4, enable_prefix_caching=False), max_num_seqs=4,
                      max_num_batched_tokens=64, reserve_ratio=1.0)
    big, small = _length_only(16, 40), _length_only(4, 4, first=50)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [big]  # small would eat big's reserved room
    assert sched.reserved_tokens(big) == 40


def test_reservation_learns_from_sequences_that_stop_early():
    sched = Scheduler(BlockManager(400, 4, enable_prefix_caching=False), max_num_seqs=16,
                      max_num_batched_tokens=256, reserve_ratio=0.5)
    seqs = [_length_only(8, 40, first=10 * i + 1, stop=True) for i in range(40)]
    probe = _length_only(8, 40, first=999, stop=True)
    assert sched.reserved_tokens(probe) == 20  # 0.5 x 40 while nothing has finished
    _run_to_end(sched, seqs, lengths={s.seq_id: 10 for s in seqs})  # each stops at a quarter
    assert sched.used_fraction < 0.6
    assert sched.reserved_tokens(probe) < 12
    # Sequences only their length can end reserve all they will generate, whatever was learned.
    assert sched.reserved_tokens(_length_only(8, 40)) == 40


def test_a_decode_continues_before_read_back_while_the_queue_head_cannot_be_admitted():
    # The cache is full: the waiting head cannot be admitted, so the next decode step is
    # scheduled as a continuation (before the tokens are known): the decodes alone.
    sched = Scheduler(BlockManager(13, 4, enable_prefix_caching=False), max_num_seqs=8,
                      max_num_batched_tokens=64, reserve_ratio=0.0)
    running = [_length_only(11, 30, first=1), _length_only(11, 30, first=40)]
    for s in running:
        sched.add(s)
    advance(sched, out := sched.schedule())
    assert len(out.scheduled) == 2
    waiting = _length_only(28, 4, first=80)  # 7 blocks: 6 are free
    sched.add(waiting)
    items = sched.schedule_continuation()
    assert [(i.seq, i.num_new_tokens, i.samples) for i in items] == [(s, 1, True) for s in running]
    assert sched.stats.num_continuation_steps == 1
    # With 9 blocks free the head is admissible: the continuation admits it, as schedule() would.
    sched.finish(running[1], "length")
    items = sched.schedule_continuation()
    assert [(i.seq, i.num_new_tokens, i.samples) for i in items] == [(running[0], 1, True), (waiting, 28, True)]


def test_a_continuation_brings_in_flight_tokens_and_prefill_chunks():
    """A continuation of a mixed step: a sequence with its token in flight (on the device)
    gets that one token, a prompt mid-prefill its next chunk, and the queue is admitted from
    what is left of the budget, as schedule() does once the tokens land."""
    sched = make(num_blocks=64, budget=16, caching=False)
    short, long = _length_only(6, 10, first=1), _length_only(30, 10, first=100)
    sched.add(short)
    sched.add(long)
    out = sched.schedule()
    assert [(i.seq, i.num_new_tokens, i.samples) for i in out.scheduled] == [(short, 6, True), (long, 10, False)]
    for item in out.scheduled:  # launched: computed, and short's token drawn on the device
        item.seq.num_computed_tokens += item.num_new_tokens
    short.num_inflight_tokens = 1
    late = _length_only(8, 10, first=200)
    sched.add(late)
    items = sched.schedule_continuation()
    assert [(i.seq, i.num_new_tokens, i.samples) for i in items] == [(short, 1, True), (long, 15, False)]
    assert sched.block_manager.blocks_needed(short, 0) == 0 and len(short.block_table) == 2  # room for token 7
    # That one launched, its draw queued, the first step's token read back: short has one
    # token in flight again. The next: short's token, long's last 5, late from what is left.
    for item in items:
        item.seq.num_computed_tokens += item.num_new_tokens
    short.append_token(5)
    items = sched.schedule_continuation()
    assert [(i.seq, i.num_new_tokens, i.samples) for i in items] == [(short, 1, True), (long, 5, True),
                                                                       (late, 8, True)]
    assert sched.stats.num_continuation_steps == 2


def test_a_continuation_leaves_out_sequences_ending_with_their_token_in_flight():
    """A sequence whose in-flight token is its last (max_tokens) is left out of the
    continuation, which still runs the others; it keeps its blocks and its seat until the
    read-back finishes it, so the queue head is not admitted in its place yet. A continuation
    with nothing left to run is None."""
    sched = make(num_blocks=64, max_num_seqs=2, budget=16, caching=False)
    last, other = _length_only(4, 1, first=1), _length_only(4, 10, first=50)
    for s in (last, other):
        sched.add(s)
    out = sched.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.num_inflight_tokens = 1
    late = _length_only(4, 10, first=100)
    sched.add(late)
    blocks = list(last.block_table)
    items = sched.schedule_continuation(ending={last})
    assert [(i.seq, i.num_new_tokens, i.samples) for i in items] == [(other, 1, True)]
    assert last.block_table == blocks and last in sched.running and list(sched.waiting) == [late]
    assert sched.schedule_continuation(ending={last, other}) is None
    assert sched.stats.num_continuation_steps == 1


def test_a_continuation_that_would_preempt_is_refused():
    sched = make(num_blocks=5, max_num_seqs=4, budget=64, caching=False)
    seqs = [_length_only(8, 10, first=1), _length_only(8, 10, first=50)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(out.scheduled) == 2
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.num_inflight_tokens = 1
    # Each in-flight token needs a third block; 4 usable blocks in all: schedule() would preempt.
    assert sched.schedule_continuation() is None
    assert all(len(s.block_table) == 2 for s in seqs)  # nothing allocated
    assert sched.stats.num_continuation_steps == 0


def test_kv_reserve_ratio_is_checked():
    with pytest.raises(ValueError, match="kv_reserve_ratio"):
        Scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=8, reserve_ratio=1.5)
