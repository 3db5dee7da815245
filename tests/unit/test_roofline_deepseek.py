"""DeepSeek-V3 / Kimi-K2 on the wall: the latent KV the engine holds, FP8 as shipped, EP sizing, and the
published DeepSeek points (roofline/ep_sizing.py, published_deepseek.DEEPSEEK_POINTS)."""

from __future__ import annotations

import pytest

from stoker.cli import main
from stoker.config import KVCacheSpec
from stoker.roofline import published, published_deepseek
from stoker.roofline.collectives import collective_time
from stoker.roofline.costmodel import experts_per_rank, step_cost
from stoker.roofline.ep_sizing import ep_layouts, ep_weight_bytes
from stoker.roofline.hardware import get_link
from stoker.roofline.modelspec import get_model_spec
from stoker.roofline.planner import PlanTargets, plan, serve_command, servable_kv_dtypes, servable_weight_dtypes
from stoker.roofline.profiles import ENGINE

T = PlanTargets(target_tokens_per_s=20000, ttft_p50_ms=3000, tpot_ms=100, prompt_len=2000, output_len=500, max_gpus=64)


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "deepseek-r1"])
def test_kv_bytes_per_token_are_the_engines_latent(name: str) -> None:
    m = get_model_spec(name)
    # (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes, as the engine's KVCacheSpec(kv_tensors=1) holds it.
    assert m.kv_bytes_per_token("bf16") == (512 + 64) * 61 * 2 == 70272
    engine = KVCacheSpec(m.num_layers, 1, m.kv_lora_rank + m.qk_rope_head_dim, "bfloat16", kv_tensors=1)
    assert engine.bytes_per_token == m.kv_bytes_per_token("bf16") == m.kv_bytes_per_token("bf16", tp=8)


def test_shipped_fp8_and_bf16_latent_are_what_a_plan_searches() -> None:
    m = get_model_spec("deepseek-v3")
    assert m.checkpoint_dtype == "fp8" and servable_weight_dtypes(m) == ("fp8",) and servable_kv_dtypes(m) == ("bf16",)
    assert m.weight_bytes("fp8") / 1e9 == pytest.approx(680, rel=0.02)  # 671B, embeddings and head in bf16
    h200 = plan(m, "H200", T)
    assert h200.feasible and all(c.tp == 8 and c.weight_dtype == "fp8" and c.kv_dtype == "bf16" for c in h200.feasible)
    line = serve_command("deepseek-v3", h200.feasible[0])
    assert "--quantization" not in line and "--kv-cache-dtype" not in line and "--tensor-parallel-size 8" in line
    h100 = plan(m, "H100", T)
    assert not h100.feasible and any("weights" in r.reason for r in h100.rejected if r.tp == 8)


def test_ep_weights_split_only_the_routed_experts() -> None:
    m = get_model_spec("deepseek-v3")
    whole = m.weight_bytes("fp8")
    assert ep_weight_bytes(m, "fp8", 1) == pytest.approx(whole)
    experts = m.param_counts()["experts"]
    assert whole - ep_weight_bytes(m, "fp8", 16) == pytest.approx(experts * 15 / 16)


def test_deepseek_on_h100_needs_two_nodes_and_on_h200_fits_one() -> None:
    h100 = {x.ep: x for x in ep_layouts("deepseek-v3", "H100", T, ep_sizes=(8, 16, 32))}
    assert not h100[8].max_batch and "no KV" in h100[8].reason
    assert h100[16].max_batch and h100[16].link == "ib-ndr" and h100[16].gpus % 16 == 0
    assert h100[32].kv_tokens_per_gpu > h100[16].kv_tokens_per_gpu  # fewer experts per GPU, more room for KV
    h200 = {x.ep: x for x in ep_layouts("deepseek-v3", "H200", T, ep_sizes=(8,))}
    assert h200[8].max_batch and h200[8].link == "nvlink4"
    x = h100[16]
    # Dispatch and combine per sparse layer: batch x k x hidden x bf16 each way.
    assert x.all_to_all_mb_per_step == pytest.approx(2 * 58 * x.max_batch * 8 * 7168 * 2 / 1e6)
    assert x.tokens_per_s_per_gpu == pytest.approx(x.max_batch / (x.itl_ms / 1e3))


def test_mla_prefill_is_priced_expanded_and_decode_absorbed() -> None:
    m = get_model_spec("deepseek-v3")
    ctx = 1000
    assert m.flops_per_token(ctx)["attention"] == 61 * 2 * 128 * (512 + 576) * ctx
    assert m.flops_per_token(ctx, absorbed=False)["attention"] == 61 * 2 * 128 * (128 + 64 + 128) * ctx
    dense = get_model_spec("llama-3-8b")
    assert dense.flops_per_token(ctx) == dense.flops_per_token(ctx, absorbed=False)


def test_redundant_experts_make_ep72_a_layout() -> None:
    m = get_model_spec("deepseek-v3")
    with pytest.raises(ValueError, match="does not divide"):
        step_cost(m, "H100", batch=8, weight_dtype="fp8", ep=72, moe_scheme="dp_attention", link="ib-ndr")
    assert experts_per_rank(m, 256 * 72, 72, redundant=32) == pytest.approx(4.0)
    step = step_cost(m, "H100", batch=8, weight_dtype="fp8", ep=72, moe_scheme="dp_attention", link="ib-ndr",
                     redundant_experts=32)
    assert any(o.name == "all_to_all" for o in step.ops)


def test_all_to_all_waits_one_step_not_a_ring() -> None:
    ib = get_link("ib-ndr")
    small = [collective_time("all_to_all", 1024, n, ib).time_s for n in (8, 72)]
    assert small[1] == pytest.approx(small[0], rel=0.02)  # latency-bound: no n - 1 serial hops


def test_two_batch_overlap_hides_the_all_to_all_under_compute() -> None:
    kw = dict(batch=256, context_len=2000, weight_dtype="fp8", ep=72, moe_scheme="dp_attention", link="ib-ndr",
              redundant_experts=32, eff=ENGINE)
    plain, tbo = step_cost("deepseek-v3", "H100", **kw), step_cost("deepseek-v3", "H100", overlap_comm=True, **kw)
    names = [o.name for o in plain.ops]
    a2a = plain.ops[names.index("all_to_all")].time_s
    work = sum(o.time_s for o in plain.ops[: names.index("all_to_all")])  # the matmuls and attention before it
    gaps = plain.step_time_s - work - a2a
    assert a2a > work  # DeepSeek's decode at EP72 waits on the network
    assert tbo.step_time_s == pytest.approx(max(work, a2a) + gaps)


def test_published_deepseek_points_predicted_or_explained() -> None:
    pts = published_deepseek.DEEPSEEK_POINTS
    assert {p.source for p in pts} == {published_deepseek.SGLANG_LARGE_EP, published_deepseek.TRT_B200_MIN_LATENCY}
    for p in pts:
        r = published.speed_ratio(p, ENGINE)
        assert abs(r - 1) <= 0.25 or p.note, f"{p.label}: ratio {r:.2f} with no explanation"
    decode = next(p for p in pts if p.kind == "decode" and p.ep == 72)
    assert decode.measured == pytest.approx(22282 / 8)  # the blog's per-node figure, per GPU
    assert abs(published.speed_ratio(decode, ENGINE) - 1) <= 0.25
    assert published.ceiling_ratio(decode) >= 1.0


def test_plan_prints_the_ep_layouts(capsys) -> None:
    assert main(["plan", "--model", "deepseek-v3", "--gpu", "H100", "--target-tokens-per-s", "20000", "--tpot-ms", "100",
                 "--prompt-len", "2000", "--output-len", "500", "--max-gpus", "64", "--ep", "8,16,32"]) == 0
    out = capsys.readouterr().out
    assert "expert-parallel layouts" in out and "70,272 B/token" in out and "leave no KV" in out
