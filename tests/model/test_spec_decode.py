"""Speculative decoding with the n-gram proposer through the engine: lossless for greedy rows
(token for token what decoding without drafts gives), drafts that really fire, rollback that
leaves the KV cache whole (the conftest checks every engine's integrity after each test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker import LLM, SamplingParams
from tests.model.helpers import (STRUCTURED_CHOICE, STRUCTURED_REGEX, STRUCTURED_SCHEMA, check_structured_with_drafts,
                                 output_token_ids, spec_llm, structured_cases)

_make = spec_llm


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
REPEAT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11] * 6}  # drafts fire from the first step
PLAIN = {"prompt_token_ids": list(range(40, 75))}  # no n-gram recurs in the prompt
MIXED = [REPEAT, PLAIN, {"prompt_token_ids": [300, 301, 302] * 10 + [7, 8]}, "hello there, how are you",
         {"prompt_token_ids": [11, 12, 13, 14] * 9}]


@pytest.fixture(scope="module")
def base(tiny_llama: Path) -> LLM:
    return _make(tiny_llama, None)


@pytest.fixture(scope="module")
def spec(tiny_llama: Path) -> LLM:
    return _make(tiny_llama, NGRAM)


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize("prompts", [[REPEAT], [PLAIN], MIXED], ids=["repetitive", "plain", "mixed-batch"])
def test_greedy_output_equals_decoding_without_drafts(base: LLM, spec: LLM, prompts) -> None:
    before = spec.engine.stats().spec_decoding
    assert output_token_ids(spec, prompts, GREEDY) == output_token_ids(base, prompts, GREEDY)
    after = spec.engine.stats().spec_decoding
    assert after.num_drafts > before.num_drafts  # drafts fired: a model loops on its own output
    if prompts != [PLAIN]:
        assert after.num_accepted_tokens > before.num_accepted_tokens


def test_acceptance_counters_on_a_repetitive_prompt(spec: LLM) -> None:
    before = spec.engine.stats().spec_decoding
    output_token_ids(spec, [REPEAT], GREEDY)
    sd = spec.engine.stats().spec_decoding
    drafts, drafted = sd.num_drafts - before.num_drafts, sd.num_draft_tokens - before.num_draft_tokens
    accepted = sd.num_accepted_tokens - before.num_accepted_tokens
    assert drafts > 0 and 0 < accepted <= drafted <= 3 * drafts
    per_pos = [a - b for a, b in zip(sd.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True) and len(per_pos) == 3
    # Fewer steps than tokens: verified drafts saved forwards (48 tokens, the prefill's one included)
    assert drafts < 47


def test_preemption_under_a_tiny_cache_stays_lossless(tiny_llama: Path, base: LLM) -> None:
    """12 blocks of 16 tokens for 5 sequences of ~40 + 48 tokens (and 3 draft slots each):
    sequences are preempted and recomputed, drafts and all."""
    tight = _make(tiny_llama, NGRAM, num_gpu_blocks_override=12, max_num_seqs=8, max_model_len=128)
    assert output_token_ids(tight, MIXED, GREEDY) == output_token_ids(base, MIXED, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.stats().spec_decoding.num_accepted_tokens > 0
    tight.engine.check_integrity()
    assert tight.engine.block_manager.num_free_blocks == 12


def test_prefix_caching_hits_and_never_caches_a_rejected_draft(tiny_llama: Path, base: LLM) -> None:
    """The same prompts twice: the second run takes the first's prompt blocks (and the blocks of
    the output that were full of accepted tokens) from the cache and still equals no speculation."""
    llm = _make(tiny_llama, NGRAM)
    want = output_token_ids(base, MIXED, GREEDY)
    assert output_token_ids(llm, MIXED, GREEDY) == want
    hits = llm.engine.block_manager.prefix_cache_hits
    assert output_token_ids(llm, MIXED, GREEDY) == want
    assert llm.engine.block_manager.prefix_cache_hits > hits
    # Every cached block holds the tokens its hash names: the sequences' real tokens, never a draft
    bm = llm.engine.block_manager
    for block in bm.blocks:
        if block.block_hash is not None:
            assert len(block.token_ids) == bm.block_size
    llm.engine.check_integrity()


def test_max_tokens_and_stop_tokens_land_mid_draft(base: LLM, spec: LLM) -> None:
    """A stop inside the accepted run ends the output there: the tokens after it are dropped."""
    for n in (1, 2, 5, 13):
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert output_token_ids(spec, [REPEAT, PLAIN], p) == output_token_ids(base, [REPEAT, PLAIN], p)
    full = output_token_ids(base, [REPEAT], GREEDY)[0]
    stop = full[9]  # appears after the output is already looping: drafts fire around it
    p = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop_token_ids=[stop])
    got = spec.generate([REPEAT], p, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == full[: full.index(stop) + 1] and got.finish_reason == "stop"


def test_stop_strings_mid_draft(base: LLM, spec: LLM) -> None:
    text = base.generate([REPEAT], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    p = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop])
    a = base.generate([REPEAT], p, use_tqdm=False)[0].outputs[0]
    b = spec.generate([REPEAT], p, use_tqdm=False)[0].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason, a.stop_reason)
    assert b.finish_reason == "stop"


def test_logprobs_of_accepted_tokens_match_decoding_without_drafts(base: LLM, spec: LLM) -> None:
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    a = base.generate([REPEAT], p, use_tqdm=False)[0].outputs[0]
    b = spec.generate([REPEAT], p, use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids and len(b.logprobs) == len(a.logprobs) == 24
    for ea, eb in zip(a.logprobs, b.logprobs):
        assert set(ea) == set(eb)
        for t in ea:
            assert eb[t].rank == ea[t].rank and eb[t].logprob == pytest.approx(ea[t].logprob, abs=1e-4)
    assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)


def test_penalties_and_min_tokens_see_the_drafts_before_each_row(base: LLM, spec: LLM) -> None:
    """Row j of a verified sequence is penalised over its output with drafts 0..j-1 appended,
    so penalised greedy output is still what decoding without drafts gives."""
    for p in (SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(temperature=0, max_tokens=32, min_tokens=20, stop_token_ids=[7, 8, 9])):
        assert output_token_ids(spec, MIXED, p) == output_token_ids(base, MIXED, p)


def test_seeded_sampling_is_reproducible_and_n_completions_differ(spec: LLM) -> None:
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, ignore_eos=True, seed=7, n=2)
    a = [c.token_ids for c in spec.generate([REPEAT], p, use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in spec.generate([REPEAT, PLAIN], p, use_tqdm=False)[0].outputs]
    assert a == b and a[0] != a[1] and all(len(t) == 32 for t in a)


def test_structured_outputs_stay_valid_and_lossless(base: LLM, spec: LLM) -> None:
    check_structured_with_drafts(base, spec)


def test_sampled_structured_outputs_stay_valid(spec: LLM) -> None:
    """Random rows: a draft the grammar forbids has probability 0 at its masked row, so it is
    never accepted, and the replacement is drawn within the grammar."""
    import json
    import re

    import jsonschema

    cases = structured_cases()
    before = spec.engine.stats().spec_decoding
    for seed in range(2):
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=so) for _, so in cases]
        texts = [o.outputs[0].text for o in spec.generate([p for p, _ in cases], params, use_tqdm=False)]
        jsonschema.validate(json.loads(texts[0]), STRUCTURED_SCHEMA)
        assert re.fullmatch(STRUCTURED_REGEX, texts[1]) and texts[2] in STRUCTURED_CHOICE, texts
    assert spec.engine.stats().spec_decoding.num_drafts > before.num_drafts


def test_a_draft_the_grammar_forbids_is_rejected(base: LLM, spec: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt repeats `{"name": "zed", ...}`: after `{"name": "` the n-gram drafts `zed`,
    which the schema's enum forbids. No verified run may keep a draft at or after the first one
    the grammar refuses, and the output stays what decoding without drafts gives."""
    import json

    from stoker.structured.spec import StructuredOutputs

    spec.engine.grammars()  # the runner's matchers exist from the first structured request on
    matchers = spec.engine.executor.driver_runner.matchers
    seen: list[list] = []  # per verify step: [drafts, how many the grammar allows, how many were kept]
    mask_drafts, accept_tokens = matchers.mask_drafts, matchers.accept_tokens

    def spy_mask(logits, groups):
        seen.extend([list(drafts), matchers.allowed_prefix(seq_id, so, list(drafts)), None]
                    for _, seq_id, so, drafts in groups)
        mask_drafts(logits, groups)

    def spy_accept(seq_id, so, tokens):
        seen[-1][2] = len(tokens) - 1  # one request: one group per step
        accept_tokens(seq_id, so, tokens)

    monkeypatch.setattr(matchers, "mask_drafts", spy_mask)
    monkeypatch.setattr(matchers, "accept_tokens", spy_accept)
    params = SamplingParams(temperature=0, max_tokens=24,
                            structured_outputs=StructuredOutputs.from_schema(STRUCTURED_SCHEMA))
    prompt = ['{"name": "zed", "age": 7} ' * 4]
    got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == output_token_ids(base, prompt, params)[0]
    assert json.loads(got.text)["name"] in ("ann", "bob", "cy")
    forbidden = [s for s in seen if s[1] < len(s[0])]
    assert forbidden, seen  # the construction drafted what the grammar refuses
    assert all(kept is not None and kept <= allowed for _, allowed, kept in seen), seen


def test_the_config_is_refused_by_name(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="'eagle' is not supported yet"):
        _make(tiny_llama, {"method": "eagle", "num_speculative_tokens": 3, "model": "x"})
    with pytest.raises(ValueError, match="speculative_config keys suffix_decoding_max_tree_depth"):
        _make(tiny_llama, {**NGRAM, "suffix_decoding_max_tree_depth": 8})


def test_lora_adapters_verify_their_own_drafts(tiny_llama: Path, tmp_path: Path) -> None:
    """The verify forward runs each sequence's tokens under its own adapter (the LoRA mapping
    is per token): a batch mixing the base model and two adapters equals no speculation."""
    from stoker.lora.request import LoRARequest
    from tests.model.helpers import make_adapter

    adapters = [make_adapter(tiny_llama, tmp_path / f"a{i}", ["q_proj", "v_proj", "down_proj"], 8, seed=30 + i)
                for i in range(2)]
    reqs = [None, LoRARequest("a0", 1, str(adapters[0])), LoRARequest("a1", 2, str(adapters[1])),
            LoRARequest("a0", 1, str(adapters[0]))]
    prompts = [REPEAT, REPEAT, MIXED[2], PLAIN]
    kw = dict(enable_lora=True, max_loras=2, max_model_len=256, kv_cache_memory_bytes=4 << 20)
    plain, spec = LLM(str(tiny_llama), **kw), LLM(str(tiny_llama), speculative_config=NGRAM, **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)]
    assert got == want and want[0] != want[1]
    assert spec.engine.stats().spec_decoding.num_accepted_tokens > 0
