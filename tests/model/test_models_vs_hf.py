"""Every supported architecture against HF transformers on tiny random checkpoints.

Two checks per configuration: prefill logits within float32 tolerance, and greedy output of
one mixed batch (lengths 1 to a few hundred, shared prefixes, chunked prefill forced by a
small token budget, preemption forced by a small KV cache) equal, prompt by prompt, to HF's
greedy path for that prompt alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from stoker import LLM, SamplingParams
from tests.model.helpers import engine_logits, hf_greedy, hf_logits, load_hf

CONFIGS = {
    "llama": ("llama", {}),
    "llama3-rope-tied-headdim": (
        "llama",
        dict(
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
            rope_theta=500000.0,
            tie_word_embeddings=True,
            head_dim=32,
        ),
    ),
    "llama-linear-rope-bias": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, attention_bias=True, mlp_bias=True, num_key_value_heads=1)),
    "mistral-sliding": ("mistral", dict(sliding_window=24)),
    "qwen2": ("qwen2", {}),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=20, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3-yarn": ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    # transformers-5 `rope_parameters`, head_dim 48 (no power of two), GELU gate, eps 1e-5.
    "llama-rope-parameters-gelu-hd48": (
        "llama",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, head_dim=48, rms_norm_eps=1e-5,
             hidden_act="gelu", num_key_value_heads=2),
    ),
    "qwen3-bias-sliding": ("qwen3", dict(attention_bias=True, use_sliding_window=True, sliding_window=12, max_window_layers=0, head_dim=24)),
    # Sizes off every CPU kernel tile: vocab and projections with partial weight panels,
    # an intermediate size the SiLU fusion cannot take, head_dim 40 (decode generic path).
    "llama-odd-sizes": (
        "llama",
        dict(hidden_size=96, intermediate_size=100, vocab_size=1000, num_attention_heads=6, num_key_value_heads=2,
             head_dim=40, tie_word_embeddings=False),
    ),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(5, 1000) for _ in range(48)]  # three full 16-token blocks
    ps = [[0]]  # length 1
    for n in (3, 17, 40, 95, 180, 300):
        ps.append([0] + [rng.randrange(5, 1000) for _ in range(n - 1)])
    ps += [shared + [rng.randrange(5, 1000) for _ in range(k)] for k in (1, 9, 33)]  # shared prefixes
    ps.append(list(shared))
    return ps


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_hf(name, tiny_checkpoints, prompts) -> None:
    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    llm = LLM(str(path), max_model_len=512, kv_cache_memory_bytes=8 << 20)
    hf = load_hf(path)
    for ids in (prompts[5], prompts[6]):
        ours = engine_logits(llm, ids)
        ref = hf_logits(hf, ids)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_mixed_batch_matches_hf_alone(name, tiny_checkpoints, prompts) -> None:
    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    # 40 blocks x 16 = 640 tokens of KV for ~1100 prompt tokens: preemption is certain;
    # a 64-token budget splits every long prompt into chunks.
    llm = LLM(str(path), max_model_len=512, block_size=16, num_gpu_blocks_override=40, max_num_batched_tokens=64)
    max_new = 12
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test should force preemption"
    assert llm.engine.block_manager.prefix_cache_hits > 0, "the test should hit the prefix cache"
    hf = load_hf(path)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, max_new), f"prompt of length {len(ids)}"
        assert out.outputs[0].finish_reason == "length"
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == 40
