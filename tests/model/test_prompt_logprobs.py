"""prompt_logprobs: each prompt token's log-probability (and top n) equal to HF transformers',
through chunked prefill, beside a prefix-cache hit, with n > 1, and in small row slices."""

from __future__ import annotations

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.sampling import prompt_logprobs as plp
from tests.model.helpers import hf_logits, load_hf


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    # A small token budget: a 70-token prompt is prefilled in three chunks.
    return LLM(str(tiny_llama), max_model_len=256, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=32,
               enable_chunked_prefill=True)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return load_hf(tiny_llama)


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        engine.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 37 * i) % 500 + 3 for i in range(n)]


def _check_against_hf(hf, ids: list[int], entries: list, top_n: int) -> None:
    ref = torch.log_softmax(hf_logits(hf, ids), -1)  # (len, vocab): row p scores token p + 1
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry, row, token = entries[p], ref[p - 1], ids[p]
        assert entry is not None, f"prompt token {p} has no logprob"
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(top_n).indices.tolist() if top_n else []
        assert set(top) <= set(entry)
        assert entry[token].decoded_token is not None


def test_prompt_logprobs_match_hf_through_chunked_prefill(llm: LLM, hf) -> None:
    ids = _prompt(70)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    _check_against_hf(hf, ids, out.prompt_logprobs, 3)


def test_prompt_logprobs_zero_gives_the_prompt_token_alone(llm: LLM, hf) -> None:
    ids = _prompt(20, 5)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    _check_against_hf(hf, ids, out.prompt_logprobs, 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_a_prefix_cache_hit_still_returns_every_prompt_logprob(llm: LLM, hf) -> None:
    """The prompt is in the cache already: it is recomputed, never returned with holes."""
    ids = _prompt(48, 9)
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    hits_before = llm.engine.block_manager.prefix_cache_hits
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert llm.engine.block_manager.prefix_cache_hits == hits_before
    assert out.num_cached_tokens == 0
    _check_against_hf(hf, ids, out.prompt_logprobs, 1)


def test_n_completions_and_a_mixed_batch(llm: LLM, hf) -> None:
    a, b = _prompt(40, 1), _prompt(25, 2)
    outs = llm.generate(
        [{"prompt_token_ids": a}, {"prompt_token_ids": b}],
        [SamplingParams(n=3, seed=1, max_tokens=3, prompt_logprobs=2), SamplingParams(max_tokens=3)],
        use_tqdm=False,
    )
    _check_against_hf(hf, a, outs[0].prompt_logprobs, 2)
    assert len(outs[0].outputs) == 3
    assert outs[1].prompt_logprobs is None


def test_rows_are_scored_in_slices(llm: LLM, hf, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt never holds (prompt_len, vocab): force 3-row slices and get the same numbers."""
    calls: list[int] = []
    original = plp.score_prompt

    def spy(hidden, *args, **kwargs):
        compute = args[3]
        return original(hidden, *args[:3], lambda h: calls.append(h.shape[0]) or compute(h), *args[4:], **kwargs)

    monkeypatch.setattr(plp, "_SLICE_ELEMENTS", 3 * llm.engine.hf_config["vocab_size"])
    monkeypatch.setattr("stoker.runner.model_runner.score_prompt", spy)
    ids = _prompt(30, 4)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert calls and max(calls) == 3
    _check_against_hf(hf, ids, out.prompt_logprobs, 1)


def test_bad_prompt_logprobs_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
