"""The Mixture-of-Experts families against HF transformers on tiny random checkpoints.

Per configuration: prefill logits within float32 tolerance; greedy output of one mixed batch
(lengths 1 to 180, shared prefixes, chunked prefill forced by a 64-token budget, prefix-cache
hits, preemption forced by a small KV cache) equal, prompt by prompt, to HF's greedy path for that prompt alone; the logprob of each
generated token within 1e-4 of HF's; the block manager whole afterwards.
"""

from __future__ import annotations


import pytest
import torch

from stoker import LLM
from tests.model.helpers import check_mixed_batch_vs_hf, engine_logits, hf_logits, load_hf, mixed_batch_prompts

MOE = dict(num_experts_per_tok=2)
CONFIGS = {
    # a dense layer among sparse ones (mlp_only_layers), renormalised top-k
    "qwen3_moe": ("qwen3_moe", dict(MOE, num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
                                    num_hidden_layers=3, mlp_only_layers=[1])),
    # every second layer sparse, weights not renormalised, k = E
    "qwen3_moe-step2-k=E": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=24,
                                              decoder_sparse_step=2, norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(MOE, num_local_experts=8, intermediate_size=32)),
    "mixtral-sliding": ("mixtral", dict(MOE, num_local_experts=4, intermediate_size=40, sliding_window=24)),
    "qwen2_moe": ("qwen2_moe", dict(MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    num_hidden_layers=3, mlp_only_layers=[0])),
    # no shared expert: transformers still writes an empty one and its gate
    "qwen2_moe-no-shared": ("qwen2_moe", dict(MOE, num_experts=4, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=0, num_hidden_layers=2)),
    "olmoe": ("olmoe", dict(MOE, num_experts=8, intermediate_size=32)),
    # grouped routing (2 of 4 groups), correction bias, scaling, 2 shared experts, a dense first
    # layer, per-head q/k norm, q/k/v biases, half the head rotated (transformers' default)
    "glm4_moe": ("glm4_moe", dict(MOE, n_routed_experts=8, n_group=4, topk_group=2, moe_intermediate_size=32,
                                  n_shared_experts=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                  use_qk_norm=True, attention_bias=True, head_dim=16, num_hidden_layers=3)),
    # GLM-4.5-Air's shape: one group, no q/k norm; here also no dense layer, weights not
    # renormalised, a quarter of the head rotated
    "glm4_moe-air": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                                      first_k_dense_replace=0, norm_topk_prob=False, attention_bias=True,
                                      partial_rotary_factor=0.25, head_dim=16)),
    # sliding (24) and full layers alternating, sinks, YaRN, biased router, clamped SwiGLU
    "gpt_oss": ("gpt_oss", dict(MOE, num_local_experts=8, intermediate_size=32, head_dim=16, sliding_window=24,
                                num_hidden_layers=3)),
    # k = E, a limit low enough that the clamps bite on most columns
    "gpt_oss-k=E-clamped": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=4, intermediate_size=24,
                                            head_dim=16, sliding_window=40, swiglu_limit=0.3)),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_batch_prompts()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_hf(name, tiny_checkpoints, prompts) -> None:
    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    llm = LLM(str(path), max_model_len=512, kv_cache_memory_bytes=8 << 20)
    hf = load_hf(path)
    for ids in (prompts[3], prompts[5]):
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_mixed_batch_matches_hf_alone(name, tiny_checkpoints, prompts) -> None:
    arch, overrides = CONFIGS[name]
    path = tiny_checkpoints(arch, **overrides)
    # 24 blocks x 16 = 384 tokens of KV for ~600: preemption is certain; a 64-token budget
    # splits every long prompt into chunks.
    check_mixed_batch_vs_hf(path, prompts, max_new=16)


def test_the_block_is_chosen_per_layer(tiny_checkpoints) -> None:
    from stoker.layers.moe import FusedMoE
    from stoker.models.llama import LlamaMLP

    arch, overrides = CONFIGS["qwen2_moe"]
    llm = LLM(str(tiny_checkpoints(arch, **overrides)), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    layers = llm.engine.executor.driver_runner.model.model.layers
    assert isinstance(layers[0].mlp, LlamaMLP)  # mlp_only_layers=[0]
    assert all(isinstance(layer.mlp.experts, FusedMoE) and layer.mlp.shared_expert is not None for layer in layers[1:])


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "glm4_moe", "gpt_oss"])
def test_the_roofline_counts_the_bytes_held(name, tiny_checkpoints, monkeypatch) -> None:
    """The model describes itself (seam 16): the spec parsed from config.json counts every
    parameter the engine holds (routers, shared expert and its gate, dense layers, q/k norms)."""
    from stoker.roofline.modelspec import spec_from_config

    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")  # no panel padding
    arch, overrides = CONFIGS[name]
    llm = LLM(str(tiny_checkpoints(arch, **overrides)), max_model_len=128, kv_cache_memory_bytes=1 << 20)
    runner = llm.engine.executor.driver_runner
    assert runner.weight_bytes_held() == spec_from_config(runner.hf_config).weight_bytes("fp32", rest_dtype="fp32")
