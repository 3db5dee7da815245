from stoker.core.block_manager import BlockManager
from stoker.core.sequence import Sequence
from stoker.sampling_params import SamplingParams


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams())


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Admit s as the scheduler would: prefix-cache lookup, allocate, compute everything."""
    cached = bm.find_cached_prefix(s)
    num_new = s.num_tokens - s.num_computed_tokens - len(cached) * bm.block_size
    assert bm.can_allocate(s, num_new, cached)
    bm.allocate(s, num_new, cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return cached


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    admit(bm, s)
    assert bm.get_block_table(s) == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.check_integrity()
    bm.free(s)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_prefix_hit_shares_full_blocks_and_leaves_a_token_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(12))  # three full blocks
    admit(bm, a)
    b = seq(list(range(12)))  # identical prompt: only two blocks may hit (one token must be computed)
    cached = admit(bm, b)
    assert cached == bm.get_block_table(a)[:2]
    assert b.num_cached_tokens == 8
    assert bm.blocks[cached[0]].ref_count == 2
    c = seq(list(range(8)) + [99, 98, 97, 96, 95])  # shares two blocks, then diverges
    assert admit(bm, c) == bm.get_block_table(a)[:2]
    bm.check_integrity()
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free_blocks == 16
    bm.check_integrity()


def test_freed_cached_blocks_are_reused_lru_and_still_hit() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)  # blocks keep their hashes in the free list
    b = seq([1, 2, 3, 4, 9])
    assert admit(bm, b) == [0, 1]  # revived from the free list
    bm.free(b)
    # Now fill the cache with unrelated tokens: the least recently freed blocks go first.
    c = seq([7, 7, 8, 8, 6, 6, 5])
    admit(bm, c)
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 9])) == []  # evicted
    bm.check_integrity()


def test_hash_collision_cannot_splice_foreign_tokens(monkeypatch) -> None:
    import stoker.core.block_manager as mod

    monkeypatch.setattr(mod, "_chain_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3])
    admit(bm, a)
    assert bm.find_cached_prefix(seq([5, 6, 7])) == []  # same hash, other tokens: a miss
    assert bm.find_cached_prefix(seq([1, 2, 3])) == bm.get_block_table(a)[:1]  # the real match still hits


def test_chain_requires_matching_parent() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, seq([1, 2, 3, 4, 0]))
    # Same second block, different first block: the second block must not hit on its own.
    assert bm.find_cached_prefix(seq([9, 9, 3, 4, 0])) == []


def test_can_allocate_counts_revived_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5])  # 3 blocks
    admit(bm, a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 5, 6])
    cached = bm.find_cached_prefix(b)
    assert len(cached) == 2
    # 2 revived + 1 new == 3 free: fits; one more token would need a 4th block.
    assert bm.can_allocate(b, 2, cached)
    assert not bm.can_allocate(b, 4, cached)


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(bm, seq([1, 2, 3, 4, 5]))
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])) == []


def test_integrity_catches_a_leak() -> None:
    import pytest

    bm = BlockManager(num_blocks=4, block_size=2)
    s = seq([1, 2, 3])
    admit(bm, s)
    bm.blocks[bm.get_block_table(s)[0]].ref_count += 1  # simulate a leak
    with pytest.raises(AssertionError):
        bm.check_integrity()
