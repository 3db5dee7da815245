"""The wall verdict live in /metrics (issue 16): on this CPU, judged against the roofs a device
file holds; without one, no wall gauges at all (never made-up numbers)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stoker.roofline.device_file import ENV_VAR, DeviceFile, write_device_file
from tests.server.conftest import MODEL

DEVICE = DeviceFile(fp32_tflops=0.15, bf16_tflops=0.08, read_gb_per_s=15.0, memory_gb=24.0, cpu_model="test cpu",
                    isa="avx2", threads=2, measured_at="2026-11-23T00:00:00")


def _send(url: str) -> None:
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 4  # a prefill of ~100 tokens
    for prompt, n in ((long_prompt, 8), ("Hi", 16)):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                      "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text


def test_steps_are_judged_against_this_machines_roofs(server_factory, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(write_device_file(DEVICE, tmp_path / "this.yaml")))
    live = server_factory()
    _send(live.url)
    m = live.metrics()
    info = [k for k in m if k.startswith("stoker:wall_info{")]
    assert len(info) == 1 and 'device="this"' in info[0] and 'profile="measured"' in info[0] and 'weight_dtype="fp32"' in info[0]
    assert live.metric("stoker:ceiling_bytes_per_second") == pytest.approx(15e9)
    decode_steps = sum(v for k, v in m.items() if k.startswith("stoker:step_bound_total{") and 'kind="decode"' in k)
    prefill_steps = sum(v for k, v in m.items() if k.startswith("stoker:step_bound_total{") and 'kind="prefill"' in k)
    assert decode_steps >= 14 and prefill_steps >= 2  # every step is counted once (warm-up steps included)
    for name in ("stoker:mbu", "stoker:mfu", "stoker:step_time_over_prediction", "stoker:achieved_bytes_per_second"):
        value = next(v for k, v in m.items() if k.startswith(name + "{") and 'kind="decode"' in k)
        assert value > 0, name
    # the gauges are the counters' ratios over the window: consistent with each other
    mbu = next(v for k, v in m.items() if k.startswith("stoker:mbu{") and 'kind="decode"' in k)
    achieved = next(v for k, v in m.items() if k.startswith("stoker:achieved_bytes_per_second{") and 'kind="decode"' in k)
    assert mbu == pytest.approx(achieved / 15e9, rel=1e-6)
    seconds = next(v for k, v in m.items() if k.startswith("stoker:step_seconds_total{") and 'kind="decode"' in k)
    predicted = next(v for k, v in m.items() if k.startswith("stoker:step_predicted_seconds_total{") and 'kind="decode"' in k)
    assert seconds > 0 and predicted > 0
    line = live.app.state.stoker.metrics.wall.summary()
    assert line and "decode: " in line and "x of prediction" in line


def test_no_device_file_no_wall_gauges(server_factory, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "absent.yaml"))
    live = server_factory()
    _send(live.url)
    text = httpx.get(live.url + "/metrics", timeout=10).text
    assert "stoker:wall_info" not in text and "stoker:mbu{" not in text
    assert "stoker:step_bound_total{" not in text


def test_request_timing_when_asked(server_factory, tmp_path: Path, monkeypatch) -> None:
    import json

    monkeypatch.setenv(ENV_VAR, str(write_device_file(DEVICE, tmp_path / "this.yaml")))
    live = server_factory(enable_request_timing=True)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True}
    t = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).json()["stoker_timing"]
    # one step prefills the prompt and samples the first token, then one step per further token
    assert t["num_steps"] == 6 and sum(t["steps_by_wall"].values()) == 6
    assert t["dominant_wall"] in ("memory", "compute", "overhead", "collective")
    assert all(t[k] is not None and t[k] >= 0 for k in ("queue_s", "prefill_s", "decode_s"))
    with httpx.stream("POST", live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["stoker_timing"]["num_steps"] == 6
    assert all("stoker_timing" not in e for e in events[:-1])
    two = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b c"], "max_tokens": 3,
                                                         "ignore_eos": True}, timeout=60).json()
    assert [x["num_steps"] for x in two["stoker_timing"]] == [3, 3]


def test_no_request_timing_by_default(live_server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert "stoker_timing" not in httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=60).json()
