"""The scheduler: which sequences run this step, and how many tokens each.

First come, first served. A step has a token budget (`max_num_batched_tokens`) and a cap
on running sequences (`max_num_seqs`). Running sequences are served first, in arrival
order (a decode costs one token); then waiting ones are admitted, their prompts cut into
chunks that fit the remaining budget (chunked prefill: a long prompt never stalls the
running decodes, and one step mixes decodes with prefill chunks).

Admission reuses K/V already computed: the prompt's leading full blocks found in the
prefix cache, or, for the 2nd..nth completion of a request with n > 1, the full prompt
blocks of its first completion (the sibling waits until those are computed).

When KV blocks run out, the newest running sequence is preempted: its blocks are freed and
it goes back to the front of the waiting queue, to be recomputed from its prompt and the
tokens it had already generated, so it loses nothing (and with prefix caching its freed
blocks are usually still cached when it comes back).

Preemption is the fallback; admission tries to make it rare (as SGLang's scheduler does).
With `reserve_ratio` > 0, a waiting sequence is admitted only if, beside its whole prompt,
the free blocks hold room for the tokens the running sequences and itself are still
expected to generate: what each may still generate (max_tokens less what it has, clipped
to RESERVE_CLIP_TOKENS), all of it for a sequence that only its length can end (EOS
ignored, no stop strings, tokens or grammar: benchmarks), else `reserve_ratio` x
`used_fraction` of it. `used_fraction` learns from finished sequences how much of that they
used (1 while none has finished), so the reservation follows the workload. The room is
counted over the coming steps (runtime/kv_projection.py): a decoding sequence that only its
length can end grows a token a step and frees its blocks after its last, so the test is the
peak of what all will hold, not the sum of their final sizes; when their ends are staggered
(known lengths that differ, benchmark_serving's way) ~15% more sequences run at once than the
sum allowed (bench/simulate_scheduler.py, workload max_tokens_64_448: +1.7-2.8% output
tokens/s, no preemptions). Every other sequence holds its reservation from now on. The engine's
default ratio is 0.5 (SGLang starts its `new_token_ratio` at 0.7): in the simulation of
bench/simulate_scheduler.py it costs at most 0.6% on workloads that stop early, where 0.7
and 1.0 cost up to 2% and 4% by holding back admissions. Without it, a KV-bound run admits
every prompt that fits and then preempts a third of its sequences as they grow,
recomputing each (the Mixtral offline run: 218 preemptions, ~16% more prefill tokens; with
it, none and 21% more output tokens/s: bench/RESULTS.md J1, K3).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.kv_projection import BlockProfile, KVProjection
from kiln.runtime.sequence import Sequence, SequenceStatus

# The most tokens admission keeps room for a sequence: a request allowed thousands of tokens
# (max_tokens up to the context length) does not hold back admissions by itself.
RESERVE_CLIP_TOKENS = 1024
# The weight of each finished sequence in `Scheduler.used_fraction` (a running mean).
USED_FRACTION_WEIGHT = 0.05


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    # Whether this chunk reaches the end of the sequence's tokens, so a token is sampled
    # from its last row. Fixed at scheduling time, before num_computed_tokens moves.
    samples: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    # Prompt tokens a sibling (n > 1) took from its first completion instead of computing.
    num_forked_tokens: int = 0
    # Steps scheduled before the previous step's tokens were read (async scheduling).
    num_continuation_steps: int = 0


def ends_by_length_only(seq: Sequence) -> bool:
    """Whether nothing but max_tokens (or the context length) can end `seq`: EOS ignored, no
    stop strings or tokens, no grammar to complete."""
    p = seq.params
    return p.ignore_eos and not p.stop and not p.stop_token_ids and p.structured_outputs is None


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 reserve_ratio: float = 0.0):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if not 0.0 <= reserve_ratio <= 1.0:
            raise ValueError(f"kv_reserve_ratio must be in [0, 1], got {reserve_ratio}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.reserve_ratio = reserve_ratio
        # How much of what they could generate finished sequences generated (see the module
        # docstring): a running mean, 1 until a sequence finishes.
        self.used_fraction = 1.0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> list[Sequence]:
        return list(self.waiting) + self.running

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.stats.num_steps += 1
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens, budget)
            # Victims come from the end of the queue, never from before `seq`: sequences
            # already scheduled this step keep their blocks.
            while not bm.can_allocate(seq, n) and seq.status == SequenceStatus.RUNNING:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
            if seq.status != SequenceStatus.RUNNING:
                break  # `seq` was the newest and gave up its own blocks
            bm.allocate(seq, n)
            out.scheduled.append(ScheduledSequence(seq, n, samples=n == seq.num_pending_tokens))
            budget -= n
            i += 1

        # A sequence preempted this step waits for the next one, so that blocks freed under
        # pressure go to the sequences already running instead of being re-taken at once.
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        self.stats.num_scheduled_tokens += self.max_num_batched_tokens - budget
        return out

    def schedule_continuation(self, ending: Collection[Sequence] = ()) -> list[ScheduledSequence] | None:
        """The next step, scheduled while the step before it is still in flight (async
        scheduling), before its sampled tokens are read back: what `schedule()` would do once
        they land, if none of them ends its sequence. A sequence with a token in flight brings
        that token (its id is still on the device); prefill chunks and admissions are
        scheduled as `schedule()` schedules them, so a continuation may be a decode step or a
        mixed one.

        `ending`: running sequences known to end with their in-flight token (their length
        reaches max_tokens or the context length): they are left out, and finish when it is
        read back. Their blocks and seats are freed only then, so admissions see them taken.

        None when that step would have to preempt (its blocks do not fit) or has nothing to
        run: the caller then reads the tokens first and calls `schedule()`. Sequences that
        turn out to end with their in-flight token otherwise (a stop token or string) are
        dropped when it is read back, their extra token discarded.
        """
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        chunks: list[tuple[Sequence, int, bool]] = []
        needed = 0
        for seq in self.running:
            if budget <= 0:
                break
            if seq in ending:
                continue
            pending = seq.num_pending_tokens + seq.num_inflight_tokens
            if pending == 0:
                return None  # nothing to compute until its token is read: not a state schedule() meets
            n = min(pending, budget)
            needed += bm.blocks_needed(seq, n)
            chunks.append((seq, n, n == pending))
            budget -= n
        if needed > bm.num_available_blocks:
            return None  # schedule() would preempt
        out = SchedulerOutput()
        for seq, n, samples in chunks:
            bm.allocate(seq, n)
            out.scheduled.append(ScheduledSequence(seq, n, samples=samples))
        budget = self._admit_waiting(out, budget)
        if not out.scheduled:
            return None  # everything running ends with its token in flight, and nobody is admitted
        self.stats.num_steps += 1
        self.stats.num_continuation_steps += 1
        self.stats.num_scheduled_tokens += self.max_num_batched_tokens - budget
        return out.scheduled

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        # Over the running sequences: only when needed.
        projection = self._project_running() if self.waiting and self.reserve_ratio else None
        held: list[Sequence] = []  # siblings waiting for their first completion's prompt
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            shared, from_cache = self._shared_prefix(seq)
            if shared is None:
                held.append(self.waiting.popleft())
                continue
            n = min(seq.num_tokens - len(shared) * bm.block_size, budget)
            if not self._admissible(seq, shared, n, projection):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if not from_cache:
                self.stats.num_forked_tokens += len(shared) * bm.block_size
            seq.fork_parent = None
            bm.admit(seq, shared, n, from_cache=from_cache)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if projection is not None:
                projection.add(self._profile(seq, len(seq.block_table)))
            out.scheduled.append(ScheduledSequence(seq, n, samples=n == seq.num_pending_tokens))
            budget -= n
        self.waiting.extendleft(reversed(held))
        return budget

    # ---- admission's reservation (see the module docstring) ---------------------------------
    def reserved_tokens(self, seq: Sequence) -> int:
        """Tokens beyond `seq`'s own (in flight included) that admission keeps room for."""
        if not self.reserve_ratio:
            return 0
        remaining = min(seq.params.max_tokens - seq.num_sampled_tokens, RESERVE_CLIP_TOKENS)
        share = 1.0 if ends_by_length_only(seq) else self.reserve_ratio * self.used_fraction
        return math.ceil(max(0, remaining) * share)

    def _profile(self, seq: Sequence, table_blocks: int) -> BlockProfile:
        """`seq`'s KV footprint over the coming steps (runtime/kv_projection.py), counted beyond
        `table_blocks` blocks: a sequence only its length can end grows a token a step up to
        its reservation, and one decoding (its prompt computed) whose reservation is all it may
        still generate ends after that many steps, one more for the read-back of its last token
        (async scheduling); other sequences hold their reservation from now on."""
        tokens = seq.num_tokens + seq.num_inflight_tokens
        if not ends_by_length_only(seq):
            return BlockProfile(tokens + self.reserved_tokens(seq), 0, table_blocks)
        remaining = max(0, seq.params.max_tokens - seq.num_sampled_tokens)
        growth = self.reserved_tokens(seq)
        # Every running sequence gets its token each step only when the step's budget covers
        # them all; else a decode may wait, and its end is not known.
        if growth < remaining or seq.num_pending_tokens > 1 or self.max_num_seqs > self.max_num_batched_tokens:
            return BlockProfile(tokens, growth, table_blocks)
        rc = self.block_manager.ref_counts
        freed = sum(1 for b in seq.block_table if rc[b] == 1)
        return BlockProfile(tokens, growth, table_blocks, ends_after=remaining + 1, freed_blocks=freed)

    def _project_running(self) -> KVProjection:
        return KVProjection([self._profile(seq, len(seq.block_table)) for seq in self.running],
                            self.block_manager.block_size)

    def _admissible(self, seq: Sequence, shared: list[int], n: int, projection: KVProjection | None) -> bool:
        """Whether waiting `seq`, starting from `shared` blocks with a first chunk of `n` tokens,
        is admitted beside the running sequences' `projection` (None: no reservation). A
        sequence that finds nothing running is admitted whenever its chunk fits, so a prompt
        with a reservation larger than the cache still runs."""
        bm = self.block_manager
        room = bm.room_after(shared)
        if bm.blocks_to_admit(shared, n) > room:
            return False
        if projection is None or not self.running:
            return True
        return projection.peak(self._profile(seq, len(shared))) <= room

    def _shared_prefix(self, seq: Sequence) -> tuple[list[int] | None, bool]:
        """Blocks `seq` can start from, and whether they came from the prefix cache.

        None means: wait, a sibling is still computing the prompt this one will share.
        """
        parent = seq.fork_parent
        if self.block_manager.num_state_slots:
            return [], True  # recurrent states start empty: every prompt is computed in full
        if parent is not None and parent.status != SequenceStatus.FINISHED:
            bs = self.block_manager.block_size
            num_shared = (seq.num_tokens - 1) // bs
            if num_shared > 0:
                if parent.status == SequenceStatus.WAITING or parent.num_computed_tokens < num_shared * bs:
                    return None, False
                cached = self.block_manager.match_prefix(seq)
                if len(cached) >= num_shared:
                    return cached, True  # same blocks, but counted as the cache hit it is
                return parent.block_table[:num_shared], False
        return self.block_manager.match_prefix(seq), True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues and free its blocks (finished or aborted)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if reason in ("stop", "length") and not ends_by_length_only(seq):  # aborts tell nothing
            could = min(seq.params.max_tokens, RESERVE_CLIP_TOKENS)
            used = min(1.0, seq.num_output_tokens / could)
            self.used_fraction += USED_FRACTION_WEIGHT * (used - self.used_fraction)
