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


# ---- MoE presets (issue 33): published totals, actives and checkpoint sizes -----------------------
@pytest.mark.parametrize(
    "name, total, active, embedding_counted",
    [
        ("mixtral-8x7b", 46.7e9, 12.9e9, True),  # Mistral: 46.7B total, 12.9B active
        ("qwen3-30b-a3b", 30.5e9, 3.3e9, True),  # model card: 30.5B total, 3.3B activated
        ("qwen3-235b-a22b", 235e9, 22e9, True),  # model card: 235B total, 22B activated
        # gpt-oss model card (arXiv 2508.10925) Table 1: 20.91B / 3.61B and 116.83B / 5.13B; its
        # active count leaves out the input embedding (a gather), so ours is compared without it.
        ("gpt-oss-20b", 20.91e9, 3.61e9, False),
        ("gpt-oss-120b", 116.83e9, 5.13e9, False),
    ],
)
def test_moe_presets_match_their_published_sizes(name: str, total: float, active: float,
                                                 embedding_counted: bool) -> None:
    spec = get_model_spec(name)
    assert spec.is_moe
    assert spec.num_params == pytest.approx(total, rel=0.01)
    act = spec.num_active_params - (0 if embedding_counted else spec.param_counts()["embedding"])
    assert act == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("name, gib", [("gpt-oss-20b", 12.8), ("gpt-oss-120b", 60.8)])
def test_gpt_oss_mxfp4_experts_give_the_published_checkpoint_size(name: str, gib: float) -> None:
    # Experts at 4.25 bits (MXFP4: 4-bit values + one E8M0 scale per 32), the rest bf16: the model
    # card's checkpoint sizes (12.8 GiB and 60.8 GiB) within 1%.
    spec = get_model_spec(name)
    assert spec.expert_dtype == "mxfp4"
    assert spec.expert_bytes_per_param("bf16") == 4.25 / 8
    assert spec.weight_bytes("bf16") / 2**30 == pytest.approx(gib, rel=0.01)
    # An fp8 request quantizes what is not already MXFP4; the experts keep their 4.25 bits.
    c = spec.param_counts()
    assert spec.weight_bytes("bf16") - spec.weight_bytes("fp8") == pytest.approx(
        (c["attention"] + c["mlp"]) * 1.0 - (spec.projection_rows - c["experts"] // spec.hidden_size) * 4.0)


def test_gpt_oss_sliding_layers_hold_at_most_the_window() -> None:
    spec = get_model_spec("gpt-oss-120b")
    assert (spec.num_sliding_layers, spec.sliding_window, spec.num_layers) == (18, 128, 36)
    per_token = spec.kv_bytes_per_token("bf16")
    assert per_token == 2 * 36 * 8 * 64 * 2
    assert spec.kv_bytes_per_seq(100) == pytest.approx(100 * per_token)  # under the window: every layer
    # 8192 tokens: 18 full layers hold 8192, 18 sliding layers 128.
    assert spec.kv_bytes_per_seq(8192) == pytest.approx(per_token * (18 * 8192 + 18 * 128) / 36)
    # Attention FLOPs follow the same cap; a model without a window is unchanged.
    f = spec.flops_per_token(8192)["attention"]
    assert f == pytest.approx(4 * 36 * spec.q_dim * (8192 + 128) / 2)
    llama = get_model_spec("llama-3-8b")
    assert llama.kv_bytes_per_seq(8192) == 8192 * llama.kv_bytes_per_token()


def test_decode_step_reads_window_capped_kv() -> None:
    spec = get_model_spec("gpt-oss-120b")
    step = step_cost(spec, "h100", batch=16, context_len=8192)
    assert step.kv_bytes == pytest.approx(16 * spec.kv_bytes_per_seq(8192))
    assert step.weight_bytes == pytest.approx(spec.decode_weight_bytes(16, "bf16"))


# ---- expert parallelism -----------------------------------------------------------------------------
def test_experts_per_rank_is_the_busiest_ranks_share() -> None:
    from stoker.roofline.costmodel import experts_per_rank

    spec = get_model_spec("qwen3-235b-a22b")  # 128 experts, 8 per token
    assert experts_per_rank(spec, 4, 1) == pytest.approx(spec.experts_touched(4))
    for b in (1, 8, 64):
        busiest = experts_per_rank(spec, b, 8)
        # at least the mean share, at most a rank's 16 experts
        assert spec.experts_touched(b) / 8 <= busiest <= 16
    assert experts_per_rank(spec, 4096, 8) == pytest.approx(16, rel=1e-6)  # every expert touched
    # A lone token's 8 experts land on ~2.5 of 8 ranks' busiest, not the mean 1.
    assert 2 < experts_per_rank(spec, 1, 8) < 3


def test_tp_replicated_ep_reads_only_each_ranks_experts() -> None:
    spec = get_model_spec("qwen3-235b-a22b")
    kw = dict(context_len=2048, weight_dtype="fp8", tp=8)
    for b in (1, 16, 512):
        cut = step_cost(spec, "H100", batch=b, **kw)
        ep = step_cost(spec, "H100", batch=b, ep=8, **kw)
        lp = spec.layer_params
        dense = (spec.num_layers * (lp["qkv_proj"] + lp["o_proj"])) / 8 + spec.vocab_size * spec.hidden_size * 2 / 8 \
            + spec.num_sparse_layers * lp["router"] * 2 / 8
        from stoker.roofline.costmodel import experts_per_rank
        experts = spec.num_sparse_layers * experts_per_rank(spec, b, 8) * spec.expert_params  # fp8: 1 B each
        assert ep.weight_bytes == pytest.approx(dense + experts)
        # The same all-reduces as TP (the combine rides them), and never fewer bytes than the TP cut.
        assert [o.bytes for o in ep.ops if o.op_class == "comm"] == [o.bytes for o in cut.ops if o.op_class == "comm"]
        assert ep.weight_bytes >= cut.weight_bytes * (1 - 1e-9)
    # At a large batch every rank touches all its experts: EP and the TP cut read the same bytes.
    assert step_cost(spec, "H100", batch=4096, ep=8, **kw).weight_bytes == pytest.approx(
        step_cost(spec, "H100", batch=4096, **kw).weight_bytes)


def test_dp_attention_ep_prices_the_all_to_all() -> None:
    from stoker.roofline.collectives import collective_time
    from stoker.roofline.hardware import get_gpu

    spec = get_model_spec("qwen3-235b-a22b")
    step = step_cost(spec, "H100", batch=32, context_len=1024, weight_dtype="fp8", ep=8, moe_scheme="dp_attention")
    comm = [o for o in step.ops if o.op_class == "comm"]
    assert [o.name for o in comm] == ["all_to_all"]  # no TP all-reduce: attention is replicated
    size = 32 * 8 * spec.hidden_size * 2  # a rank's tokens x k x hidden x bf16
    assert comm[0].bytes == pytest.approx(2 * spec.num_sparse_layers * size)
    from stoker.roofline.profiles import KERNEL
    a2a = collective_time("all_to_all", size, 8, get_gpu("H100").link, efficiency=KERNEL.comm)
    assert comm[0].time_s == pytest.approx(2 * spec.num_sparse_layers * (a2a.time_s + KERNEL.comm_latency_s))
    # The experts see all 8 ranks' tokens: 256 tokens touch nearly every expert.
    assert step.weight_bytes > spec.num_layers * (spec.layer_params["qkv_proj"] + spec.layer_params["o_proj"])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(tp=8, ep=4), "must equal tp"),
        (dict(tp=2, ep=2, moe_scheme="dp_attention"), "tp must be 1"),
        (dict(tp=1, ep=3, moe_scheme="dp_attention"), "does not divide"),
        (dict(tp=8, ep=8, moe_scheme="alltoall"), "moe_scheme"),
    ],
)
def test_ep_layouts_that_do_not_exist_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        step_cost("qwen3-235b-a22b", "H100", batch=8, **kw)
    with pytest.raises(ValueError, match="no experts"):
        step_cost("llama-3-70b", "H100", batch=8, tp=8, ep=8)


def test_kv_capacity_counts_window_layers_at_their_window() -> None:
    import dataclasses
    import math

    from stoker.roofline.kvcapacity import kv_capacity

    cap = kv_capacity("gpt-oss-120b", "H200")
    assert (cap.sliding_window, cap.sliding_share) == (128, 0.5)
    blocks = cap.num_blocks
    # 8192 tokens: 512 blocks on the 18 full layers, 8 on the 18 window layers -> 260 on average.
    assert cap.max_seqs(8192) == math.floor(blocks / 260)
    no_window = dataclasses.replace(cap, sliding_share=0.0)
    assert no_window.max_seqs(8192) == blocks // 512 < cap.max_seqs(8192)
    assert cap.max_seqs(100) == no_window.max_seqs(100)  # under the window both hold every token


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
