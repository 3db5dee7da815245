"""The draft's KV cache: a second set of per-layer caches under the target's block tables.

Block b of the draft cache belongs to whichever sequence holds block b of the target cache, so the
block manager needs no second pool, a prefix-cache hit brings the draft's K/V with the target's,
and rolling back rejected drafts costs nothing (their positions are written again before they
are read). The draft computes every position the target computes, in the same step.

The draft also looks ahead: its k-1 proposal steps write positions past the ones the scheduler
allocated (up to k past the step's last), which a block table may not cover yet. Those land in
scratch blocks kept after the shared ones, ceil(k / block_size) per proposing sequence; what
they hold is never read after the step. Their bytes are counted in the KV budget
(`reserved_blocks`), so the cache size reported is what is held.
"""

from __future__ import annotations

import torch

from stoker.config import KVCacheSpec
from stoker.layers.attention import Attention


class DraftKVCache:
    def __init__(self, layers: list[Attention], spec: KVCacheSpec, block_size: int, num_speculative_tokens: int,
                 max_num_seqs: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers = layers
        self.spec = spec
        self.block_size = block_size
        self.dtype, self.device = dtype, device
        self.scratch_per_seq = -(-num_speculative_tokens // block_size)
        self.num_scratch = max_num_seqs * self.scratch_per_seq
        self.num_blocks = 0  # shared blocks; 0 until allocate
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for attn in layers:  # the draft cache stays in the draft's dtype (no FP8 scales to apply)
            attn.k_scale = attn.v_scale = 1.0

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_token * self.block_size

    def reserved_blocks(self, bytes_per_block: int) -> int:
        """Shared blocks (of `bytes_per_block`, target and draft together) the scratch costs."""
        return -(-self.num_scratch * self.bytes_per_block // bytes_per_block)

    @property
    def is_allocated(self) -> bool:
        return bool(self.caches)

    def allocate(self, num_blocks: int) -> None:
        shape = (num_blocks + self.num_scratch, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.num_blocks = num_blocks
        self.caches = []
        for attn in self.layers:
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.k_cache, attn.v_cache = k, v
            self.caches.append((k, v))

    def free(self) -> None:
        """Drop the cache (after the memory profile's scratch forward)."""
        self.caches = []
        for attn in self.layers:
            attn.k_cache = attn.v_cache = torch.empty(0)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The target's copy-on-write pairs, applied to the draft's cache too."""
        for k, v in self.caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def table_with_scratch(self, block_table: list[int], last_pos: int, row: int) -> list[int]:
        """`block_table` extended to cover position `last_pos` with proposing row `row`'s scratch."""
        needed = last_pos // self.block_size + 1 - len(block_table)
        if needed <= 0:
            return block_table
        assert needed <= self.scratch_per_seq and row * self.scratch_per_seq < self.num_scratch, (needed, row)
        first = self.num_blocks + row * self.scratch_per_seq
        return block_table + list(range(first, first + needed))
