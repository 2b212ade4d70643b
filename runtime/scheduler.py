"""The scheduler: which sequences run this step, and how many tokens each.

First come, first served. A step has a token budget (`max_num_batched_tokens`) and a cap
on running sequences (`max_num_seqs`). Running sequences are served first (a decode costs
one token), then waiting ones are admitted, their prompts cut into chunks that fit the
remaining budget (chunked prefill: a long prompt never stalls the running decodes).
When KV blocks run out, the newest running sequence is preempted: its blocks are freed
and it goes back to the front of the waiting queue, to be recomputed from its prompt and
the tokens it had already generated, so it loses nothing.
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

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so a token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


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
    num_preemptions: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> list[Sequence]:
        return list(self.waiting) + self.running

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.stats.num_steps += 1

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_pending_tokens, budget)
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.block_manager.allocate(seq, n)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n

        # A sequence preempted this step waits for the next one, so that freed blocks
        # go to the sequences already running instead of being re-taken at once.
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = min(seq.num_pending_tokens, budget)
                if not self.block_manager.can_allocate(seq, n):
                    break
                self.waiting.popleft()
                self.block_manager.allocate(seq, n)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues and free its blocks (finished or aborted)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
