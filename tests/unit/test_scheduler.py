import pytest

from stoker.core.block_manager import BlockManager
from stoker.core.scheduler import Scheduler
from stoker.core.sequence import Sequence, SequenceStatus
from stoker.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128, chunked=True, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, chunked)


def seq(n: int, start: int = 0, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=100))


def run_step(sched: Scheduler, sampled_token: int = 7):
    """Plan a step, pretend the runner ran it, append a token to every sampling sequence."""
    out = sched.schedule()
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.do_sample:
            s.seq.append_token(sampled_token)
    return out


def test_fcfs_and_token_budget() -> None:
    sched = make(budget=10)
    a, b = seq(6, rid="a"), seq(6, 100, rid="b")
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    # a's whole prompt (6) then 4 of b's: chunked prefill under the budget.
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 6), ("b", 4)]
    assert out.num_batched_tokens == 10
    assert [s.do_sample for s in out.scheduled] == [True, False]
    out = run_step(sched)
    # a decodes one token, b finishes its prompt.
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 2)]
    sched.block_manager.check_integrity()


def test_long_prompt_is_chunked_alongside_decodes() -> None:
    sched = make(budget=8)
    short = seq(3, rid="short")
    sched.add(short)
    run_step(sched)
    long = seq(30, 50, rid="long")
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = run_step(sched)
        ids = [s.seq.request_id for s in out.scheduled]
        assert "short" in ids, "a running decode must never be stalled by a long prefill"
        chunks.append(next(s.num_tokens for s in out.scheduled if s.seq is long))
    assert chunks == [7, 7, 7, 7, 2]
    assert long.num_output_tokens == 1


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(2, 10 * i, rid=str(i)))
    out = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_chunked_prefill_off_waits_for_room() -> None:
    sched = make(budget=8, chunked=False)
    sched.add(seq(6, rid="a"))
    sched.add(seq(6, 100, rid="b"))
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(seq(9, rid="too-long"))


def test_prompt_longer_than_max_model_len_is_rejected_with_both_numbers() -> None:
    sched = make(max_model_len=16)
    with pytest.raises(ValueError, match=r"17 tokens.*max_model_len \(16\)"):
        sched.add(seq(17))


def test_preemption_newest_first_and_recompute() -> None:
    # 4 blocks of 4 tokens: two 8-token prompts fill them; growing, only one fits.
    sched = make(num_blocks=4, block_size=4, budget=64)
    old, new = seq(8, rid="old"), seq(8, 100, rid="new")
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefilled: 2 blocks each, all 4 used
    out = run_step(sched)  # each needs a third block for position 8: the newest is preempted
    assert [s.request_id for s in out.preempted] == ["new"]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert sched.waiting[0] is new
    assert sched.num_preemptions == 1
    # The preempted sequence keeps its output tokens and is recomputed when room returns.
    sched.finish(old, SequenceStatus.FINISHED_STOPPED)
    out = run_step(sched)
    (s,) = out.scheduled
    assert s.seq is new and s.do_sample
    # Its first full block survived in the prefix cache, so the recompute starts after it.
    assert new.num_cached_tokens == 4 and s.start_pos == 4 and s.num_tokens == 5
    sched.block_manager.check_integrity()


def test_finish_frees_blocks_everywhere() -> None:
    sched = make()
    a, b = seq(5, rid="a"), seq(5, 50, rid="b")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    sched.finish(b, SequenceStatus.FINISHED_STOPPED)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert not sched.has_unfinished()
    sched.block_manager.check_integrity()


def test_n_siblings_wait_for_leader_then_hit_prefix_cache() -> None:
    sched = make(budget=64)
    leader = seq(9, rid="r")
    sibling = Sequence("r", leader.prompt_token_ids, leader.sampling_params, index=1, group_leader=leader)
    sched.add(leader)
    sched.add(sibling)
    out = run_step(sched)
    assert [s.seq.index for s in out.scheduled] == [0]  # the sibling waited
    out = run_step(sched)
    sib = next(s for s in out.scheduled if s.seq is sibling)
    assert sibling.num_cached_tokens == 8  # two full blocks shared
    assert sib.num_tokens == 1
    bm = sched.block_manager
    assert bm.get_block_table(sibling)[:2] == bm.get_block_table(leader)[:2]
