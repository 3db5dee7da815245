"""On a real GPU: NVML sampling, the exporter, and a short `stoker doctor` (skipped without CUDA)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_exporter_on_real_gpu():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from stoker.telemetry.exporter import register_gpu_collector

    registry = CollectorRegistry()
    assert register_gpu_collector(registry)
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED"} <= names


def test_doctor_on_gpu(tmp_path):
    from stoker.cli import main

    out = tmp_path / "doctor.json"
    rc = main(["doctor", "--device", "cuda", "--soak-minutes", "0.1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {c["name"] for c in report["checks"]} >= {"versions", "gemm", "memory_bandwidth", "soak"}
    assert rc in (0, 1)
