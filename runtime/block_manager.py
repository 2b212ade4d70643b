"""KV-cache blocks: who owns which block, and a prefix cache over full blocks.

Every block except the null block is in exactly one state:
  free    ref count 0, holds nothing worth keeping      (on `free_blocks`)
  cached  ref count 0, holds a full block of K/V that a later prompt may reuse
          (on `evictable`, least recently used first; still in the hash table)
  owned   ref count > 0: in the block table of that many live sequences.
Allocation takes free blocks first and only then evicts the least recently used cached
block, so cached prefixes live until their space is needed.

A full block is identified by a hash chain: block i's hash covers its own tokens and the
hash of block i-1, hence every token before it. Two prompts share block i only if they
agree on all tokens up to the end of block i. Only full blocks whose K/V have been
computed are entered in the cache (`commit`), and only full blocks are ever shared, so
no block is written while another sequence reads it and no copy-on-write is needed.

Block 0 is the null block: padded tokens write there and no sequence ever owns it.

A model with recurrent layers (gated DeltaNet, Mamba2) also keeps states per sequence, not per token:
with `num_state_slots`, each admitted sequence takes a state slot (a row of every state cache)
until it is freed. Slot 0 is the null slot padded rows write. Such states cannot be rebuilt
from blocks, so those engines run without prefix caching.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from kiln.runtime.sequence import Sequence

NULL_BLOCK = 0


class BlockInvariantError(AssertionError):
    """The block manager's bookkeeping is inconsistent (a bug, never bad user input)."""


@dataclass
class PrefixCacheStats:
    """Tokens looked up in the prefix cache when sequences are admitted, and how many were found.

    Every admission counts: a preempted sequence that comes back is looked up again (prompt
    plus the tokens it had generated), and so is each of a request's n completions.
    """

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """Hash of one full block chained to its predecessor's hash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> the block holding it
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unowned; LRU first
        self.prefix_stats = PrefixCacheStats()
        self.num_evictions = 0
        if num_state_slots and enable_prefix_caching:
            raise ValueError("prefix caching cannot serve a model with recurrent states (they are not kept per block)")
        self.num_state_slots = num_state_slots
        self.free_state_slots: deque[int] = deque(range(1, num_state_slots))

    # ---- counts (also exported as server metrics) -------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing."""
        return len(self.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Unowned blocks kept for prefix reuse (evicted when space is needed)."""
        return len(self.evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take: free plus evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by live sequences ("KV blocks in use")."""
        return self.num_usable_blocks - self.num_available_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    # ---- hashing and lookup ------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """`seq.block_hashes`, extended to cover its first `num_full_blocks` full blocks."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.all_token_ids
        for i in range(len(hashes), num_full_blocks):
            hashes.append(hash_block(hashes[i - 1] if i else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s leading tokens (nothing is taken yet).

        At most (num_tokens - 1) tokens are matched: the last token must be computed so that
        there are logits to sample from, even when the whole prompt is cached.
        """
        # A request that wants prompt logprobs needs the logits of every prompt position:
        # its prompt is computed, never taken from the cache.
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        matched = []
        for h in self._block_hashes(seq, max_blocks):
            block = self.cached.get(h)
            if block is None:
                break
            matched.append(block)
        return matched

    # ---- allocation ----------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_available_blocks

    def can_admit(self, seq: Sequence, shared: list[int], num_new_tokens: int) -> bool:
        """Whether `seq` (holding no blocks) fits with `shared` blocks plus `num_new_tokens`."""
        return self.blocks_to_admit(shared, num_new_tokens) <= self.room_after(shared)

    def blocks_to_admit(self, shared: list[int], num_new_tokens: int) -> int:
        """Blocks a waiting sequence takes beyond `shared` to hold `num_new_tokens` after them."""
        return -(-(len(shared) * self.block_size + num_new_tokens) // self.block_size) - len(shared)

    def room_after(self, shared: list[int]) -> int:
        """Blocks a waiting sequence can take beyond `shared`: the available ones, less the
        shared blocks that are cached but unowned (they stop being available once taken)."""
        return self.num_available_blocks - sum(1 for b in shared if self.ref_counts[b] == 0)

    def admit(self, seq: Sequence, shared: list[int], num_new_tokens: int, from_cache: bool) -> None:
        """Give a waiting `seq` the `shared` blocks (its leading full blocks, already computed:
        prefix-cache hits or a sibling's prompt) and room for `num_new_tokens` after them.
        `from_cache` counts the lookup in the prefix-cache statistics."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} is admitted while still holding blocks")
        for block in shared:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        if self.num_state_slots:
            if shared:
                raise RuntimeError(f"sequence {seq.seq_id} would share blocks, but its recurrent states start empty")
            if not self.free_state_slots:
                raise RuntimeError(f"no recurrent-state slot left for sequence {seq.seq_id} "
                                   f"({self.num_state_slots - 1} slots: one per max_num_seqs)")
            seq.state_slot = self.free_state_slots.popleft()
        seq.block_table = list(shared)
        seq.num_computed_tokens = len(shared) * self.block_size
        seq.num_committed_blocks = len(shared)
        if from_cache and self.enable_prefix_caching:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_stats.queries += seq.num_tokens
            self.prefix_stats.hits += seq.num_cached_tokens
        self.allocate(seq, num_new_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_new_tokens` more tokens."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_available_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, have {self.num_available_blocks}")
        for _ in range(need):
            block = self._take_block()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def _take_block(self) -> int:
        if self.free_blocks:
            return self.free_blocks.popleft()
        block, _ = self.evictable.popitem(last=False)
        self._uncache(block)
        self.num_evictions += 1
        return block

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = None

    def commit(self, seq: Sequence) -> None:
        """Enter `seq`'s newly computed full blocks in the prefix cache (after a step)."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if not self.enable_prefix_caching or num_full <= seq.num_committed_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_committed_blocks, num_full):
            block, h = seq.block_table[i], hashes[i]
            # A block already cached (a hit) keeps its entry; if another block already holds
            # this content (two prompts computed it at once), the first one stays the cached
            # copy and this one is freed normally.
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
        seq.num_committed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks; the ones in the prefix cache stay there as evictable."""
        # Last block first: it becomes the least recently used, so a prompt's tail is
        # evicted before its head (the head is the part other prompts share).
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        if seq.state_slot:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody owns; returns how many were dropped."""
        dropped = list(self.evictable)
        self.evictable.clear()
        for block in dropped:
            self._uncache(block)
            self.free_blocks.append(block)
        return len(dropped)

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- checking ----------------------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is exactly one of free, cached or owned, and the counts add up.

        `live` is every sequence not yet finished. Raises BlockInvariantError on violation.
        """
        def fail(why: str) -> None:
            raise BlockInvariantError(why)

        owners = [0] * self.num_blocks
        for seq in live:
            for b in seq.block_table:
                owners[b] += 1
            needed = -(-seq.num_computed_tokens // self.block_size)
            if len(seq.block_table) < needed:
                fail(f"sequence {seq.seq_id} computed {seq.num_computed_tokens} tokens "
                     f"in {len(seq.block_table)} blocks")
            if len(set(seq.block_table)) != len(seq.block_table):
                fail(f"sequence {seq.seq_id} holds a block twice: {seq.block_table}")
        free = set(self.free_blocks)
        if len(free) != len(self.free_blocks):
            fail("a block is on the free list twice")
        if NULL_BLOCK in free or NULL_BLOCK in self.evictable or owners[NULL_BLOCK] or self.ref_counts[NULL_BLOCK]:
            fail("the null block was handed out")
        num_free = num_cached = num_owned = 0
        for b in range(1, self.num_blocks):
            states = [b in free, b in self.evictable, owners[b] > 0]
            if sum(states) != 1:
                fail(f"block {b} is in {sum(states)} states (free, cached, owned) = {states}")
            if owners[b] != self.ref_counts[b]:
                fail(f"block {b}: {owners[b]} owners but ref count {self.ref_counts[b]}")
            h = self.block_hash[b]
            if b in free and h is not None:
                fail(f"free block {b} still has a hash")
            if b in self.evictable and h is None:
                fail(f"cached block {b} has no hash")
            if h is not None and self.cached.get(h) != b:
                fail(f"block {b}'s hash is not mapped to it")
            num_free += states[0]
            num_cached += states[1]
            num_owned += states[2]
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                fail(f"hash table maps to block {b}, which holds other content")
        if num_free + num_cached + num_owned != self.num_usable_blocks:
            fail(f"free {num_free} + cached {num_cached} + owned {num_owned} != {self.num_usable_blocks} blocks")
        if num_owned != self.num_used_blocks:
            fail(f"{num_owned} owned blocks but num_used_blocks says {self.num_used_blocks}")
        if not self.enable_prefix_caching and (self.cached or self.evictable):
            fail("prefix caching is off but blocks are cached")
        if self.num_state_slots:
            held = [seq.state_slot for seq in live if seq.block_table or seq.state_slot]
            if 0 in held or len(set(held)) != len(held):
                fail(f"recurrent-state slots held twice or the null slot held: {sorted(held)}")
            if set(held) & set(self.free_state_slots) or len(held) + len(self.free_state_slots) != self.num_state_slots - 1:
                fail(f"state slots: {len(held)} held + {len(self.free_state_slots)} free != {self.num_state_slots - 1}")
