"""The roofline's Mixture-of-Experts arithmetic: parameters from config.json (routed, shared
and dense-layer MLPs), active parameters, and the weight bytes a decode step reads when a
batch of B tokens touches E x (1 - (1 - k/E)^B) of a layer's E experts."""

from __future__ import annotations

import pytest

from stoker.roofline.costmodel import step_cost
from stoker.roofline.modelspec import get_model_spec, spec_from_config

# config.json of each model on the Hugging Face Hub (the fields the spec reads).
QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, vocab_size=151936, model_type="qwen3_moe", decoder_sparse_step=1,
                     mlp_only_layers=[])
QWEN15_MOE_A27B = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                       intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                       num_experts=60, num_experts_per_tok=4, vocab_size=151936, model_type="qwen2_moe")
OLMOE_1B_7B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                   intermediate_size=1024, num_experts=64, num_experts_per_tok=8, vocab_size=50304, model_type="olmoe")


@pytest.mark.parametrize(
    "config, total, active",
    [
        (QWEN3_30B_A3B, 30.5e9, 3.3e9),  # Qwen/Qwen3-30B-A3B model card: 30.5B total, 3.3B activated
        (QWEN15_MOE_A27B, 14.3e9, 2.7e9),  # Qwen/Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B activated
        (OLMOE_1B_7B, 6.9e9, 1.3e9),  # allenai/OLMoE-1B-7B-0924: 6.9B total, 1.3B active
    ],
    ids=["qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "olmoe-1b-7b"],
)
def test_total_and_active_params_match_published(config: dict, total: float, active: float) -> None:
    spec = spec_from_config(config)
    assert spec.num_params == pytest.approx(total, rel=0.01)
    assert spec.num_active_params == pytest.approx(active, rel=0.02)


def test_dense_layers_of_a_moe_config() -> None:
    base = dict(QWEN3_30B_A3B, num_hidden_layers=8)
    assert spec_from_config(base).num_sparse_layers == 8
    assert spec_from_config(dict(base, mlp_only_layers=[0, 5])).num_dense_layers == 2
    assert spec_from_config(dict(base, decoder_sparse_step=2)).num_sparse_layers == 4  # layers 1, 3, 5, 7
    assert spec_from_config(dict(base, decoder_sparse_step=2, mlp_only_layers=[1])).num_sparse_layers == 3
    # a dense layer is intermediate_size wide, an expert moe_intermediate_size
    one_dense = spec_from_config(dict(base, mlp_only_layers=[0]))
    all_sparse = spec_from_config(base)
    h = base["hidden_size"]
    assert all_sparse.num_params - one_dense.num_params == 128 * 3 * h * 768 + h * 128 - 3 * h * 6144


def test_mixtral_and_transformers_5_names() -> None:
    # Mixtral's experts are intermediate_size wide; transformers 5 writes Qwen3-MoE's count as num_local_experts.
    mixtral = get_model_spec("mixtral-8x7b")
    assert mixtral.expert_intermediate_size == 14336 and mixtral.num_sparse_layers == 32
    renamed = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert spec_from_config(renamed).num_params == spec_from_config(QWEN3_30B_A3B).num_params


@pytest.mark.parametrize("batch", [1, 2, 3, 16, 200])
def test_experts_touched_formula(batch: int) -> None:
    spec = spec_from_config(QWEN3_30B_A3B)
    e, k = 128, 8
    assert spec.experts_touched(batch) == pytest.approx(e * (1 - (1 - k / e) ** batch))
    assert k <= spec.experts_touched(batch) <= e


def test_decode_weight_bytes_grow_with_the_batch_to_the_whole_model() -> None:
    spec = spec_from_config(QWEN3_30B_A3B)
    lp, h, L = spec.layer_params, spec.hidden_size, spec.num_layers
    dense_parts = L * (lp["qkv_proj"] + lp["o_proj"] + lp["router"]) + spec.vocab_size * h  # LM head, not embedding
    per_expert = spec.expert_params
    for batch in (1, 4, 64):
        want = 2 * (dense_parts + L * spec.experts_touched(batch) * per_expert)
        assert spec.decode_weight_bytes(batch, "bf16") == pytest.approx(want)
    # B = 1 reads k experts per layer; a large batch nearly all of them
    assert spec.decode_weight_bytes(1) == pytest.approx(2 * (dense_parts + L * 8 * per_expert))
    whole_blocks = spec.weight_bytes("bf16") - 2 * (spec.vocab_size * h + spec.param_counts()["norms"])
    assert spec.decode_weight_bytes(10_000) == pytest.approx(whole_blocks, rel=1e-6)


def test_a_dense_model_reads_all_its_weights_at_every_batch() -> None:
    spec = get_model_spec("llama-3-8b")
    assert spec.decode_weight_bytes(1) == spec.decode_weight_bytes(256)


@pytest.mark.parametrize("model", ["mixtral-8x7b", "llama-3-8b"])
@pytest.mark.parametrize("batch", [1, 8, 128])
def test_the_cost_model_decode_step_reads_the_specs_bytes(model: str, batch: int) -> None:
    spec = get_model_spec(model)
    step = step_cost(spec, "h100", batch=batch, context_len=1024, weight_dtype="fp8")
    assert step.weight_bytes == pytest.approx(spec.decode_weight_bytes(batch, "fp8", rest_dtype="bf16"))


# gpt-oss-20b's config.json on the Hub (openai/gpt-oss-20b), the fields the spec reads.
GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32,
                   num_experts_per_tok=4, vocab_size=201088, attention_bias=True, tie_word_embeddings=False)
# gpt-oss-120b: the same but 36 layers of 128 experts (transformers' and vLLM's GptOssConfig
# defaults, which are gpt-oss-120b's).
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128)


@pytest.mark.parametrize("config, total, active", [(GPT_OSS_20B, 21e9, 3.6e9), (GPT_OSS_120B, 117e9, 5.1e9)],
                         ids=["gpt-oss-20b", "gpt-oss-120b"])
def test_gpt_oss_total_and_active_params_match_published(config: dict, total: float, active: float) -> None:
    """openai/gpt-oss model cards: 21B total / 3.6B active, 117B / 5.1B. OpenAI's active count
    leaves out the embedding table (a gather, not a matmul) but keeps the unembedding."""
    spec = spec_from_config(config)
    assert spec.num_params == pytest.approx(total, rel=0.01)
    assert spec.num_active_params - spec.param_counts()["embedding"] == pytest.approx(active, rel=0.02)


def test_transformers_gpt_oss_defaults_are_the_120b_config() -> None:
    """Where GPT_OSS_120B's values come from: transformers' GptOssConfig defaults."""
    from transformers import GptOssConfig

    c = GptOssConfig()
    assert {k: getattr(c, k) for k in GPT_OSS_120B if k != "model_type"} == {k: v for k, v in GPT_OSS_120B.items()
                                                                            if k != "model_type"}
