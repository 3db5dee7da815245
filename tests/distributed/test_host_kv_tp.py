"""The host KV tier under tensor parallelism on CPU over gloo: every rank saves and loads its own
shard of each block (the step message carries the copies to all), and TP=2 with the tier gives
TP=1's tokens with a prefix that came back from host memory."""

from __future__ import annotations

import random

from stoker import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


def test_tp2_host_hits_give_tp1_tokens(tiny_llama) -> None:
    rng = random.Random(3)
    a, b = [rng.randrange(5, 1000) for _ in range(150)], [rng.randrange(5, 1000) for _ in range(200)]
    prompts = [a, b, a]
    plain = LLM(str(tiny_llama), max_model_len=256, device="cpu", kv_cache_memory_bytes=1 << 22)
    want = [plain.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0] for p in prompts]
    llm = LLM(str(tiny_llama), max_model_len=256, device="cpu", num_gpu_blocks_override=16, tensor_parallel_size=2,
              kv_offloading_size=1 / 1024)
    try:
        got = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0] for p in prompts]
        host = llm.engine.stats().host_kv
        assert host.hit_blocks > 0, "the evicted prefix should come back from host memory"
        assert llm.engine.host_kv.num_blocks == 128  # 1 MiB over 2 ranks: 512 KiB each of 4 KiB shards
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            for x, y in zip(g.logprobs, w.logprobs):
                assert abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) < 1e-4
        llm.engine.check_integrity()
        assert llm.engine.host_kv.is_idle
    finally:
        llm.shutdown()
