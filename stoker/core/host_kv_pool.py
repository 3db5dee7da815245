"""The host KV tier's bookkeeping: a pool of host-memory block slots under the prefix cache's hash. [no torch]

vLLM's `--kv-offloading-size GiB` (`--kv-offloading-backend native`): when the device block
manager evicts a registered (hashed) block to reuse it, its K/V are first copied to a host slot;
when a later prompt's prefix walk leaves the device cache, it continues here, and every further
hit is copied back into a fresh device block instead of being recomputed (docs/kv_offloading.md).

Keys are the device cache's own chained hashes (`block_manager._chain_hash` from
`_root_hash`), so a LoRA adapter's or a cache_salt's blocks hash from their own root and are
never shared across them. A hit is verified, not trusted: the slot's tokens, its parent's hash
and its adapter must all equal the walk's, so a false hit needs two different prefixes whose
chained hashes are equal (the device hash map has the same exposure).

Slots are ref-free (a host block is only ever copied, never computed into) and evicted least
recently used. Copies run in the step that plans them, in this order, before the forward
(runner/host_kv_cache.py): saves (device -> host), then loads (host -> device). Within a step a
slot is written or read at most once: every slot a step saves to or loads from is pinned until
the step's result is back (`end_step`), so no eviction can reuse it; a save whose step never
came back (the step raised) is forgotten at the next `begin_step`, since its copy may not have run.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from stoker.core.block_manager import Block, BlockManager, _chain_hash, _root_hash
from stoker.core.sequence import Sequence


def num_host_blocks(kv_offloading_size_gib: float, tensor_parallel_size: int, bytes_per_block: int) -> int:
    """Host slots for `kv_offloading_size_gib` GiB summed over the ranks (vLLM's meaning: with
    TP > 1 the size is the total of all ranks), each rank holding its shard of every block:
    `bytes_per_block` is one rank's. The engine and every runner compute the same number."""
    per_rank = int(kv_offloading_size_gib * (1 << 30)) // tensor_parallel_size
    return per_rank // bytes_per_block


@dataclass
class HostBlock:
    """One occupied slot: a full block's K/V, as the device block it was saved from held it."""

    block_hash: int
    token_ids: tuple[int, ...]
    parent_hash: int | None  # the chain hash of the block before it (its root hash for the first)
    lora_name: str | None
    pending: bool = True  # saved by a step whose result has not come back yet


@dataclass(frozen=True)
class HostKVStats:
    """Counters for /metrics (vLLM's `vllm:kv_offload_*` and `vllm:external_prefix_cache_*`)."""

    num_blocks: int  # slots in the pool
    num_used_blocks: int
    query_tokens: int  # prompt tokens of admissions that asked the tier
    hit_tokens: int  # tokens loaded from it instead of computed
    lookup_blocks: int  # blocks past the device hit looked up
    hit_blocks: int
    saved_blocks: int
    loaded_blocks: int
    saved_bytes: int  # all ranks' shards together
    loaded_bytes: int
    evicted_blocks: int  # host slots reused for a newer block
    skipped_saves: int  # evicted device blocks not saved: every slot pinned by the step

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class HostKVPool:
    def __init__(self, num_blocks: int, block_size: int, bytes_per_block: int) -> None:
        """bytes_per_block: one block's K/V over all ranks (what a save or a load moves)."""
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.free_slots: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes slot 0 first
        self.entries: OrderedDict[int, HostBlock] = OrderedDict()  # slot -> block, least recently used first
        self.hash_to_slot: dict[int, int] = {}
        self._pinned: set[int] = set()  # slots this step saves to or loads from
        self._saves: list[tuple[int, int]] = []  # (device block, host slot) planned this step
        self._counts = dict.fromkeys(("query_tokens", "hit_tokens", "lookup_blocks", "hit_blocks", "saved_blocks",
                                      "loaded_blocks", "evicted_blocks", "skipped_saves"), 0)

    # ------------------------------------------------------------------ step lifecycle
    def begin_step(self) -> None:
        """Before planning: forget saves of a step that never came back (their copy may not have run)."""
        for slot in [s for s, e in self.entries.items() if e.pending]:
            self._drop(slot)
        self._pinned.clear()
        self._saves.clear()

    def end_step(self) -> None:
        """The step's copies ran: its saved blocks may now be loaded by any later step."""
        for slot in self._pinned:
            entry = self.entries.get(slot)
            if entry is not None:
                entry.pending = False
        self._pinned.clear()

    def take_saves(self) -> list[tuple[int, int]]:
        """The (device block, host slot) saves planned since begin_step, for the step message."""
        saves, self._saves = self._saves, []
        return saves

    # ------------------------------------------------------------------ save side
    def offer(self, block: Block) -> None:
        """The device block manager is about to reuse `block` (registered, its K/V computed): keep
        a copy unless the pool already holds it. The copy is planned, and runs first in this step."""
        assert block.block_hash is not None
        slot = self.hash_to_slot.get(block.block_hash)
        if slot is not None:
            if self._matches(self.entries[slot], block.token_ids, block.parent_hash, block.lora_name):
                self.entries.move_to_end(slot)  # already held: now recently used
            return  # or a hash collision: keep the older block, skip this one
        slot = self._free_slot()
        if slot is None:
            self._counts["skipped_saves"] += 1
            return
        self.entries[slot] = HostBlock(block.block_hash, block.token_ids, block.parent_hash, block.lora_name)
        self.hash_to_slot[block.block_hash] = slot
        self._pinned.add(slot)
        self._saves.append((block.block_id, slot))
        self._counts["saved_blocks"] += 1

    # ------------------------------------------------------------------ load side
    def find(self, seq: Sequence, cached: list[int], bm: BlockManager) -> list[int]:
        """Host slots continuing seq's prefix past its device hit `cached`, in order (no state
        changes). At least one token is always left to compute, as find_cached_prefix leaves it."""
        if seq.num_computed_tokens:  # a waiting sequence holds no K/V; the walk starts at block 0
            return []
        bs = self.block_size
        parent_hash = bm.blocks[cached[-1]].block_hash if cached else _root_hash(seq)
        slots: list[int] = []
        for i in range(len(cached), (seq.num_tokens - 1) // bs):
            tokens = tuple(seq.tokens_slice(i * bs, (i + 1) * bs))
            h = _chain_hash(parent_hash, tokens)
            slot = self.hash_to_slot.get(h)
            if slot is None or not self._matches(self.entries[slot], tokens, parent_hash, seq.lora_name):
                break
            slots.append(slot)
            parent_hash = h
        return slots

    def admit(self, seq: Sequence, num_new_tokens: int, cached: list[int], slots: list[int], bm: BlockManager,
              loads: list[tuple[int, int]]) -> None:
        """Allocate seq's blocks (the scheduler checked `can_allocate` for the loaded blocks too),
        plan a (host slot, device block) load for each host hit into `loads`, and count them as
        computed. The loaded blocks are hashed into the device cache once the step has run
        (`cache_full_blocks`), so a step that fails never leaves a block registered unloaded."""
        self._pinned.update(slots)  # before allocate: its evictions must not reuse a slot to load
        num_loaded = len(slots) * self.block_size
        bm.allocate(seq, num_loaded + num_new_tokens, cached)
        table = bm.get_block_table(seq)
        first = seq.num_computed_tokens // self.block_size  # the block after the device hit
        for i, slot in enumerate(slots):
            loads.append((slot, table[first + i]))
            self.entries.move_to_end(slot)
        seq.num_computed_tokens += num_loaded
        if slots:  # the device hit's tokens (allocate set them) and the host hit's
            seq.num_cached_tokens = len(cached) * self.block_size + num_loaded
        c = self._counts
        c["query_tokens"] += seq.num_tokens
        c["hit_tokens"] += num_loaded
        c["lookup_blocks"] += max((seq.num_tokens - 1) // self.block_size - len(cached), 0)
        c["hit_blocks"] += len(slots)
        c["loaded_blocks"] += len(slots)

    # ------------------------------------------------------------------ whole pool
    def reset(self) -> None:
        """Forget every block no step is copying (reset_prefix_cache forgets both tiers)."""
        for slot in [s for s in self.entries if s not in self._pinned]:
            self._drop(slot)

    def stats(self) -> HostKVStats:
        c = self._counts
        return HostKVStats(self.num_blocks, len(self.entries), c["query_tokens"], c["hit_tokens"], c["lookup_blocks"],
                           c["hit_blocks"], c["saved_blocks"], c["loaded_blocks"],
                           c["saved_blocks"] * self.bytes_per_block, c["loaded_blocks"] * self.bytes_per_block,
                           c["evicted_blocks"], c["skipped_saves"])

    def check_integrity(self) -> None:
        """Raise AssertionError unless slots, the free list and the hash map agree."""
        assert not set(self.free_slots) & set(self.entries), "a slot is both free and occupied"
        assert len(self.free_slots) + len(self.entries) == self.num_blocks, "a host slot is lost"
        assert len(set(self.free_slots)) == len(self.free_slots), "a free slot is listed twice"
        assert {self.hash_to_slot[e.block_hash] for e in self.entries.values()} == set(self.entries)
        assert len(self.hash_to_slot) == len(self.entries), "a stale hash-map entry"
        assert self._pinned >= {slot for _, slot in self._saves}, "a planned save's slot is not pinned"

    @property
    def is_idle(self) -> bool:
        """Between two steps that both came back: nothing pinned, planned or unconfirmed."""
        return not self._pinned and not self._saves and not any(e.pending for e in self.entries.values())

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _matches(entry: HostBlock, token_ids: tuple[int, ...], parent_hash: int | None, lora_name: str | None) -> bool:
        return entry.token_ids == token_ids and entry.parent_hash == parent_hash and entry.lora_name == lora_name

    def _free_slot(self) -> int | None:
        """A free slot, else the least recently used one no step is copying (evicted)."""
        if self.free_slots:
            return self.free_slots.pop()
        victim = next((s for s in self.entries if s not in self._pinned), None)
        if victim is not None:
            self._drop(victim)
            self._counts["evicted_blocks"] += 1
            return self.free_slots.pop()
        return None

    def _drop(self, slot: int) -> None:
        entry = self.entries.pop(slot)
        if self.hash_to_slot.get(entry.block_hash) == slot:
            del self.hash_to_slot[entry.block_hash]
        self.free_slots.append(slot)


def make_host_kv_pool(kv_offloading_size_gib: float | None, tensor_parallel_size: int, block_size: int,
                      bytes_per_block: int) -> HostKVPool | None:
    """The engine's pool for `--kv-offloading-size` (None when off), sized as every runner sizes
    its storage; refused when the size holds not one block. bytes_per_block: one rank's."""
    if kv_offloading_size_gib is None:
        return None
    num_blocks = num_host_blocks(kv_offloading_size_gib, tensor_parallel_size, bytes_per_block)
    if num_blocks < 1:
        raise ValueError(f"kv_offloading_size {kv_offloading_size_gib:g} GiB holds no KV block: one block is "
                         f"{bytes_per_block * tensor_parallel_size} bytes ({bytes_per_block} per rank x "
                         f"{tensor_parallel_size} ranks); raise --kv-offloading-size")
    return HostKVPool(num_blocks, block_size, bytes_per_block * tensor_parallel_size)
