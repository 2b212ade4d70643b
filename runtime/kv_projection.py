"""The KV blocks the running sequences will take over the coming steps: the scheduler's
admission test (runtime/scheduler.py, "admission's reservation").

Each sequence is a growth profile (`BlockProfile`): it holds `tokens` now and adds at most one
token a step, `growth` more in all; a sequence whose end is known (`ends_after`: it holds its
blocks for at most that many more steps) then gives back the blocks no other sequence shares.
Admission used to reserve every running sequence's final size at once, as
if none would end before the newest; but sequences end at different steps, and the blocks of
the first to end go to those still growing. The peak over the coming steps of what all of
them hold is what must fit, and it is smaller when their ends are staggered: 1,000 requests of
known lengths 64-448 (bench/simulate_scheduler.py, max_tokens_64_448) run ~15% more sequences
at once. (bench/throughput.py's 1,000 requests of 256 tokens each gain nothing: admitted in
waves that end together, each wave's peak is its final size.)

Between two ends every profile only grows, so the peak is at one of the steps just before a
sequence ends, or once every known end has passed and the rest have reached their final
sizes (`FOREVER`): the projection is evaluated at those steps only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The step standing for "after every known end": each profile at its final size.
FOREVER = 1 << 40


@dataclass(frozen=True)
class BlockProfile:
    """One sequence's KV footprint over the coming steps, in tokens and blocks."""
    tokens: int  # tokens it holds (or will hold: the rest of its prompt, its in-flight token) now
    growth: int  # tokens it may still add, at most one a step
    table_blocks: int  # blocks its block table has now (the footprint is counted beyond them)
    ends_after: int | None = None  # steps after which it has certainly ended; None: not known
    freed_blocks: int = 0  # blocks of its table it frees when it ends (those no one else holds)


class KVProjection:
    """The blocks a set of profiles takes beyond their tables, at each step where the peak can be."""

    def __init__(self, profiles: list[BlockProfile], block_size: int):
        self.block_size = block_size
        ends = sorted({p.ends_after for p in profiles if p.ends_after is not None})
        self.steps = np.array(ends + [FOREVER], dtype=np.int64)
        self.extra = np.zeros(len(self.steps), dtype=np.int64)
        if profiles:
            self.extra += self._blocks(profiles).sum(axis=0)

    def _blocks(self, profiles: list[BlockProfile]) -> np.ndarray:
        """[profiles, steps]: each profile's blocks beyond its table at each step (after its
        end, minus the blocks it frees)."""
        tokens = np.array([p.tokens for p in profiles], dtype=np.int64)[:, None]
        growth = np.array([p.growth for p in profiles], dtype=np.int64)[:, None]
        table = np.array([p.table_blocks for p in profiles], dtype=np.int64)[:, None]
        ends = np.array([FOREVER if p.ends_after is None else p.ends_after for p in profiles], dtype=np.int64)[:, None]
        freed = np.array([p.freed_blocks for p in profiles], dtype=np.int64)[:, None]
        held = tokens + np.minimum(self.steps[None, :], growth)
        extra = np.maximum(0, -(-held // self.block_size) - table)
        return np.where(self.steps[None, :] <= ends, extra, -freed)

    def add(self, profile: BlockProfile) -> None:
        """Count one more sequence (one just admitted)."""
        self.extra += self._blocks([profile])[0]

    def peak(self, candidate: BlockProfile | None = None) -> int:
        """The most blocks, beyond their tables, the profiles (and `candidate`) take at once."""
        total = self.extra if candidate is None else self.extra + self._blocks([candidate])[0]
        return int(total.max())
