"""Speculative decoding with a draft model (method "draft_model") through the engine: a model
drafting for itself accepts every draft at temperature 0; a different small draft model leaves
greedy output token for token what decoding without drafts gives; its KV cache shares the
target's block tables (the conftest checks every engine's blocks after each test)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from stoker import LLM, SamplingParams
from stoker.config import SpeculativeConfig
from tests.model.helpers import ScriptedK, check_structured_with_drafts, output_token_ids, spec_llm

_make = functools.partial(spec_llm, max_num_seqs=8)  # the draft's scratch blocks: a few sequences


REPEAT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11] * 6}
PLAIN = {"prompt_token_ids": list(range(40, 75))}
MIXED = [REPEAT, PLAIN, {"prompt_token_ids": [300, 301, 302] * 10 + [7, 8]}, "hello there, how are you",
         {"prompt_token_ids": [11, 12, 13, 14] * 9}]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _spec(draft: Path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def small_draft(tiny_checkpoints) -> Path:
    return tiny_checkpoints("llama", seed=5, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1)


@pytest.fixture(scope="module")
def base(tiny_llama: Path) -> LLM:
    return _make(tiny_llama, None)


@pytest.fixture(scope="module")
def itself(tiny_llama: Path) -> LLM:
    return _make(tiny_llama, _spec(tiny_llama))


@pytest.fixture(scope="module")
def other(tiny_llama: Path, small_draft: Path) -> LLM:
    return _make(tiny_llama, _spec(small_draft))


def test_a_model_drafting_for_itself_accepts_every_draft(base: LLM, itself: LLM) -> None:
    before = itself.engine.stats().spec_decoding
    assert output_token_ids(itself, MIXED, GREEDY) == output_token_ids(base, MIXED, GREEDY)
    sd = itself.engine.stats().spec_decoding
    drafted = sd.num_draft_tokens - before.num_draft_tokens
    accepted = sd.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 0 and accepted == drafted  # acceptance rate 1.0
    # 5 sequences x 24 tokens in far fewer verify steps: 4 tokens per step once drafting
    assert sd.num_drafts - before.num_drafts < 5 * 24 / 3


def test_a_different_draft_model_leaves_greedy_output_unchanged(base: LLM, other: LLM) -> None:
    before = other.engine.stats().spec_decoding
    assert output_token_ids(other, MIXED, GREEDY) == output_token_ids(base, MIXED, GREEDY)
    assert other.engine.stats().spec_decoding.num_draft_tokens > before.num_draft_tokens


def test_structured_outputs_a_model_drafting_for_itself_within_the_grammar(base: LLM, itself: LLM) -> None:
    """The draft's argmax is masked by the same grammar (structured/draft_mask.py): it proposes
    the target's masked argmax, so every draft passes, and the output is valid and lossless."""
    before, after = check_structured_with_drafts(base, itself)
    assert after.num_accepted_tokens - before.num_accepted_tokens == after.num_draft_tokens - before.num_draft_tokens


def test_structured_outputs_with_another_draft_model(base: LLM, other: LLM) -> None:
    check_structured_with_drafts(base, other, expect_accepted=False)


def test_seeded_sampling_is_reproducible(itself: LLM) -> None:
    """A seeded row draws the same tokens alone or beside another request (whose drafts differ)."""
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, seed=7, n=2)
    a = [c.token_ids for c in itself.generate([REPEAT], p, use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in itself.generate([REPEAT, PLAIN], p, use_tqdm=False)[0].outputs]
    assert a == b and a[0] != a[1] and all(len(t) == 16 for t in a)


def test_max_tokens_stops_and_logprobs_mid_draft(base: LLM, itself: LLM) -> None:
    for n in (1, 2, 5):
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert output_token_ids(itself, [REPEAT, PLAIN], p) == output_token_ids(base, [REPEAT, PLAIN], p)
    full = output_token_ids(base, [REPEAT], GREEDY)[0]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[full[9]], logprobs=2)
    a, b = (llm.generate([REPEAT], p, use_tqdm=False)[0].outputs[0] for llm in (base, itself))
    assert b.token_ids == a.token_ids == full[: full.index(full[9]) + 1]
    assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)


def test_preemption_and_chunked_prefill(tiny_llama: Path, base: LLM) -> None:
    """A cache too small for every sequence (preempted and recomputed, the draft's cache too),
    prompts in chunks of at most 32 tokens."""
    tight = _make(tiny_llama, _spec(tiny_llama), num_gpu_blocks_override=14, max_model_len=128,
                  max_num_batched_tokens=32)
    assert output_token_ids(tight, MIXED, GREEDY) == output_token_ids(base, MIXED, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    sd = tight.engine.stats().spec_decoding
    assert sd.num_accepted_tokens == sd.num_draft_tokens > 0  # its own draft: every one kept


def test_prefix_cache_hits_bring_the_draft_cache_along(base: LLM, itself: LLM) -> None:
    """The same prompts twice: the second run's prompt blocks come from the prefix cache, the
    draft's K/V in the same blocks, so drafting for itself still accepts everything."""
    want = output_token_ids(base, MIXED, GREEDY)
    assert output_token_ids(itself, MIXED, GREEDY) == want
    hits, before = itself.engine.block_manager.prefix_cache_hits, itself.engine.stats().spec_decoding
    assert output_token_ids(itself, MIXED, GREEDY) == want
    assert itself.engine.block_manager.prefix_cache_hits > hits
    sd = itself.engine.stats().spec_decoding
    assert sd.num_accepted_tokens - before.num_accepted_tokens == sd.num_draft_tokens - before.num_draft_tokens > 0


def test_the_draft_cache_counts_in_the_kv_budget(tiny_llama: Path, base: LLM, itself: LLM) -> None:
    """Same byte budget: the draft's K/V (and its scratch blocks) leave fewer blocks."""
    plain, drafted = base.engine.runner_info.bytes_per_block, itself.engine.runner_info.bytes_per_block
    assert drafted == 2 * plain  # drafting for itself: the same K/V per token again
    assert itself.engine.block_manager.num_blocks < base.engine.block_manager.num_blocks // 2


def test_bad_configs_are_refused_by_name(tiny_llama: Path, tiny_checkpoints) -> None:
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig.from_dict({**_spec(tiny_llama), "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1 or"):
        from stoker.config import EngineConfig, ModelConfig, ParallelConfig
        EngineConfig(ModelConfig(model=str(tiny_llama)), parallel_config=ParallelConfig(tensor_parallel_size=2),
                     speculative_config=SpeculativeConfig(**_spec(tiny_llama), draft_tensor_parallel_size=4))
    other_vocab = tiny_checkpoints("llama", vocab_size=600)
    with pytest.raises(ValueError, match="vocab_size 600"):
        _make(tiny_llama, _spec(other_vocab))


@pytest.mark.parametrize("max_rows", [None, 4])
def test_k_zero_runs_no_draft_forward_and_the_draft_catches_up(base: LLM, itself: LLM, max_rows: int | None) -> None:
    """The chosen k reaches the runner: at 0 no draft forward runs (a counter of them), below the
    configured k only k drafts are made; the draft's cache catches up on the skipped positions when
    k rises, so a model drafting for itself still has every draft accepted, and greedy output is
    decoding without drafts. `max_rows` 4: a catch-up longer than a draft forward may compute goes
    on over the next steps (its sequence proposes nothing meanwhile)."""
    engine = itself.engine
    drafter = engine.executor.driver_runner.drafter
    if max_rows is not None:
        max_rows, drafter.max_rows = drafter.max_rows, max_rows
    policy, engine.spec_k_policy = engine.spec_k_policy, ScriptedK([0, 0, 0, 3, 0, 2, 0, 0, 1, 3, 3])
    steps: list[tuple[int | None, int, int]] = []  # (the step's k, draft forwards it ran, its longest proposal)
    execute = engine.executor.execute

    def spy(step):
        forwards = drafter.num_draft_forwards
        result = execute(step)
        longest = max((len(d) for d in result.draft_token_ids.values()), default=0)
        steps.append((step.num_speculative_tokens, drafter.num_draft_forwards - forwards, longest))
        return result

    before = engine.stats().spec_decoding
    engine.executor.execute = spy
    try:
        got = output_token_ids(itself, MIXED, GREEDY)
    finally:
        engine.executor.execute, engine.spec_k_policy = execute, policy
        if max_rows is not None:
            drafter.max_rows = max_rows
    assert got == output_token_ids(base, MIXED, GREEDY)
    assert sum(k == 0 for k, _, _ in steps) >= 10
    assert all(forwards == 0 and longest == 0 for k, forwards, longest in steps if k == 0)
    assert all(longest <= k for k, _, longest in steps if k is not None)
    assert any(longest == 1 for k, _, longest in steps if k == 1) and any(longest == 3 for k, _, longest in steps)
    sd = engine.stats().spec_decoding
    drafted, accepted = sd.num_draft_tokens - before.num_draft_tokens, sd.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 0 and accepted == drafted  # the caught-up draft cache is the target's
    assert not drafter.lags  # finished sequences left nothing behind
