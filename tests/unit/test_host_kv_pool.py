"""The host KV tier's bookkeeping (core/host_kv_pool.py): LRU over host slots, chain verification,
collisions, pinning within a step, and the whole save/load protocol against a simulated cache."""

from __future__ import annotations

import random

import pytest

from stoker.core.block_manager import Block, BlockManager, _chain_hash, _root_hash
from stoker.core.host_kv_pool import HostKVPool, make_host_kv_pool, num_host_blocks
from stoker.core.scheduler import Scheduler
from stoker.core.sequence import Sequence, SequenceStatus
from stoker.core.step import SampledTokens, StepResult, build_step
from stoker.sampling_params import SamplingParams

BS = 4


def block(block_id: int, tokens: tuple[int, ...], parent_hash: int | None = None, lora: str | None = None) -> Block:
    """A registered device block as cache_full_blocks leaves it."""
    return Block(block_id, 0, _chain_hash(parent_hash, tokens), tokens, -1, lora, parent_hash)


def chain(tokens: list[int], lora: str | None = None, salt: str | None = None) -> list[Block]:
    """The registered blocks of one prompt's full blocks, ids 0, 1, ..."""
    parent = _root_hash(Sequence("x", [0], SamplingParams(), lora_name=lora, cache_salt=salt))
    out = []
    for i in range(len(tokens) // BS):
        b = block(i, tuple(tokens[i * BS:(i + 1) * BS]), parent, lora)
        out.append(b)
        parent = b.block_hash
    return out


def seq(tokens: list[int], lora: str | None = None, salt: str | None = None) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(max_tokens=4), lora_name=lora, cache_salt=salt)


def saved(pool: HostKVPool, blocks: list[Block]) -> None:
    """Offer blocks as evictions in one step that then comes back."""
    pool.begin_step()
    for b in blocks:
        pool.offer(b)
    pool.take_saves()
    pool.end_step()


def test_size_in_gib_is_summed_over_the_ranks() -> None:
    assert num_host_blocks(1.0, 1, 1 << 20) == 1024
    assert num_host_blocks(1.0, 2, 1 << 20) == 512  # each rank holds half the GiB, a shard of every block
    assert make_host_kv_pool(None, 1, 16, 1024) is None
    with pytest.raises(ValueError, match="holds no KV block.*raise --kv-offloading-size"):
        make_host_kv_pool(1e-9, 1, 16, 1 << 20)
    pool = make_host_kv_pool(1.0, 2, 16, 1 << 20)
    assert pool.num_blocks == 512 and pool.bytes_per_block == 2 << 20


def test_a_saved_chain_is_found_in_order_and_only_with_its_tokens() -> None:
    tokens = list(range(100, 113))  # 3 full blocks and one token
    pool = HostKVPool(8, BS, 64)
    bm = BlockManager(8, BS)
    blocks = chain(tokens)
    pool.begin_step()
    for b in blocks:
        pool.offer(b)
    saves = pool.take_saves()
    assert [d for d, _ in saves] == [0, 1, 2] and len({s for _, s in saves}) == 3
    # found within the saving step too: the runner runs a step's saves before its loads
    assert pool.find(seq(tokens), [], bm) == [s for _, s in saves]
    pool.end_step()
    slots = [s for _, s in saves]
    assert pool.find(seq(tokens), [], bm) == slots
    assert pool.find(seq(tokens[:9]), [], bm) == slots[:2]  # one token is always left to compute
    changed = tokens[:5] + [999] + tokens[6:]
    assert pool.find(seq(changed), [], bm) == slots[:1]  # the chain breaks at the changed block
    assert pool.find(seq(tokens, lora="a"), [], bm) == []  # another adapter hashes from its own root
    assert pool.find(seq(tokens, salt="tenant"), [], bm) == []  # and so does another cache_salt
    pool.check_integrity()
    assert pool.is_idle


def test_a_hit_continues_from_the_device_prefix() -> None:
    tokens = list(range(200, 213))
    bm = BlockManager(8, BS)
    s = seq(tokens)
    bm.allocate(s, len(tokens))
    s.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(s)
    device = bm.get_block_table(s)
    bm.free(s)
    pool = HostKVPool(8, BS, 64)
    saved(pool, [bm.blocks[b] for b in device[1:3]])  # blocks 1 and 2 in host memory, block 0 on the device
    t = seq(tokens)
    cached = bm.find_cached_prefix(t)
    assert len(cached) == 3
    assert pool.find(t, cached[:1], bm) == [pool.hash_to_slot[bm.blocks[device[1]].block_hash],
                                            pool.hash_to_slot[bm.blocks[device[2]].block_hash]]


def test_collisions_are_misses_never_foreign_kv() -> None:
    """A slot found under the walk's hash whose tokens, parent or adapter differ is a miss."""
    pool = HostKVPool(4, BS, 64)
    bm = BlockManager(4, BS)
    tokens = (1, 2, 3, 4)
    real = block(0, tokens)
    saved(pool, [real])
    slot = pool.hash_to_slot[real.block_hash]
    for forged in ((9, 9, 9, 9), None):
        entry = pool.entries[slot]
        entry.token_ids, entry.parent_hash = (forged, None) if forged else (tokens, 12345)
        assert pool.find(seq([*tokens, 5]), [], bm) == []
        entry.token_ids, entry.parent_hash = tokens, None
    pool.entries[slot].lora_name = "other"
    assert pool.find(seq([*tokens, 5]), [], bm) == []
    # A second block under the same hash with other contents is not saved over the first.
    impostor = Block(1, 0, real.block_hash, (7, 7, 7, 7), -1, None, None)
    pool.entries[slot].lora_name = None
    saved(pool, [impostor])
    assert pool.entries[slot].token_ids == tokens and len(pool.entries) == 1
    pool.check_integrity()


def test_lru_evicts_the_least_recently_used_and_a_hit_refreshes() -> None:
    pool = HostKVPool(2, BS, 64)
    bm = BlockManager(4, BS)
    a, b, c = block(0, (1, 1, 1, 1)), block(1, (2, 2, 2, 2)), block(2, (3, 3, 3, 3))
    saved(pool, [a, b])
    # a hit on a makes b the least recently used
    s = seq([1, 1, 1, 1, 0])
    pool.begin_step()
    slots = pool.find(s, [], bm)
    pool.admit(s, 1, [], slots, bm, [])
    pool.end_step()
    bm.free(s)
    saved(pool, [c])
    assert set(pool.hash_to_slot) == {a.block_hash, c.block_hash}
    assert pool.stats().evicted_blocks == 1
    # offering a block the pool holds refreshes it without a copy
    pool.begin_step()
    pool.offer(a)
    assert pool.take_saves() == []
    pool.end_step()
    saved(pool, [b])
    assert set(pool.hash_to_slot) == {a.block_hash, b.block_hash}
    pool.check_integrity()


def test_slots_a_step_copies_are_never_reused_in_that_step() -> None:
    """Two slots, one being loaded: a step's saves take the other, then skip (no slot read and
    written in one step, no slot written twice)."""
    pool = HostKVPool(2, BS, 64)
    bm = BlockManager(4, BS)
    a = block(0, (1, 1, 1, 1))
    saved(pool, [a])
    s = seq([1, 1, 1, 1, 0])
    pool.begin_step()
    loads: list[tuple[int, int]] = []
    pool.admit(s, 1, [], pool.find(s, [], bm), bm, loads)
    for i in range(3):
        pool.offer(block(i, (5 + i,) * 4))
    saves = pool.take_saves()
    assert len(saves) == 1 and saves[0][1] != loads[0][0]
    assert pool.stats().skipped_saves == 2
    pool.end_step()
    bm.free(s)
    pool.check_integrity()


def test_a_save_whose_step_never_came_back_is_forgotten() -> None:
    pool = HostKVPool(4, BS, 64)
    a = block(0, (1, 1, 1, 1))
    pool.begin_step()
    pool.offer(a)
    pool.take_saves()
    pool.begin_step()  # the step raised: no end_step
    assert not pool.entries and pool.is_idle
    pool.check_integrity()


def test_reset_forgets_everything() -> None:
    pool = HostKVPool(4, BS, 64)
    saved(pool, chain(list(range(12))))
    pool.reset()
    assert not pool.entries and len(pool.free_slots) == 4
    pool.check_integrity()


# ---------------------------------------------------------------- the protocol, simulated
class SimCache:
    """K/V as what they depend on: the entry at position p of a sequence is (root, tokens[:p + 1]).
    Runs a step message's copies in the runner's order, checks every position a sequence attends
    to holds its own K/V, then writes the new positions."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.device = [[None] * BS for _ in range(num_blocks)]
        self.host = [[None] * BS for _ in range(num_slots)]

    def run(self, step, seqs: dict[int, Sequence]) -> None:
        for b, s in step.kv_host_saves:
            self.host[s] = list(self.device[b])
        for s, b in step.kv_host_loads:
            self.device[b] = list(self.host[s])
        for st in step.seqs:
            seq = seqs[st.seq_id]
            root = (seq.lora_name, seq.cache_salt)
            for p in range(st.context_len):
                b, off = st.block_table[p // BS], p % BS
                want = (root, tuple(seq.tokens_slice(0, p + 1)))
                if p < st.start_pos:
                    assert self.device[b][off] == want, f"seq {st.seq_id} reads foreign K/V at position {p}"
                else:
                    self.device[b][off] = want


@pytest.mark.parametrize("seed", range(6))
def test_random_multi_turn_traffic_always_reads_its_own_kv(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks, num_slots = 12, rng.choice([3, 8, 40])
    bm = BlockManager(num_blocks, BS)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=rng.choice([6, 16, 64]), max_model_len=40)
    pool = HostKVPool(num_slots, BS, 64)
    sched.host_kv, bm.on_evict = pool, pool.offer
    sim = SimCache(num_blocks, num_slots)
    histories: dict[int, list[int]] = {}  # conversation -> its tokens so far
    live: dict[int, Sequence] = {}
    for _ in range(300):
        if len(live) < 4 and rng.random() < 0.4:
            conv = rng.randrange(5)
            prompt = histories.get(conv, []) + [rng.randrange(50) for _ in range(rng.randrange(1, 7))]
            if len(prompt) > 30:
                prompt = prompt[-rng.randrange(1, 10):]
            s = Sequence(f"c{conv}", prompt, SamplingParams(max_tokens=rng.randrange(1, 5)),
                         lora_name=rng.choice([None, None, "a"]), cache_salt=rng.choice([None, None, "t"]))
            s.conv = conv  # type: ignore[attr-defined]
            sched.add(s)
            live[s.seq_id] = s
        plan = sched.schedule()
        if plan.is_empty:
            continue
        step = build_step(plan, ())
        sim.run(step, live)
        result = StepResult({st.seq_id: SampledTokens([rng.randrange(50)], [0.0], [None])
                             for st in step.seqs if st.do_sample})
        sched.update_after_step(plan, result)
        for s in list(live.values()):
            if s.num_output_tokens >= s.sampling_params.max_tokens:
                sched.finish(s, SequenceStatus.FINISHED_STOPPED)
                histories[s.conv] = s.token_ids  # type: ignore[attr-defined]
                del live[s.seq_id]
        bm.check_integrity()
        pool.check_integrity()
        assert pool.is_idle
    stats = pool.stats()
    assert stats.saved_blocks > 0
    if num_slots >= 8:
        assert stats.hit_blocks > 0, "multi-turn traffic over a tiny device cache never hit the host tier"
