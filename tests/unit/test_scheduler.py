import pytest

from stoker.core.block_manager import BlockManager
from stoker.core.scheduler import Scheduler
from stoker.core.sequence import Sequence, SequenceStatus
from stoker.core.step import SampledTokens, StepResult
from stoker.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128, chunked=True, prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, chunked)


def seq(n: int, start: int = 0, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=100))


def accepted(plan, tokens: dict[int, list[int]]) -> StepResult:
    """A step's result: `tokens[seq_id]` accepted for each listed sequence."""
    return StepResult({seq_id: SampledTokens(ids, [0.0] * len(ids), [None] * len(ids)) for seq_id, ids in tokens.items()})


def run_step(sched: Scheduler, sampled_token: int = 7):
    """Plan a step, pretend the runner ran it: every sampling sequence accepts one token."""
    out = sched.schedule()
    sched.update_after_step(out, accepted(out, {s.seq.seq_id: [sampled_token] for s in out.scheduled if s.do_sample}))
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


# ---------------------------------------------------------------- the step round trip: drafts roll back
def prefilled(block_size: int = 4, prompt_len: int = 6):
    """A sequence whose prompt is in the cache and whose first token (7) is sampled."""
    sched = make(block_size=block_size)
    a = seq(prompt_len, rid="a")
    sched.add(a)
    run_step(sched)
    return sched, a


def block_hashes(sched: Scheduler, a: Sequence) -> list[int | None]:
    bm = sched.block_manager
    return [bm.blocks[b].block_hash for b in bm.get_block_table(a)]


def test_drafts_are_planned_after_the_known_tokens() -> None:
    sched, a = prefilled()
    a.draft_token_ids = [10, 11, 12]
    plan = sched.schedule()
    (s,) = plan.scheduled
    # positions 6..9: the sampled token 7 and three drafts, each position sampled
    assert (s.start_pos, s.num_tokens, s.num_draft_tokens, s.do_sample) == (6, 4, 3, True)
    assert s.token_ids == [7, 10, 11, 12] and len(s.block_table) == 3  # 10 tokens: three blocks of 4
    sched.update_after_step(plan, accepted(plan, {a.seq_id: [10, 11, 12, 13]}))  # all accepted + one more
    assert a.output_token_ids == [7, 10, 11, 12, 13] and a.num_computed_tokens == 10
    assert a.draft_token_ids == [] and len(sched.block_manager.get_block_table(a)) == 3
    sched.block_manager.check_integrity()


def test_a_rejected_draft_rolls_back_computed_tokens_blocks_and_hashes() -> None:
    """Plan a step with three drafts; the result accepts fewer. The sequence must roll back to
    what was computed and accepted, free the block that held only rejected drafts, and never
    hash a block holding a rejected draft's K/V into the prefix cache."""
    sched, a = prefilled()
    bm = sched.block_manager
    hashed_before = block_hashes(sched, a)
    assert hashed_before[0] is not None and hashed_before[1] is None  # positions 0-3 full, 4-5 not
    a.draft_token_ids = [10, 11, 12]
    plan = sched.schedule()
    assert len(bm.get_block_table(a)) == 3  # reserved for positions up to 9
    free_during = bm.num_free_blocks
    # The first draft is rejected: the runner's token at position 6's logits was 55, not 10.
    sched.update_after_step(plan, accepted(plan, {a.seq_id: [55]}))
    assert a.output_token_ids == [7, 55]
    assert a.num_computed_tokens == 7  # the prompt and the token 7; position 7 (draft 10) not kept
    table = bm.get_block_table(a)
    assert len(table) == 2 and bm.num_free_blocks == free_during + 1  # the drafts-only block is back
    # Block 1 (positions 4-7) is not full of computed tokens: nothing was hashed for it, so a
    # prompt [0..5, 7, 10] cannot hit the rejected draft's K/V.
    assert block_hashes(sched, a) == hashed_before[:2]
    probe = Sequence("probe", [0, 1, 2, 3, 4, 5, 7, 10, 99], SamplingParams())
    assert bm.find_cached_prefix(probe) == table[:1]
    bm.check_integrity()
    # The next step computes from there: the sampled token 55 at position 7 fills block 1.
    plan = sched.schedule()
    (s,) = plan.scheduled
    assert (s.start_pos, s.token_ids) == (7, [55])
    sched.update_after_step(plan, accepted(plan, {a.seq_id: [8]}))
    assert a.num_computed_tokens == 8 and block_hashes(sched, a)[1] is not None
    probe = Sequence("probe", [0, 1, 2, 3, 4, 5, 7, 55, 99], SamplingParams())
    assert bm.find_cached_prefix(probe) == table[:2]
    bm.check_integrity()


def test_partly_accepted_drafts_keep_their_blocks() -> None:
    sched, a = prefilled()
    a.draft_token_ids = [10, 11, 12]
    plan = sched.schedule()
    sched.update_after_step(plan, accepted(plan, {a.seq_id: [10, 56]}))  # one draft accepted, then 56
    assert a.output_token_ids == [7, 10, 56] and a.num_computed_tokens == 8
    assert len(sched.block_manager.get_block_table(a)) == 2
    assert block_hashes(sched, a)[1] is not None  # positions 4-7 = [4, 5, 7, 10]: all computed and accepted
    sched.block_manager.check_integrity()


def test_the_budget_cuts_drafts_first() -> None:
    sched, a = prefilled()
    sched.max_num_batched_tokens = 2
    a.draft_token_ids = [10, 11, 12]
    (s,) = sched.schedule().scheduled
    assert (s.num_tokens, s.num_draft_tokens, s.token_ids) == (2, 1, [7, 10])


def test_drafts_the_budget_left_out_are_stale_after_the_step() -> None:
    """Drafts continue the sequence as it was; once a token is appended they no longer do."""
    sched, a = prefilled()
    sched.max_num_batched_tokens = 1
    a.draft_token_ids = [10, 11]
    plan = sched.schedule()
    assert plan.scheduled[0].num_draft_tokens == 0
    sched.update_after_step(plan, accepted(plan, {a.seq_id: [8]}))
    assert a.output_token_ids == [7, 8] and a.draft_token_ids == []


def test_a_result_that_does_not_match_the_plan_is_refused() -> None:
    sched, a = prefilled()
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="accepted 2 token"):
        sched.update_after_step(plan, accepted(plan, {a.seq_id: [1, 2]}))  # one row sampled, two tokens back
    with pytest.raises(RuntimeError, match="accepted none"):
        sched.update_after_step(plan, accepted(plan, {}))


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    """--scheduling-policy priority: lower values first among the waiting; FIFO among equals;
    when blocks run out the least urgent running sequence is the one preempted."""
    bm = BlockManager(8, 4, True)
    sched = Scheduler(bm, 8, 32, 128, True, policy="priority")
    seqs = {}
    for name, prio, arrival in (("late-urgent", 0, 3.0), ("early-lazy", 5, 1.0), ("mid", 1, 2.0), ("mid2", 1, 2.5)):
        s = Sequence(name, list(range(8)), SamplingParams(max_tokens=100), arrival_time=arrival, priority=prio)
        seqs[name] = s
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["late-urgent", "mid", "mid2", "early-lazy"]
    out = run_step(sched)  # 4 prompts x 2 blocks = all 8 blocks
    assert [s.seq.request_id for s in out.scheduled] == ["late-urgent", "mid", "mid2", "early-lazy"]
    out = run_step(sched)  # each needs a third block: the least urgent are preempted, last first
    assert [s.request_id for s in out.preempted] == ["early-lazy", "mid2"]
    assert [s.seq.request_id for s in out.scheduled] == ["late-urgent", "mid"]
    assert [s.request_id for s in sched.waiting] == ["mid2", "early-lazy"]  # back in priority order
    bm.check_integrity()
    fcfs = make()
    a = Sequence("a", [1, 2], SamplingParams(), arrival_time=2.0, priority=0)
    b = Sequence("b", [1, 2], SamplingParams(), arrival_time=1.0, priority=0)
    fcfs.add(a)
    fcfs.add(b)
    assert [s.request_id for s in fcfs.waiting] == ["a", "b"]  # fcfs: the order they were added


def test_drafts_are_dropped_rather_than_preempt_a_sequence() -> None:
    """Two sequences fill 4 of 4 blocks; drafts for the older one would need a fifth. The drafts
    go (they are a bet), the younger sequence stays: no preemption for speculative tokens."""
    sched = make(num_blocks=4, block_size=4)
    a, b = seq(6, rid="a"), seq(6, start=50, rid="b")
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prompts; 7 sampled: each holds 2 blocks, positions 0..6 fit them
    assert sched.block_manager.num_free_blocks == 0
    a.draft_token_ids = [10, 11, 12]  # positions 7..9: a third block
    plan = sched.schedule()
    assert not plan.preempted and sched.num_preemptions == 0
    assert [(s.seq.request_id, s.num_tokens, s.num_draft_tokens) for s in plan.scheduled] == [("a", 1, 0), ("b", 1, 0)]
    sched.update_after_step(plan, accepted(plan, {a.seq_id: [8], b.seq_id: [8]}))
    assert a.draft_token_ids == [] and a.output_token_ids == [7, 8]
    sched.block_manager.check_integrity()
