"""`stoker bench serve`'s reading of the server's wall counters over a run."""

from __future__ import annotations

import pytest

from stoker.bench.server_wall import describe, wall_over_run


def _samples(decode_steps: float, seconds: float, predicted: float, nbytes: float, flops: float) -> dict:
    k = (("kind", "decode"), ("model_name", "m"))
    return {
        ("stoker:wall_info", (("device", "H100-SXM"), ("kv_dtype", "bf16"), ("model_name", "m"), ("profile", "engine"),
                              ("tp", "1"), ("weight_dtype", "bf16"))): 1.0,
        ("stoker:ceiling_bytes_per_second", (("model_name", "m"),)): 1e12,
        ("stoker:ceiling_flops_per_second", (("model_name", "m"),)): 1e15,
        ("stoker:step_bound_total", (("kind", "decode"), ("model_name", "m"), ("wall", "memory"))): decode_steps,
        ("stoker:step_seconds_total", k): seconds,
        ("stoker:step_predicted_seconds_total", k): predicted,
        ("stoker:step_bytes_total", k): nbytes,
        ("stoker:step_flops_total", k): flops,
    }


def test_the_run_is_the_difference_of_the_counters() -> None:
    before = _samples(10, 1.0, 0.5, 1e11, 1e12)
    after = _samples(110, 3.0, 2.1, 1.1e12, 3e12)
    wall = wall_over_run(before, after)
    d = wall["kinds"]["decode"]
    assert wall["available"] and wall["device"] == "H100-SXM"
    assert d["steps"] == 100 and d["wall_share"] == {"memory": 1.0}
    assert d["mbu"] == pytest.approx(1e12 / 2.0 / 1e12) and d["mfu"] == pytest.approx(2e12 / 2.0 / 1e15)
    assert d["measured_over_predicted"] == pytest.approx(2.0 / 1.6)
    assert "decode: 100 steps, 100% memory-bound, MBU 50.0%" in "\n".join(describe(wall))


def test_a_server_without_the_counters_says_so() -> None:
    assert wall_over_run(None, None) == {"available": False, "why": "the server's /metrics could not be read"}
    vllm_like = {("vllm:num_requests_running", (("model_name", "m"),)): 0.0}
    out = wall_over_run(vllm_like, vllm_like)
    assert not out["available"] and "no wall verdict" in out["why"]
