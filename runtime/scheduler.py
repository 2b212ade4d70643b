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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.sequence import Sequence, SequenceStatus


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
    # Decode steps scheduled before the previous step's tokens were read (async scheduling).
    num_continuation_steps: int = 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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

    def schedule_continuation(self, prev: list[ScheduledSequence]) -> list[ScheduledSequence] | None:
        """The decode step after `prev`, scheduled before `prev`'s tokens are known (async
        scheduling): each of `prev`'s sequences gets one token, the one `prev` is sampling.

        Only when that is exactly what `schedule()` would do once those tokens land: `prev`
        sampled every running sequence, in the running order, nobody is waiting for a slot
        that is free, and the blocks fit without preempting anyone. Otherwise None, and the
        caller reads `prev`'s tokens first and schedules normally. Sequences that turn out
        to finish with `prev`'s token are dropped from the result when it is read back.
        """
        seqs = [item.seq for item in prev]
        if (not prev or not all(item.samples for item in prev) or len(seqs) != len(self.running)
                or any(a is not b for a, b in zip(seqs, self.running))):
            return None
        if self.waiting and len(self.running) < self.max_num_seqs:
            return None  # an admission may be possible: let schedule() decide it
        bm = self.block_manager
        if sum(bm.blocks_needed(seq, 1) for seq in seqs) > bm.num_available_blocks:
            return None  # schedule() would preempt
        for seq in seqs:
            bm.allocate(seq, 1)
        self.stats.num_steps += 1
        self.stats.num_continuation_steps += 1
        self.stats.num_scheduled_tokens += len(seqs)
        return [ScheduledSequence(seq, 1, samples=True) for seq in seqs]

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        held: list[Sequence] = []  # siblings waiting for their first completion's prompt
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            shared, from_cache = self._shared_prefix(seq)
            if shared is None:
                held.append(self.waiting.popleft())
                continue
            n = min(seq.num_tokens - len(shared) * bm.block_size, budget)
            if not bm.can_admit(seq, shared, n):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            if not from_cache:
                self.stats.num_forked_tokens += len(shared) * bm.block_size
            seq.fork_parent = None
            bm.admit(seq, shared, n, from_cache=from_cache)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n, samples=n == seq.num_pending_tokens))
            budget -= n
        self.waiting.extendleft(reversed(held))
        return budget

    def _shared_prefix(self, seq: Sequence) -> tuple[list[int] | None, bool]:
        """Blocks `seq` can start from, and whether they came from the prefix cache.

        None means: wait, a sibling is still computing the prompt this one will share.
        """
        parent = seq.fork_parent
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
