"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, a free list, prefix caching. [no torch]

Each sequence owns a `block_table` (list of physical block ids); token i of a sequence lives
in block `block_table[i // block_size]` at offset `i % block_size`.

Prefix caching: when a block fills, it is registered under a chained hash of
(parent block's hash, its token ids). A new sequence walks its prompt block by block and
reuses every registered block whose hash, token ids *and* parent block match, so a hash
collision can never splice foreign K/V into a sequence. Blocks whose ref count drops to
zero go to the tail of the free list but keep their hash; allocation takes from the head,
so cached blocks are evicted least-recently-freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from stoker.core.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the full block's tokens, kept to verify a hash hit
    parent_block_id: int = -1  # physical id of the previous block in the chain (-1: first)
    lora_name: str | None = None  # the adapter whose K/V it holds: blocks are never shared across adapters
    parent_hash: int | None = None  # the chain hash it was hashed from: the host KV tier verifies it on a hit


def _chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def _root_hash(seq: Sequence) -> int | None:
    """The chain's start: the same text under another LoRA adapter has other K/V, so each
    adapter (and the base model, None) hashes its blocks from its own root; a request's
    cache_salt (vLLM's, one per tenant) does the same, so a tenant can never hit, and so time,
    another tenant's cached prompt."""
    if seq.lora_name is None and seq.cache_salt is None:
        return None
    return hash(("lora", seq.lora_name, "salt", seq.cache_salt))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.block_tables: dict[int, list[int]] = {}
        # Per sequence: how many of its leading blocks are registered in the prefix cache.
        self._num_hashed_blocks: dict[int, int] = {}
        # Prefix-cache counters (queries and hits in tokens), read by metrics.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Host KV tier (core/host_kv_pool.py): told of each registered block just before it is reused
        self.on_evict: Callable[[Block], None] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Share of blocks held by live sequences (0-1), as vllm:kv_cache_usage_perc."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Physical ids of the longest run of cached full blocks matching seq's tokens.

        At least one token is always left to compute, so the sequence gets logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        parent_hash = _root_hash(seq)
        parent_id = -1
        for i in range(max_blocks):
            tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
            h = _chain_hash(parent_hash, tokens)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_block_id != parent_id or block.lora_name != seq.lora_name:
                break  # a hash collision: treat as a miss
            hit.append(block_id)
            parent_hash, parent_id = h, block_id
        return hit

    def held_table_if_room(self, seq: Sequence, num_new_tokens: int) -> list[int] | None:
        """seq's block table when the blocks it holds have room for `num_new_tokens` more tokens
        (then `can_allocate` is true and `allocate` takes nothing: most decode steps), else None.
        The scheduler's shortcut for a running sequence: one call instead of three."""
        table = self.block_tables.get(seq.seq_id)
        if table is not None and seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return table
        return None

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] | None = None) -> bool:
        """Whether `num_new_tokens` more tokens of seq fit, after reusing `cached_block_ids`."""
        if not cached_block_ids:  # the common case (every running sequence, every step): no hit to revive
            table = self.block_tables.get(seq.seq_id)
            num_held = len(table) if table is not None else 0
            return -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - num_held <= len(self.free_block_ids)
        table = self.get_block_table(seq)
        num_computed = seq.num_computed_tokens + len(cached_block_ids) * self.block_size
        num_needed = self.num_blocks_needed(num_computed + num_new_tokens) - len(table) - len(cached_block_ids)
        # Cached blocks that nobody holds sit in the free list: taking them uses up free slots too.
        num_revived = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        return max(num_needed, 0) + num_revived <= self.num_free_blocks

    # ------------------------------------------------------------------ commits
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] | None = None) -> None:
        """Give seq the blocks for `num_new_tokens` more tokens; take `cached_block_ids` as its prefix.

        Caller checked `can_allocate`. Cached blocks advance `seq.num_computed_tokens`.
        """
        table = self.block_tables.setdefault(seq.seq_id, [])
        if cached_block_ids:
            assert not table, "a prefix-cache hit is only taken by a sequence with no blocks"
            for block_id in cached_block_ids:
                self._take(block_id)
                table.append(block_id)
            num_hit = len(cached_block_ids) * self.block_size
            seq.num_computed_tokens += num_hit
            seq.num_cached_tokens = num_hit
            self._num_hashed_blocks[seq.seq_id] = len(cached_block_ids)
        num_needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        for _ in range(num_needed):
            block_id, _ = self.free_block_ids.popitem(last=False)
            if self.on_evict is not None and self.blocks[block_id].block_hash is not None:
                self.on_evict(self.blocks[block_id])  # the host tier saves it before this step overwrites it
            self._evict_hash(block_id)
            self._take(block_id)
            table.append(block_id)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of seq that became full since the last call (after a step)."""
        if not self.enable_prefix_caching:
            return
        start = self._num_hashed_blocks.get(seq.seq_id)
        if start is not None and seq.num_computed_tokens // self.block_size <= start:
            return  # no block filled since the last call (most decode steps): nothing below would change
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        start = self._num_hashed_blocks.get(seq.seq_id, 0)
        if num_full <= start:  # no block filled since the last call: most decode steps
            self._num_hashed_blocks[seq.seq_id] = start
            return
        parent_hash = self.blocks[table[start - 1]].block_hash if start > 0 else _root_hash(seq)
        parent_id = table[start - 1] if start > 0 else -1
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            tokens = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
            h = _chain_hash(parent_hash, tokens)
            if block.block_hash is None:
                block.block_hash, block.token_ids, block.parent_block_id = h, tokens, parent_id
                block.lora_name = seq.lora_name
                block.parent_hash = parent_hash
                # First writer wins; a duplicate computed concurrently simply stays unregistered.
                self.hash_to_block_id.setdefault(h, block.block_id)
            parent_hash, parent_id = h, block.block_id
        self._num_hashed_blocks[seq.seq_id] = max(start, num_full)

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks. Tail blocks are freed first so that shared prefixes,
        freed last, are evicted last."""
        table = self.block_tables.pop(seq.seq_id, [])
        self._num_hashed_blocks.pop(seq.seq_id, None)
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None

    def free_tail(self, seq: Sequence) -> None:
        """Release seq's blocks past its computed tokens (reserved for draft tokens that were
        rejected). They hold no computed token, so none of them is registered in the cache."""
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        keep = self.num_blocks_needed(seq.num_computed_tokens)
        while len(table) > keep:
            block_id = table.pop()
            block = self.blocks[block_id]
            # Taken fresh from the free list for drafts: this sequence's alone, and never hashed.
            assert block.ref_count == 1 and block.block_hash is None, f"block {block_id} is shared or hashed"
            block.ref_count = 0
            self.free_block_ids[block_id] = None

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_block_ids:
            self._evict_hash(block_id)

    # ------------------------------------------------------------------ internals
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_block_ids.pop(block_id, None)
        block.ref_count += 1

    def _evict_hash(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids, block.parent_block_id = None, (), -1

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Raise AssertionError unless ref counts, the free list and the hash map agree."""
        counts = [0] * self.num_blocks
        for seq_id, table in self.block_tables.items():
            assert len(set(table)) == len(table), f"seq {seq_id} holds a block twice: {table}"
            for block_id in table:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} but held by {counts[block.block_id]} tables"
            )
            is_free = block.block_id in self.free_block_ids
            assert is_free == (block.ref_count == 0), f"block {block.block_id}: free={is_free}, ref={block.ref_count}"
        for h, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].block_hash == h, f"hash map entry for block {block_id} is stale"
        assert len(self.free_block_ids) + sum(1 for c in counts if c > 0) == self.num_blocks
