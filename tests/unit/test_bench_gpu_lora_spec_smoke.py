"""benchmarks/lora_gpu.py and benchmarks/spec_decode_gpu.py run once on a lent GPU: their --smoke
modes run the whole script on CPU (a tiny checkpoint, the BGMV kernel interpreted), so a broken
code path shows here first. Each in its own process, as gpu_check.sh runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(script: str, out: Path, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--json", str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=300, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| " in proc.stdout  # the table
    return json.loads(out.read_text())


def test_lora_gpu_smoke(tmp_path: Path) -> None:
    result = run_smoke("lora_gpu.py", tmp_path / "lora.json")
    assert result["failed"] == []
    kernel = result["kernel"]
    assert {r["batch"] for r in kernel} == {1, 4}
    assert {r["projection"] for r in kernel} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "layer"}
    for r in kernel:
        assert r["check_error"] < 1e-3, r  # the BGMV update equals its float32 twin (1.0: no update)
        assert r["lora_device_ms"] > 0 and r["base_eager_ms"] > 0
    assert result["engine"]["base_engine_freed"] and result["engine"]["lora_engine_freed"]  # never two at once
    runs = result["engine"]["runs"]
    assert set(runs) == {"base", "lora-off", "lora-4"}
    assert all(r["output_tokens_per_s"] > 0 for r in runs.values())
    assert runs["lora-off"]["same_tokens_as_base"] == result["engine"]["requests"]
    assert runs["lora-4"]["requests_differing_from_base"] >= result["engine"]["requests"] // 2


def test_spec_decode_gpu_smoke(tmp_path: Path) -> None:
    # the bigram variant alone (the random one runs the same code with drafts refused): suite time
    result = run_smoke("spec_decode_gpu.py", tmp_path / "spec.json", "--variants", "bigram")
    assert result["failed"] == []
    engines = result["engines"]
    assert set(engines) == {"none", "ngram k=4", "draft_model k=4"}
    for name, runs in engines.items():
        assert runs["freed"], name  # dropped before the next engine starts
        r = runs["bigram"]
        assert r["lossless"], name
        assert r["output_tokens"] == result["max_tokens"] * result["num_prompts"]
    assert engines["none"]["bigram"]["verify_steps"]["steps"] == 0
    draft = engines["draft_model k=4"]
    assert draft["bigram"]["num_draft_tokens"] > 0
    # bigram: the draft computes the target's function, so its drafts pass
    assert draft["bigram"]["acceptance_rate"] > 0.9
    assert draft["bigram"]["verify_steps"]["steps"] > 0


def test_without_cuda_they_say_so_and_exit_0() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    for script in ("lora_gpu.py", "spec_decode_gpu.py"):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "needs a CUDA GPU" in proc.stdout and "nothing was measured" in proc.stdout
