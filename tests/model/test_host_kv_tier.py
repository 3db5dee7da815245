"""The host KV tier through the engine (--kv-offloading-size; docs/kv_offloading.md): a prefix
evicted from a tiny device cache comes back from host memory bit for bit; a multi-turn chat
whose prefix the device cache cannot keep hits the host tier and answers as an engine without
it does, under preemption, chunked prefill and LoRA; what the tier cannot honour is refused."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from stoker import LLM, LoRARequest, SamplingParams
from stoker.core.sequence import Sequence
from tests.model.helpers import make_adapter

MIB = 1 / 1024  # GiB: 128 host blocks of the tiny llama's 8 KiB (16 tokens x 512 bytes)
TOP5 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 1000) for _ in range(n)]


def _top(out) -> list[list[tuple[int, float]]]:
    """Each generated position's top-5 (token, logprob), exactly as the engine returned them."""
    return [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in out.outputs[0].logprobs]


def _idle(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.host_kv.is_idle


def _prefix_kv(llm: LLM, prompt: list[int]) -> list[torch.Tensor]:
    """K and V of every layer over the device blocks caching prompt's prefix."""
    engine = llm.engine
    blocks = engine.block_manager.find_cached_prefix(Sequence("probe", prompt, TOP5))
    caches = engine.executor.driver_runner.kv_caches
    return [t[blocks].clone() for kv in caches for t in kv if t.numel()]


@pytest.mark.parametrize("arch, kv_cache_dtype", [("llama", "auto"), ("llama", "fp8"), ("deepseek_v2", "auto")])
def test_an_evicted_prefix_comes_back_bit_identical(tiny_checkpoints, arch: str, kv_cache_dtype: str) -> None:
    overrides = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=None,
                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     num_hidden_layers=2) if arch == "deepseek_v2" else {}
    path = tiny_checkpoints(arch, **overrides)
    llm = LLM(str(path), max_model_len=256, num_gpu_blocks_override=16, kv_cache_dtype=kv_cache_dtype,
              kv_offloading_size=MIB)
    rng = random.Random(1)
    a, b = _rand(rng, 150), _rand(rng, 200)
    first = llm.generate({"prompt_token_ids": a}, TOP5, use_tqdm=False)[0]  # computed whole
    kv = _prefix_kv(llm, a)
    assert len(kv) and kv[0].shape[0] == 9
    llm.generate({"prompt_token_ids": b}, TOP5, use_tqdm=False)  # needs 13 of the 16 blocks: evicts a's
    assert len(llm.engine.block_manager.find_cached_prefix(Sequence("probe", a, TOP5))) < 9  # gone from the device
    again = llm.generate({"prompt_token_ids": a}, TOP5, use_tqdm=False)[0]
    stats = llm.engine.stats().host_kv
    assert stats.hit_blocks > 0 and stats.loaded_blocks == stats.hit_blocks, "the evicted prefix should come from host memory"
    assert again.num_cached_tokens == 144  # device hit + host hit: all 9 full blocks
    assert _top(again) == _top(first)  # bit for bit: loaded K/V are the computed K/V
    for got, want in zip(_prefix_kv(llm, a), kv):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    _idle(llm)


def _chat(llm: LLM, turns: int, seed: int, noise: bool = True) -> tuple[list[list[int]], list[list[float]]]:
    """A conversation whose every turn sends the whole history plus a new user message, with an
    unrelated request between turns (another user) that pushes the history out of the device."""
    rng = random.Random(seed)
    history: list[int] = _rand(rng, 40)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    tokens, logprobs = [], []
    for _ in range(turns):
        history += _rand(rng, 12)
        out = llm.generate({"prompt_token_ids": history}, params, use_tqdm=False)[0].outputs[0]
        tokens.append(out.token_ids)
        logprobs.append([next(iter(lp.values())).logprob for lp in out.logprobs])
        history += out.token_ids
        if noise:
            llm.generate({"prompt_token_ids": _rand(rng, 180)}, params, use_tqdm=False)
    return tokens, logprobs


def test_a_multi_turn_chat_hits_the_host_tier_and_answers_the_same(tiny_llama) -> None:
    plain = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks_override=16)
    tiered = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks_override=16, kv_offloading_size=MIB)
    want_tokens, want_lp = _chat(plain, 4, seed=4)
    got_tokens, got_lp = _chat(tiered, 4, seed=4)
    assert got_tokens == want_tokens
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=0, atol=1e-5)
    stats = tiered.engine.stats()
    assert stats.host_kv.hit_tokens > 0, "the history evicted between turns never came back from host memory"
    # the tiers count apart: the device hits are vllm:prefix_cache_hits, the host's external
    assert stats.host_kv.hit_tokens == 16 * stats.host_kv.hit_blocks
    assert stats.prefix_cache_hits < plain.engine.stats().prefix_cache_hits + stats.host_kv.hit_tokens
    assert tiered.engine.stats().prompt_tokens < plain.engine.stats().prompt_tokens  # fewer computed
    _idle(tiered)


def test_preemption_and_chunked_prefill_with_host_hits(tiny_llama) -> None:
    """Conversations sharing history, all at once on a cache too small for them (preemption),
    with a 32-token step (chunked prefill, host loads at admission of a chunked prompt)."""
    rng = random.Random(7)
    shared = _rand(rng, 70)
    prompts = [shared + _rand(rng, k) for k in (5, 30, 61, 90)] + [_rand(rng, 100)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    plain = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks_override=64)
    want = [o.outputs[0] for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks_override=16, max_num_batched_tokens=32,
              kv_offloading_size=MIB)
    for _ in range(2):  # the second round finds the first's prefixes in host memory
        got = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            lp = lambda c: [next(iter(x.values())).logprob for x in c.logprobs]  # noqa: E731
            torch.testing.assert_close(torch.tensor(lp(g)), torch.tensor(lp(w)), rtol=0, atol=1e-4)
        _idle(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the small cache should force preemption"
    assert stats.host_kv.hit_blocks > 0 and stats.host_kv.saved_blocks > 0


def test_lora_adapters_never_share_host_blocks(tiny_llama, tmp_path: Path) -> None:
    adapters = {n: LoRARequest(n, i + 1, str(make_adapter(tiny_llama, tmp_path / n, ["q_proj", "k_proj", "v_proj"],
                                                          8, seed=20 + i))) for i, n in enumerate(("a", "b"))}
    kw = dict(max_model_len=256, num_gpu_blocks_override=16, enable_lora=True, max_lora_rank=8)
    plain = LLM(str(tiny_llama), **kw)
    llm = LLM(str(tiny_llama), kv_offloading_size=MIB, **kw)
    rng = random.Random(9)
    prompt, noise = _rand(rng, 150), _rand(rng, 200)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(engine: LLM, lora: str | None) -> list[int]:
        req = adapters[lora] if lora else None
        return engine.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False, lora_request=req)[0].outputs[0].token_ids

    want = {name: run(plain, name) for name in ("a", "b", None)}
    assert len({tuple(t) for t in want.values()}) == 3
    run(llm, "a")
    llm.generate({"prompt_token_ids": noise}, greedy, use_tqdm=False)  # a's blocks go to host memory
    hits = llm.engine.stats().host_kv.hit_blocks
    assert run(llm, "b") == want["b"] and run(llm, None) == want[None]
    assert llm.engine.stats().host_kv.hit_blocks == hits, "another adapter (or the base model) hit a's host blocks"
    llm.generate({"prompt_token_ids": noise}, greedy, use_tqdm=False)
    assert run(llm, "a") == want["a"]
    assert llm.engine.stats().host_kv.hit_blocks > hits, "a's own prefix should come back from host memory"
    _idle(llm)


def test_reset_prefix_cache_forgets_the_host_tier_too(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks_override=16, kv_offloading_size=MIB)
    rng = random.Random(2)
    a = _rand(rng, 150)
    llm.generate({"prompt_token_ids": a}, TOP5, use_tqdm=False)
    llm.generate({"prompt_token_ids": _rand(rng, 200)}, TOP5, use_tqdm=False)
    assert llm.engine.host_kv.entries
    llm.reset_prefix_cache()
    assert not llm.engine.host_kv.entries
    assert llm.generate({"prompt_token_ids": a}, TOP5, use_tqdm=False)[0].num_cached_tokens == 0
    _idle(llm)


def test_what_the_tier_cannot_honour_is_refused(tiny_llama) -> None:
    with pytest.raises(ValueError, match="kv_offloading_backend 'lmcache' is not supported; the only backend is 'native'"):
        LLM(str(tiny_llama), kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="must be positive"):
        LLM(str(tiny_llama), kv_offloading_size=0)
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(str(tiny_llama), kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no KV block: one block is 8192 bytes"):
        LLM(str(tiny_llama), kv_offloading_size=1e-7, num_gpu_blocks_override=16, max_model_len=256)


def test_the_step_message_carries_the_copies_to_every_rank() -> None:
    from stoker.core.step import SeqStep, StepMessage

    step = StepMessage([SeqStep(1, [1], 0, [0], True)], kv_host_saves=((3, 0),), kv_host_loads=((0, 5),))
    assert step.for_workers().kv_host_saves == ((3, 0),) and step.for_workers().kv_host_loads == ((0, 5),)


def test_a_runner_without_the_tier_refuses_host_copies(tiny_llama) -> None:
    from stoker.core.step import SampleSpec, SeqStep, StepMessage

    llm = LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    runner = llm.engine.executor.driver_runner
    step = StepMessage([SeqStep(-3, [1], 0, [0], True)], {-3: SampleSpec(TOP5, 0, 0)}, kv_host_loads=((0, 1),))
    with pytest.raises(ValueError, match="no host tier"):
        runner.execute(step)
    tiered = LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=1 << 20, kv_offloading_size=MIB)
    with pytest.raises(ValueError, match="outside"):
        tiered.engine.executor.driver_runner.execute(
            StepMessage([SeqStep(-3, [1], 0, [0], True)], {-3: SampleSpec(TOP5, 0, 0)}, kv_host_loads=((10**6, 1),)))


def test_host_copies_coalesce_runs_and_copy_any_pairs() -> None:
    from stoker.config import KVCacheSpec
    from stoker.runner.host_kv_cache import HostKVCache, _runs

    assert _runs(((3, 0), (4, 1), (5, 2), (9, 3), (1, 7), (2, 8), (2, 9))) == [(3, 0, 3), (9, 3, 1), (1, 7, 2), (2, 9, 1)]
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
    host = HostKVCache(6, 4, spec, 2, torch.float32, torch.device("cpu"))
    device = [(torch.randn(10, 4, 2, 8), torch.randn(10, 4, 2, 8)) for _ in range(2)]
    saves = ((7, 2), (8, 3), (0, 5), (4, 0))
    loads = ((2, 1), (5, 6), (0, 9), (3, 2))
    want = [(k.clone(), v.clone()) for k, v in device]
    host.run(device, saves, loads)
    saved = {slot: block for block, slot in saves}
    for (k, v), (wk, wv) in zip(device, want):
        for slot, block in loads:
            assert torch.equal(k[block], wk[saved[slot]]) and torch.equal(v[block], wv[saved[slot]])
