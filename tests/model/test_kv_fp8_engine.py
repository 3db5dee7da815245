"""The FP8 KV cache through the engine: the block count it buys, and the engine's features
(prefix caching, chunked prefill, preemption, n > 1, seeded sampling) giving the same outputs
with it as an FP8 engine that needs none of them. Storing is element-wise, so a token's cached
bytes do not depend on how its prompt was split or recomputed, and the C kernels are
batch-invariant (issue 12): the tokens must be equal. Logprobs agree to 1e-4, not bit for bit:
a preempted sequence's recompute runs its generated tokens through the prefill kernel where
they first went through the decode kernel (last-digit differences, the float32 cache shows
them too)."""

from __future__ import annotations

import random

import pytest
import torch

from stoker import LLM, SamplingParams


def test_fp8_quadruples_the_blocks_of_a_float32_cache(tiny_llama) -> None:
    budget = 4 << 20
    auto = LLM(str(tiny_llama), kv_cache_memory_bytes=budget, device="cpu")
    fp8 = LLM(str(tiny_llama), kv_cache_memory_bytes=budget, device="cpu", kv_cache_dtype="fp8")
    assert fp8.engine.block_manager.num_blocks == 4 * auto.engine.block_manager.num_blocks
    assert fp8.engine.executor.driver_runner.kv_spec.bytes_per_token * 4 == auto.engine.executor.driver_runner.kv_spec.bytes_per_token
    k, v = fp8.engine.executor.driver_runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.float8_e4m3fn
    assert k.numel() * k.element_size() * 2 * len(fp8.engine.executor.driver_runner.kv_caches) <= budget


def test_fp8_e5m2_and_unknown_cache_dtypes_are_refused(tiny_llama) -> None:
    with pytest.raises(ValueError, match="E5M2 caches are not supported"):
        LLM(str(tiny_llama), device="cpu", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not supported; choose one of auto, fp8, fp8_e4m3"):
        LLM(str(tiny_llama), device="cpu", kv_cache_dtype="int4")


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(5, 1000) for _ in range(48)]
    prompts = [[0] + [rng.randrange(5, 1000) for _ in range(n)] for n in (5, 60, 130, 200)]
    prompts += [shared + [rng.randrange(5, 1000) for _ in range(k)] for k in (3, 20, 41)]
    return prompts


def _run(llm: LLM, prompts: list[list[int]]):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, ignore_eos=True, seed=11, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], seeded, use_tqdm=False)
    llm.engine.check_integrity()
    return [[(c.token_ids, [next(iter(lp.values())).logprob for lp in c.logprobs or []]) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_prefix_caching_chunked_prefill_and_preemption_with_fp8_kv(tiny_llama, workload, quantization) -> None:
    plain = LLM(str(tiny_llama), device="cpu", kv_cache_dtype="fp8", quantization=quantization, max_model_len=512,
                kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False, enable_chunked_prefill=False)
    stressed = LLM(str(tiny_llama), device="cpu", kv_cache_dtype="fp8", quantization=quantization, max_model_len=512,
                   num_gpu_blocks_override=40, max_num_batched_tokens=64, max_num_seqs=8)
    expected = _run(plain, workload)
    got = _run(stressed, workload)
    stats = stressed.engine.stats()
    assert stats.num_preemptions > 0, "the small cache should force preemption"
    assert stressed.engine.block_manager.prefix_cache_hits > 0, "the shared prefix should hit the cache"
    assert [[c[0] for c in o] for o in got] == [[c[0] for c in o] for o in expected]
    for o_got, o_exp in zip(got, expected):
        for (_, lp_got), (_, lp_exp) in zip(o_got, o_exp):
            torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_exp), rtol=0, atol=1e-4)


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"])
def test_weight_bytes_held_are_the_roofline_s(tiny_llama, quantization) -> None:
    """The engine's weight bytes and the planner's come from one formula (ModelSpec.weight_bytes):
    projections in the quantized dtype plus one float32 scale per row, the rest float32."""
    from stoker.roofline.modelspec import spec_from_config

    llm = LLM(str(tiny_llama), device="cpu", quantization=quantization, kv_cache_memory_bytes=4 << 20)
    predicted = spec_from_config(llm.engine.hf_config).weight_bytes(quantization or "float32", rest_dtype="float32")
    held = llm.engine.executor.driver_runner.weight_bytes_held()
    assert abs(held - predicted) / predicted < 0.005, (held, predicted)
    if quantization:
        float_bytes = spec_from_config(llm.engine.hf_config).weight_bytes("float32", rest_dtype="float32")
        assert predicted < float_bytes
