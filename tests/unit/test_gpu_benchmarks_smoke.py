"""The GPU benchmarks' `--smoke` runs (tiny shapes on CPU, Triton interpreted): each script runs
end to end in a subprocess (TRITON_INTERPRET must be set before triton is imported) and writes
JSON whose figures are checked, so the one GPU run is not where a script first runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(script: str, out: Path, *extra: str) -> dict:
    """The script's --smoke run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "smoke" in proc.stdout
    return json.loads(out.read_text())


def test_mla_gpu_smoke(tmp_path: Path) -> None:
    res = run_smoke("mla_gpu.py", tmp_path / "mla.json")
    rows = res["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # batch x context x cache x (triton, twin)
    triton = [r for r in rows if r["impl"] == "triton"]
    assert {r["cache"] for r in triton} == {"bf16", "fp8"}
    # interpreted in float32: the kernel matches its twin to rounding, bf16 and FP8 caches alike
    assert all(r["max_abs_err"] < 1e-4 * max(1.0, r["twin_max_abs"]) and r["twin_max_abs"] > 0 for r in triton)
    assert any(r["splits"] > 1 for r in triton)  # the long context is split: the reduce kernel ran
    for r in rows:  # the bytes: latent rows of 576-equivalent width (64 + 16 here), 2 bytes or 1
        width = res["kv_lora_rank"] + res["rope"]
        assert r["cache_gb"] * 1e9 == r["batch"] * r["context"] * width * (2 if r["cache"] == "bf16" else 1)
        assert r["gb"] > r["cache_gb"]


def test_pooling_gpu_smoke(tmp_path: Path) -> None:
    res = run_smoke("pooling_gpu.py", tmp_path / "pooling.json", "--workload", "fixed128")  # one workload: suite time
    assert res["device"] == "CPU" and set(res["workloads"]) == {"fixed128"}
    for name, w in res["workloads"].items():
        impls = [r["impl"] for r in w["rows"]]
        assert impls[0] == "stoker served" and "stoker runner b8" in impls
        assert sum(r["best"] for r in w["rows"]) == 1  # one sentence-transformers batch size marked best
        assert w["cosine_min"] > 0.99 and w["cosine_min"] <= w["cosine_mean"] <= 1.0 + 1e-6
        full = [r for r in w["rows"] if r["inputs"] == res["inputs"]]
        assert len({r["tokens"] for r in full}) == 1  # every full pass counts the same tokens
        if name == "fixed128":
            assert full[0]["tokens"] == 128 * res["inputs"]
