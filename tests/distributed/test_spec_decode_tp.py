"""Speculative decoding under tensor parallelism on CPU over gloo: the step message carries the
drafts to every rank, every rank runs the 1 + k token verify chunk on its shard, rank 0 verifies.
Greedy tokens equal TP=1's (with and without drafts) while drafts fire and are accepted, and a
seeded sampled request gives TP=1's tokens too."""

from __future__ import annotations

from pathlib import Path

from stoker import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1, "dynamic": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "dynamic": False}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 6, list(range(40, 75)), [300, 301, 302] * 10 + [7, 8]]
PARAMS = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=32, temperature=0.8, seed=11, ignore_eos=True)]


def _run(path: Path, spec: dict | None, tp: int) -> tuple[list[list[int]], int]:
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 22, max_model_len=256, device="cpu", tensor_parallel_size=tp,
              speculative_config=spec)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        llm.engine.check_integrity()
        sd = llm.engine.stats().spec_decoding
        return [o.outputs[0].token_ids for o in outs], (sd.num_accepted_tokens if sd is not None else 0)
    finally:
        llm.shutdown()


def test_tp2_speculative_greedy_equals_tp1(tiny_checkpoints) -> None:
    path = tiny_checkpoints("llama")
    plain, _ = _run(path, None, 1)
    ngram1, accepted1 = _run(path, NGRAM, 1)
    ngram2, accepted2 = _run(path, NGRAM, 2)
    assert ngram2[:2] == ngram1[:2] == plain[:2]  # greedy rows: exactly the tokens without drafts
    assert ngram2[2] == ngram1[2]  # the seeded sampled row: TP=1's tokens with the same drafts
    assert accepted2 == accepted1 > 0
    suffix2, accepted = _run(path, SUFFIX, 2)
    assert suffix2[:2] == plain[:2] and accepted > 0
