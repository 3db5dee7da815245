"""The suffix method through the engine, and k chosen by the wall: greedy output equals decoding
without drafts token for token, drafts fire and are accepted (the counters say so), a finished
request's output drafts for the next one, and at a large batch the cost model lowers k."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker import LLM, SamplingParams
from stoker.roofline import device_file
from tests.model.helpers import check_structured_with_drafts, output_token_ids, spec_llm

_make = spec_llm


SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "dynamic": False}
REPEAT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11] * 6}
PLAIN = {"prompt_token_ids": list(range(40, 75))}
MIXED = [REPEAT, PLAIN, {"prompt_token_ids": [300, 301, 302] * 10 + [7, 8]}, "hello there, how are you",
         {"prompt_token_ids": [11, 12, 13, 14] * 9}]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _tokens(llm: LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    return output_token_ids(llm, prompts, params)


@pytest.fixture(scope="module")
def base(tiny_llama: Path) -> LLM:
    return _make(tiny_llama, None)


@pytest.fixture(scope="module")
def suffix(tiny_llama: Path) -> LLM:
    return _make(tiny_llama, SUFFIX)


@pytest.mark.parametrize("prompts", [[REPEAT], MIXED], ids=["repetitive", "mixed-batch"])
def test_greedy_output_equals_decoding_without_drafts(base: LLM, suffix: LLM, prompts) -> None:
    before = suffix.engine.stats().spec_decoding
    assert _tokens(suffix, prompts) == _tokens(base, prompts)
    sd = suffix.engine.stats().spec_decoding
    drafts, accepted = sd.num_drafts - before.num_drafts, sd.num_accepted_tokens - before.num_accepted_tokens
    assert drafts > 0 and accepted > 0
    assert sd.num_draft_tokens - before.num_draft_tokens <= 4 * drafts


def test_structured_outputs_stay_valid_and_lossless(base: LLM, suffix: LLM) -> None:
    check_structured_with_drafts(base, suffix)


def test_a_finished_output_drafts_for_the_next_request(tiny_llama: Path, base: LLM) -> None:
    """PLAIN's prompt repeats nothing; its greedy output is what the shared tree learns. The same
    prompt again is drafted from that output (max_spec_factor 4: a 1-token match drafts 4)."""
    spec = {**SUFFIX, "suffix_decoding_max_spec_factor": 4.0}
    llm = _make(tiny_llama, spec)
    alone = _make(tiny_llama, {**spec, "suffix_decoding_max_cached_requests": 0})
    want = _tokens(base, [PLAIN])
    for engine in (llm, alone):
        assert _tokens(engine, [PLAIN]) == want
    first = llm.engine.stats().spec_decoding.num_accepted_tokens
    assert llm.engine.proposer.num_cached_requests == 1 and alone.engine.proposer.num_cached_requests == 0
    for engine in (llm, alone):
        assert _tokens(engine, [PLAIN]) == want
    learned = llm.engine.stats().spec_decoding.num_accepted_tokens - first
    own = alone.engine.stats().spec_decoding.num_accepted_tokens / 2  # per run, from the sequence alone
    assert learned > own + 10, (learned, own)


def test_seeded_sampling_is_reproducible_whatever_the_shared_tree_learned(suffix: LLM) -> None:
    """A seeded request drafts from its own tokens only: the first run's output, learned by the
    shared tree in between, does not change what the same seed gives the second time."""
    p = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=3)
    first = _tokens(suffix, [REPEAT], p)
    cached = suffix.engine.proposer.num_cached_requests
    assert _tokens(suffix, [REPEAT, PLAIN], p)[:1] == first
    assert suffix.engine.proposer.num_cached_requests > cached


def _write_host(tmp_path: Path) -> Path:
    """A device file as `stoker doctor` writes it, with the roofs of a 2-core VM (0.15 TFLOP/s
    float32 matmul, 12 GB/s streaming read): the balance is what matters, ~12 FLOP per byte."""
    dev = device_file.DeviceFile(fp32_tflops=0.15, bf16_tflops=0.15, read_gb_per_s=12.0, memory_gb=16.0,
                                 cpu_model="test host", isa="avx2", threads=2, measured_at="test")
    return device_file.write_device_file(dev, tmp_path / "this-device.yaml")


def test_dynamic_k_drafts_at_batch_1_and_lowers_k_at_a_large_batch(tiny_llama: Path, base: LLM, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(device_file.ENV_VAR, str(_write_host(tmp_path)))
    llm = _make(tiny_llama, {"method": "ngram", "num_speculative_tokens": 4}, kv_cache_memory_bytes=16 << 20,
                max_num_seqs=64)
    policy = llm.engine.spec_k_policy
    assert policy is not None and policy.price is not None
    assert _tokens(llm, [REPEAT]) == _tokens(base, [REPEAT])
    at_one = dict(policy.steps_at_k)
    assert at_one.get(4, 0) > 0 and llm.engine.stats().spec_decoding.num_accepted_tokens > 0
    # 48 sequences at once: each step computes 48+ tokens of a model whose weights are read in
    # microseconds; the step is compute-bound and drafts are turned off
    many = [{"prompt_token_ids": [5 + i % 7, 6, 7, 8, 9, 10, 11] * 4} for i in range(48)]
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert _tokens(llm, many, p) == _tokens(base, many, p)
    at_many = {k: n - at_one.get(k, 0) for k, n in policy.steps_at_k.items()}
    assert at_many.get(0, 0) > 0 and at_many.get(0, 0) >= at_many.get(4, 0), at_many
    # Fixed k keeps every proposal whole
    fixed = _make(tiny_llama, {"method": "ngram", "num_speculative_tokens": 4, "dynamic": False})
    assert fixed.engine.spec_k_policy is None


def test_dynamic_without_a_cost_model_keeps_k(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(device_file.ENV_VAR, str(tmp_path / "absent.yaml"))
    llm = _make(tiny_llama, {"method": "suffix", "num_speculative_tokens": 3})
    assert llm.engine.spec_k_policy is not None and llm.engine.spec_k_policy.price is None
    _tokens(llm, [REPEAT])
    assert set(llm.engine.spec_k_policy.steps_at_k) <= {1, 2, 3} and llm.engine.spec_k_policy.steps_at_k
