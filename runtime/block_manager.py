"""KV-cache blocks: a free list and each sequence's block table.

Block 0 is the null block: padded tokens write there and no sequence ever owns it, so the
runner never needs a branch for padding.
"""

from __future__ import annotations

from collections import deque

from kiln.runtime.sequence import Sequence

NULL_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_new_tokens` more tokens."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {need}, have {len(self.free_blocks)}")
        for _ in range(need):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is free or owned; reference counts equal the owners. Raises on violation."""
        owners = [0] * self.num_blocks
        for seq in live:
            for b in seq.block_table:
                owners[b] += 1
        free = set(self.free_blocks)
        if len(free) != len(self.free_blocks):
            raise AssertionError("a block is on the free list twice")
        if NULL_BLOCK in free or owners[NULL_BLOCK]:
            raise AssertionError("the null block was handed out")
        for b in range(1, self.num_blocks):
            if owners[b] != self.ref_counts[b]:
                raise AssertionError(f"block {b}: {owners[b]} owners but ref count {self.ref_counts[b]}")
            if (b in free) == (owners[b] > 0):
                raise AssertionError(f"block {b} is {'free and owned' if b in free else 'neither free nor owned'}")
