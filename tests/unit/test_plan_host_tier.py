"""`stoker plan --multi-turn ... --kv-offloading-size GiB`: the host KV tier's hit rate and TTFT (roofline/host_tier.py)."""

from __future__ import annotations

import json

import pytest

from stoker.cli import main
from stoker.roofline.hardware import GiB, get_gpu
from stoker.roofline.host_tier import default_host_link, price_host_tier, reuse_share, survival
from stoker.roofline.modelspec import get_model_spec

KW = dict(turns=8, turn_tokens=512, conversations=256, device_tokens=200_000, weight_dtype="fp8", kv_dtype="fp8")


def test_hit_rate_is_monotone_in_the_tier_size() -> None:
    rates = [price_host_tier("llama-3-8b", "H100", offloading_gib=gib, **KW) for gib in (0, 4, 16, 64, 256)]
    with_tier = [r.hit_rate_with_tier for r in rates]
    assert with_tier == sorted(with_tier) and with_tier[-1] > with_tier[0]
    assert all(r.hit_rate_device_only == rates[0].hit_rate_device_only for r in rates)  # the device's part is fixed
    saved = [r.ttft_saved_ms for r in rates]
    assert saved == sorted(saved) and saved[0] == pytest.approx(0.0)
    # Bounded by the reuse the workload has: (turns - 1) / (turns + 1) of its prompt tokens.
    assert with_tier[-1] <= reuse_share(8) + 1e-12
    assert rates[-1].hit_rate_with_tier == pytest.approx(reuse_share(8))  # 256 GiB holds the whole working set


def test_no_reuse_no_gain() -> None:
    one = price_host_tier("llama-3-8b", "H100", offloading_gib=64, **{**KW, "turns": 1})
    assert one.hit_rate_device_only == one.hit_rate_with_tier == 0.0
    assert one.ttft_saved_ms == pytest.approx(0.0)


def test_host_tokens_and_working_set() -> None:
    m = get_model_spec("llama-3-8b")
    h = price_host_tier(m, "H100", offloading_gib=16, **KW)
    assert h.host_tokens == int(16 * GiB / m.kv_bytes_per_token("fp8"))
    assert h.working_set_tokens == 256 * 512 * 9 / 2
    assert h.hit_rate_device_only == pytest.approx(survival(200_000, h.working_set_tokens) * reuse_share(8))


def test_a_hit_costs_the_copy_not_the_recompute() -> None:
    h = price_host_tier("llama-3-70b", "H100", offloading_gib=64, tp=4, **{**KW, "device_tokens": 0})
    assert h.hit_rate_device_only == 0.0 and h.host_hit_rate == h.hit_rate_with_tier > 0
    assert 0 < h.copy_ms < h.recompute_ms and h.ttft_saved_ms > 0
    assert h.host_link == "pcie5" and default_host_link(get_gpu("A100")).name == "pcie4"


def test_bad_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="--multi-turn"):
        price_host_tier("llama-3-8b", "H100", offloading_gib=1, **{**KW, "turns": 0})


def test_plan_prints_the_tier(capsys) -> None:
    args = ["plan", "--model", "llama-3-8b", "--gpu", "H100", "--target-tokens-per-s", "2000", "--prompt-len", "2048",
            "--output-len", "256", "--multi-turn", "8", "--turn-tokens", "512", "--conversations", "512",
            "--kv-offloading-size", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "host KV tier (--kv-offloading-size 64 GiB" in out and "prefix hit rate" in out and "ms saved" in out
    assert main([*args, "--json"]) == 0
    tier = json.loads(capsys.readouterr().out)["host_tier"]
    assert tier["hit_rate_with_tier"] >= tier["hit_rate_device_only"] and tier["conversations"] == 512
