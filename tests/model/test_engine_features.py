"""End-to-end engine behaviour: stops, n > 1, seeds, logprobs, detokenization, chat."""

from __future__ import annotations

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.engine.detokenizer import decode_increment, find_stop_string, new_state
from tests.model.helpers import hf_logits, load_hf


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), max_model_len=256, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        engine.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert not engine.has_unfinished_requests()


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_stop_string_across_token_boundary_is_trimmed(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    base = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0]
    pieces = [tok.decode(base.token_ids[: i + 1]) for i in range(len(base.token_ids))]
    # A stop string made of the end of one token's text and the start of the next's.
    for i in range(3, len(pieces) - 1):
        prev, nxt = pieces[i], pieces[i + 1]
        a, b = prev[-2:], nxt[len(prev) : len(prev) + 2]
        if len(a) == 2 and len(b) == 2 and "\ufffd" not in a + b and (a + b) not in prev:
            stop = a + b
            break
    else:
        pytest.skip("no clean token boundary in this sample")
    cut = base.text.index(stop)
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        "The quick brown fox",
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base.text[: cut + len(stop)]


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    base = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
    target = base.token_ids[5]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(target)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # min_tokens holds the stop token back.
    later = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[target], min_tokens=first + 2), use_tqdm=False
    )[0].outputs[0]
    assert len(later.token_ids) >= first + 2
    # Treating that token as EOS (and not ignoring it) stops there too.
    llm.engine.output_processor.eos_token_ids = (target,)
    try:
        eos = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.output_processor.eos_token_ids = (4,)
    assert eos.token_ids == base.token_ids[: first + 1] and eos.finish_reason == "stop" and eos.stop_reason is None


def test_seed_reproducible_whatever_the_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Sample me", p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True), SamplingParams(temperature=1.0, seed=9, max_tokens=5, ignore_eos=True)]
    batch = llm.generate(["Other prompt one", "Sample me", "And a third, longer prompt here"], [others[0], p, others[1]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = [llm.generate("Sample me", SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1, "unseeded requests should differ"


def test_n_completions_share_prompt_blocks(llm: LLM) -> None:
    prompt = {"prompt_token_ids": list(range(10, 60))}  # 50 tokens: 3 full blocks
    hits_before = llm.engine.block_manager.prefix_cache_hits
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.block_manager.prefix_cache_hits - hits_before >= 2 * 48


def test_reset_prefix_cache(llm: LLM) -> None:
    """A repeated prompt hits the cache; after reset_prefix_cache() it is computed again,
    with the same greedy output."""
    prompt = {"prompt_token_ids": list(range(200, 240))}  # 40 tokens: 2 full blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bm = llm.engine.block_manager
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    hits = bm.prefix_cache_hits
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert bm.prefix_cache_hits - hits == 32
    assert llm.reset_prefix_cache() is True
    hits = bm.prefix_cache_hits
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert bm.prefix_cache_hits == hits


def test_logprobs_match_hf(llm: LLM, tiny_llama) -> None:
    ids = [0, 100, 200, 300, 400]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3), use_tqdm=False)[0].outputs[0]
    hf = load_hf(tiny_llama)
    ref = torch.log_softmax(hf_logits(hf, ids + out.token_ids[:-1]), -1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - 1 + step]
        top = row.topk(3)
        assert list(entry)[:3] == top.indices.tolist()
        assert entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        total += row[token].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_prompt_too_long_gives_both_numbers(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"maximum context length is 256 tokens. However, your prompt has 300 tokens"):
        llm.generate({"prompt_token_ids": [5] * 300}, GREEDY, use_tqdm=False)


def test_generation_stops_at_max_model_len(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": [5] * 250}, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_chat_uses_the_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    expected = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert out.prompt_token_ids == expected
    assert tok.decode(out.prompt_token_ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    two = llm.chat([messages, [{"role": "user", "content": "Hi"}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_per_prompt_sampling_params_and_input_forms(llm: LLM) -> None:
    outs = llm.generate(["a", {"prompt": "b"}, {"prompt_token_ids": [0, 9]}], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    assert outs[0].prompt == "a" and outs[2].prompt_token_ids == [0, 9]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_incremental_detokenization_never_splits_utf8(tiny_llama) -> None:
    from stoker.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    text = "héllo wörld 🙂 naïve café ✓ done"
    prompt = tok.encode("Start:")
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span tokens
    state = new_state(len(prompt))
    all_ids = list(prompt)
    deltas = []
    for t in ids:
        all_ids.append(t)
        deltas.append(decode_increment(tok, all_ids[state.prefix_offset:], state, skip_special_tokens=True))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_find_stop_string_only_searches_the_tail() -> None:
    assert find_stop_string("abc STOP", 2, ["STOP"]) == (4, "STOP")
    assert find_stop_string("STOP and more", 3, ["STOP"]) is None  # matched earlier already
    assert find_stop_string("xx ab", 1, ["b", "ab"]) == (3, "ab")  # earliest start wins


def test_kv_cache_smaller_than_one_sequence_is_refused_at_build(tiny_llama) -> None:
    """Issue 20: the engine must not start when a max_model_len sequence cannot be placed."""
    with pytest.raises(ValueError, match=r"one sequence of max_model_len 256 needs 16 blocks.*--max-model-len to 240 or less"):
        LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks_override=15)
    LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks_override=16)  # exactly one fits: fine


def test_a_failing_step_fails_its_requests_not_the_engine(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20: an exception in a step aborts the requests it ran (blocks freed, nothing
    cached) and raises StepFailed; the engine then serves the next call as before."""
    from stoker.engine.llm_engine import StepFailed

    engine = llm.engine
    base = llm.generate("Hello there", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    real = engine.executor.driver_runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step, after the prompts were cached
            raise RuntimeError("planted fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.executor.driver_runner, "execute", flaky)
    with pytest.raises(StepFailed, match="planted fault") as info:
        llm.generate(["Hello there", "Another prompt"], GREEDY, use_tqdm=False)
    assert len(info.value.request_ids) == 2
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate("Hello there", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == base


def test_a_request_whose_output_processing_fails_fails_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.engine.llm_engine import StepFailed

    engine = llm.engine
    processor = engine.output_processor
    real = processor._append_text_and_check_stop

    def picky(state, seq, token, num_output):
        if state.request.prompt == "bad one":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")
        return real(state, seq, token, num_output)

    monkeypatch.setattr(processor, "_append_text_and_check_stop", picky)
    engine.add_request(engine.input_processor.process("good", "good one", GREEDY))
    engine.add_request(engine.input_processor.process("bad", "bad one", GREEDY))
    finished, failed = {}, []
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except StepFailed as exc:
            failed += exc.request_ids
            outs = exc.outputs
        finished.update({o.request_id: o for o in outs if o.finished})
    assert failed == ["bad"] and list(finished) == ["good"]
    assert len(finished["good"].outputs[0].token_ids) == GREEDY.max_tokens
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
