"""The draft's KV cache under the target's block tables: scratch blocks past the allocated ones
for the lookahead, counted in the block budget, copied with the target's copy-on-write."""

from __future__ import annotations

import pytest
import torch

from stoker.config import KVCacheSpec
from stoker.layers.attention import Attention
from stoker.spec_decode.draft_cache import DraftKVCache


def _cache(k: int = 3, block_size: int = 4, max_num_seqs: int = 2) -> DraftKVCache:
    layers = [Attention(2, 1, 8, 8**-0.5) for _ in range(2)]
    return DraftKVCache(layers, KVCacheSpec(2, 1, 8, "float32"), block_size, k, max_num_seqs, torch.float32,
                        torch.device("cpu"))


def test_scratch_covers_the_lookahead_past_the_table() -> None:
    cache = _cache(k=5, block_size=4, max_num_seqs=3)  # ceil(5 / 4) = 2 scratch blocks per sequence
    cache.allocate(10)
    assert cache.caches[0][0].shape == (10 + 6, 4, 1, 8)
    assert cache.table_with_scratch([7, 3], 7, 0) == [7, 3]  # position 7 is in block 1: nothing added
    assert cache.table_with_scratch([7, 3], 8, 0) == [7, 3, 10]
    assert cache.table_with_scratch([7, 3], 12, 2) == [7, 3, 14, 15]  # row 2's own scratch
    with pytest.raises(AssertionError):
        cache.table_with_scratch([7], 12, 0)  # more than k past the table: never planned


def test_scratch_bytes_come_out_of_the_block_budget_and_copies_follow() -> None:
    cache = _cache(k=3, block_size=4, max_num_seqs=8)  # 8 scratch blocks of the draft
    assert cache.bytes_per_block == 2 * 2 * 1 * 8 * 4 * 4
    assert cache.reserved_blocks(3 * cache.bytes_per_block) == 3  # ceil(8 / 3) shared blocks
    cache.allocate(4)
    k, v = cache.caches[1]
    k[1].fill_(1.0)
    v[1].fill_(2.0)
    cache.copy_blocks(torch.tensor([1]), torch.tensor([3]))
    assert bool((k[3] == 1).all() and (v[3] == 2).all())
    assert cache.layers[0].k_cache is cache.caches[0][0]
    cache.free()
    assert not cache.is_allocated and cache.layers[0].k_cache.numel() == 0
