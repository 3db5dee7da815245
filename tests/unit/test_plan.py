"""Planner: the running example is feasible with no more GPUs than brute force finds; infeasible
targets come back as such, with a reason per family."""

from __future__ import annotations

import json
import math

from stoker.roofline.hardware import get_gpu
from stoker.roofline.kvcapacity import kv_capacity
from stoker.roofline.modelspec import get_model_spec
import pytest

from stoker.roofline.planner import (
    BATCHES,
    SERVABLE_WEIGHT_DTYPES,
    PlanTargets,
    plan,
    serve_command,
    servable_weight_dtypes,
    serving_times,
)
from stoker.roofline.profiles import ENGINE

# The running example (docs/walkthrough.md): Llama-3-70B chat on H100s, 2000 output tokens/s,
# 1024-token prompts, 256-token answers, first token within 1 s.
TARGETS = PlanTargets(2000, ttft_p50_ms=1000, prompt_len=1024, output_len=256, max_gpus=8)


def _brute_force_min_gpus(t: PlanTargets, model: str = "llama-3-70b", gpu: str = "H100") -> int | None:
    """Every dtype x KV dtype x TP x batch x replicas, each point's KV capacity and times taken
    from kvcapacity / serving_times directly (what the planner's search must not miss)."""
    m, g = get_model_spec(model), get_gpu(gpu)
    best = None
    for wd in servable_weight_dtypes(m):  # what plan() searches by default
        for kvd in ("bf16", "fp8"):
            for tp in (1, 2, 4, 8):
                kv = kv_capacity(m, g, tp=tp, weight_dtype=wd, kv_dtype=kvd,
                                 gpu_memory_utilization=t.gpu_memory_utilization)
                for b in BATCHES:
                    if kv.kv_bytes <= 0 or b > kv.max_seqs(t.prompt_len + t.output_len):
                        continue
                    step, ttft, _ = serving_times(m, g, t, tp=tp, weight_dtype=wd, kv_dtype=kvd, max_batch=b,
                                                  link=g.link, eff=ENGINE)
                    if t.ttft_p50_ms is not None and ttft * 1e3 > t.ttft_p50_ms:
                        continue
                    if t.tpot_ms is not None and step * 1e3 > t.tpot_ms:
                        continue
                    for replicas in range(1, t.max_gpus // tp + 1):
                        if replicas * b / step >= t.target_tokens_per_s:
                            best = min(best or math.inf, replicas * tp)
                            break
    return best


def test_running_example_feasible_and_minimal() -> None:
    result = plan("llama-3-70b", "H100", TARGETS)
    assert result.feasible
    winner = result.feasible[0]
    assert winner.tokens_per_s >= 2000 and winner.ttft_ms <= 1000
    assert winner.gpus == _brute_force_min_gpus(TARGETS)
    assert winner.gpus <= 8
    costs = [c.cost_per_million_tokens for c in result.feasible]
    assert costs == sorted(costs)
    # Every rejected family carries a reason; bf16 on one 80 GB GPU fails on weights.
    reasons = {r.family: r.reason for r in result.rejected}
    assert "weights 131 GiB > 1 x 79.2 GiB" in reasons["TP1 bf16 weights, bf16 KV"]


def test_tight_tpot_changes_the_answer_and_matches_brute_force() -> None:
    t = PlanTargets(2000, ttft_p50_ms=1000, tpot_ms=40, prompt_len=1024, output_len=256, max_gpus=8)
    result = plan("llama-3-70b", "H100", t)
    assert result.feasible and result.feasible[0].gpus == _brute_force_min_gpus(t)
    assert all(c.tpot_ms <= 40 for c in result.feasible)


def test_infeasible_target_reported_with_reasons() -> None:
    t = PlanTargets(50_000, tpot_ms=5, max_gpus=8)
    result = plan("llama-3-70b", "H100", t)
    assert result.feasible == ()
    assert len(result.rejected) == len(SERVABLE_WEIGHT_DTYPES) * 2 * 4  # every family, each with its reason
    assert all(r.reason for r in result.rejected)
    assert any("TPOT" in r.reason for r in result.rejected)
    assert any("needs" in r.reason or "weights" in r.reason for r in result.rejected)


def test_online_int4_is_searched_only_when_asked_and_prints_its_measured_quality_cost() -> None:
    """Online round-to-nearest int4 costs quality 8-bit does not: a default plan of a float
    checkpoint never prints it; asked for, its command carries the flag, says what int4 measured on
    a GPU, and the int4 line gives docs/quantization.md's measured KL and top-1."""
    from stoker.roofline.planner import int4_note, serve_command

    t = PlanTargets(target_tokens_per_s=2000, ttft_p50_ms=1000)
    assert all(c.weight_dtype != "int4" for c in plan("llama-3-70b", "H100", t).feasible)
    wide = plan("llama-3-70b", "H100", t, weight_dtypes=("bf16", "fp8", "int8", "int4"))
    int4 = [c for c in wide.feasible if c.weight_dtype == "int4"]
    assert int4
    command = serve_command("llama-3-70b", int4[0])
    assert "--quantization int4" in command and "tinygemm decodes batch 1 at 1.73x bf16 (H100)" in command
    assert "mean KL 0.18-0.22" in command
    note = int4_note(get_model_spec("llama-3-70b"))
    assert "mean KL 0.18-0.22, top-1 agreement 0.42-0.51 on tiny random models" in note
    assert "a float16 scale per group of 128" in note and "offset" not in note


def _awq_config(**q) -> dict:
    from stoker.roofline.presets import PRESETS

    return {**PRESETS["llama-3-8b"], "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                              "zero_point": True, "version": "gemm", **q}}


def test_a_4_bit_checkpoint_is_planned_as_it_ships_with_its_offsets(tmp_path) -> None:
    """An AWQ / GPTQ / W4A16 checkpoint is served as int4 with no flag: the default plan searches
    int4 alone, priced with the checkpoint's own groups and zero points (the engine's bytes)."""
    from stoker.roofline.modelspec import spec_from_config
    from stoker.roofline.planner import int4_note, serve_command, servable_weight_dtypes

    awq = spec_from_config(_awq_config(), "awq")
    assert (awq.checkpoint_dtype, awq.int4_group_size, awq.int4_symmetric) == ("int4", 128, False)
    assert servable_weight_dtypes(awq) == ("int4",)
    assert awq.weight_bytes("int4") == awq.engine_int4_weight_bytes(128, symmetric=False)
    assert awq.weight_bytes("int4") > spec_from_config(_awq_config(zero_point=False), "awq").weight_bytes("int4")
    gptq = spec_from_config({**_awq_config(), "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                                      "group_size": -1, "sym": True}})
    assert (gptq.checkpoint_dtype, gptq.int4_group_size, gptq.int4_symmetric) == ("int4", None, True)
    assert spec_from_config({**_awq_config(), "quantization_config": {"quant_method": "gptq", "bits": 8}}).checkpoint_dtype == ""
    assert "float32 offset per group of 128" in int4_note(awq) and "checkpoint's own calibration" in int4_note(awq)
    t = PlanTargets(target_tokens_per_s=500, ttft_p50_ms=1000)
    result = plan(awq, "H100", t)
    assert result.feasible and all(c.weight_dtype == "int4" for c in result.feasible)
    (tmp_path / "config.json").write_text(json.dumps(_awq_config()))
    command = serve_command(str(tmp_path), result.feasible[0])  # the folder's config says int4: no flag
    assert "--quantization" not in command and "tinygemm decodes batch 1" in command


def test_engine_int4_bytes_count_the_scale_width_and_an_offset_only_when_asymmetric() -> None:
    spec = get_model_spec("llama-3-8b")
    c = spec.param_counts()
    quantized = c["attention"] + c["mlp"]
    rest = c["embedding"] + c["lm_head"] + c["norms"]
    assert spec.engine_int4_weight_bytes(128) == pytest.approx(quantized * (0.5 + 2 / 128) + rest * 2)
    assert spec.engine_int4_weight_bytes(128, symmetric=False) == pytest.approx(quantized * (0.5 + 6 / 128) + rest * 2)
    # GGUF Q4_K: groups of 32, float32 scales (products of two scales, not exact in float16) and offsets
    assert spec.engine_int4_weight_bytes(32, symmetric=False, scale_dtype="fp32") == pytest.approx(
        quantized * (0.5 + 8 / 32) + rest * 2)
    assert spec.engine_int4_weight_bytes(32) > spec.engine_int4_weight_bytes(128) == spec.weight_bytes("int4")
    # the tinygemm form (a bfloat16 model on a GPU): 4 bytes a group, its zero included, asymmetric or not
    assert spec.engine_int4_weight_bytes(128, symmetric=False, scale_dtype="tinygemm") == pytest.approx(
        quantized * (0.5 + 4 / 128) + rest * 2)


# ---- MoE (issue 33): the walkthrough's successors sized on H100 and H200 ---------------------------
MOE_PLANS = [
    # (model, target output tokens/s, H100 GPUs, H200 GPUs): 1024-token prompts, 256-token answers,
    # first token within 1 s. gpt-oss-120b's MXFP4 experts (61 GiB) fit one GPU of either; a bf16
    # Qwen3-235B-A22B (438 GiB) needs TP8 on H100, TP4 on H200.
    ("gpt-oss-120b", 5000, 2, 1),
    ("qwen3-235b-a22b", 1500, 8, 4),
]


@pytest.mark.parametrize("model, target, h100_gpus, h200_gpus", MOE_PLANS)
def test_moe_plans_on_h100_and_h200_are_minimal(model: str, target: float, h100_gpus: int, h200_gpus: int) -> None:
    t = PlanTargets(target, ttft_p50_ms=1000, prompt_len=1024, output_len=256, max_gpus=8)
    for gpu, want in (("H100", h100_gpus), ("H200", h200_gpus)):
        result = plan(model, gpu, t)
        assert result.feasible, gpu
        winner = result.feasible[0]
        assert winner.tokens_per_s >= target and winner.ttft_ms <= 1000
        assert winner.gpus == want == _brute_force_min_gpus(t, model, gpu), gpu
        # A default MoE plan searches bf16 weights only (planner.MOE_SERVABLE_WEIGHT_DTYPES).
        assert {c.weight_dtype for c in result.feasible} == {"bf16"}
        assert {r.weight_dtype for r in result.rejected} <= {"bf16"}


def test_moe_serve_lines() -> None:
    t = PlanTargets(1500, ttft_p50_ms=1000, prompt_len=1024, output_len=256, max_gpus=8)
    best = plan("qwen3-235b-a22b", "H200", t).feasible[0]
    assert serve_command("qwen3-235b-a22b", best) == (
        f"stoker serve <qwen3-235b-a22b checkpoint folder>{' --kv-cache-dtype fp8' if best.kv_dtype == 'fp8' else ''}"
        f" --max-num-seqs {best.max_batch} --tensor-parallel-size 4")
    # gpt-oss's MXFP4 experts: served by a torch dequantizing path, whole experts per rank; the line says so
    # after the flags (a shell comment), and fp8 weights on a MoE model are priced only when asked.
    oss = plan("gpt-oss-120b", "H100", PlanTargets(5000, ttft_p50_ms=1000)).feasible[0]
    line = serve_command("gpt-oss-120b", oss)
    assert line.startswith("stoker serve <gpt-oss-120b checkpoint folder> ") and "--tensor-parallel-size 2" in line
    assert "--enable-expert-parallel" in line.split("#", 1)[0]  # MXFP4 experts: whole experts per rank
    assert line.index("--max-num-seqs") < line.index("#") and "mxfp4 experts" in line.split("#", 1)[1]
    fp8 = plan("qwen3-235b-a22b", "H100", t, weight_dtypes=("fp8",)).feasible[0]
    # FP8 experts run (layers/moe_quant.py): the serve line asks for them, with no caveat
    line = serve_command("qwen3-235b-a22b", fp8)
    assert "--quantization fp8" in line and "#" not in line
