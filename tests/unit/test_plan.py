"""Planner: the running example is feasible with no more GPUs than brute force finds; infeasible
targets come back as such, with a reason per family."""

from __future__ import annotations

import math

from stoker.roofline.hardware import get_gpu
from stoker.roofline.kvcapacity import kv_capacity
from stoker.roofline.modelspec import get_model_spec
from stoker.roofline.planner import BATCHES, SERVABLE_WEIGHT_DTYPES, PlanTargets, plan, serving_times
from stoker.roofline.profiles import ENGINE

# The running example (docs/walkthrough.md): Llama-3-70B chat on H100s, 2000 output tokens/s,
# 1024-token prompts, 256-token answers, first token within 1 s.
TARGETS = PlanTargets(2000, ttft_p50_ms=1000, prompt_len=1024, output_len=256, max_gpus=8)


def _brute_force_min_gpus(t: PlanTargets) -> int | None:
    """Every dtype x KV dtype x TP x batch x replicas, each point's KV capacity and times taken
    from kvcapacity / serving_times directly (what the planner's search must not miss)."""
    m, g = get_model_spec("llama-3-70b"), get_gpu("H100")
    best = None
    for wd in SERVABLE_WEIGHT_DTYPES:  # what plan() searches by default
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


def test_int4_is_searched_only_when_asked() -> None:
    """int4 (W4A16) is not served by stoker serve yet: a default plan never prints it."""
    t = PlanTargets(target_tokens_per_s=2000, ttft_p50_ms=1000)
    assert all(c.weight_dtype != "int4" for c in plan("llama-3-70b", "H100", t).feasible)
    wide = plan("llama-3-70b", "H100", t, weight_dtypes=("bf16", "fp8", "int8", "int4"))
    assert any(c.weight_dtype == "int4" for c in wide.feasible)
