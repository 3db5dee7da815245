"""`stoker roofline kv`, `stoker roofline calibrate` and `--profile` as a user runs them."""

from __future__ import annotations

import json

import pytest
import yaml

from stoker.cli import main
from stoker.roofline.costmodel import decode_tokens_per_s
from stoker.roofline.profiles import ENGINE, KERNEL


def test_roofline_kv_text_and_json(capsys) -> None:
    assert main(["roofline", "kv", "--model", "llama-3-8b", "--gpu", "H100", "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "79.22 GiB" in out and "activation peak" in out and "non-torch runtime" in out
    assert "CUDA graphs" in out and "blocks of 16" in out and "sequences of 4,096 tokens" in out
    assert main(["roofline", "kv", "--model", "llama-3-70b", "--gpu", "H100", "--tp", "4", "--dtype", "fp8",
                 "--kv-dtype", "fp8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["tokens"] == d["num_blocks"] * 16 > 0 and d["usable_gib"] == pytest.approx(79.22)
    assert any(o["name"].startswith("NCCL") for o in d["overheads"])
    charged = d["weights_gib"] + sum(o["gib"] for o in d["overheads"]) + d["kv_gib"]
    assert charged == pytest.approx(d["budget_gib"])


def test_profile_flag_changes_prediction_not_ceiling(tmp_path, capsys) -> None:
    base = ["roofline", "--model", "llama-3-8b", "--gpu", "H100", "--batch", "1,64", "--json"]
    rows = {}
    for profile in ("kernel", "engine"):
        assert main(base + ["--profile", profile]) == 0
        rows[profile] = json.loads(capsys.readouterr().out)
    assert main(base) == 0
    assert json.loads(capsys.readouterr().out) == rows["engine"]  # engine is the default
    k, e = rows["kernel"][0], rows["engine"][0]
    assert k["ceiling_tokens_per_s"] == e["ceiling_tokens_per_s"]
    assert k["tokens_per_s"] == pytest.approx(decode_tokens_per_s("llama-3-8b", "H100", batch=1, context_len=1024, eff=KERNEL))
    assert e["tokens_per_s"] == pytest.approx(decode_tokens_per_s("llama-3-8b", "H100", batch=1, context_len=1024, eff=ENGINE))
    f = tmp_path / "slow.yaml"
    f.write_text("efficiencies: {memory: 0.4}\n")
    assert main(base + ["--profile", str(f)]) == 0
    slow = json.loads(capsys.readouterr().out)[0]
    assert slow["tokens_per_s"] == pytest.approx(
        decode_tokens_per_s("llama-3-8b", "H100", batch=1, context_len=1024, eff=KERNEL.replace(memory=0.4)))
    assert main(base + ["--profile", "fastest"]) == 2
    assert "unknown profile" in capsys.readouterr().err


def test_plan_reports_kv_capacity_and_takes_a_profile(capsys) -> None:
    args = ["plan", "--model", "llama-3-70b", "--gpu", "H100", "--target-tokens-per-s", "2000", "--json"]
    assert main(args) == 0
    engine = json.loads(capsys.readouterr().out)["feasible"]
    assert main(args + ["--profile", "kernel"]) == 0
    kernel = json.loads(capsys.readouterr().out)["feasible"]
    for c in engine:
        assert 0 < c["max_batch"] <= c["kv_max_seqs"] and c["kv_capacity_tokens"] >= c["kv_max_seqs"] * 1280
    # Kernel peaks promise more per GPU than engines deliver: the engine plan never needs fewer GPUs.
    assert engine[0]["gpus"] >= kernel[0]["gpus"]
    assert main(args[:-1]) == 0
    assert "KV per replica" in capsys.readouterr().out


def test_calibrate_writes_a_profile_the_flag_reads(tmp_path, capsys) -> None:
    truth = ENGINE.replace(memory=0.62)
    results = []
    for b in (1, 8, 32):
        tps = decode_tokens_per_s("llama-3-8b", "H100", batch=b, context_len=1152, eff=truth)
        # A `stoker bench serve` result: concurrency b, 1024-token prompts, 256-token outputs.
        results.append({"model_id": "llama-3-8b", "hardware": "H100", "output_throughput": tps,
                        "max_concurrency": b, "completed": 10, "total_input_tokens": 10240,
                        "total_output_tokens": 2560})
    paths = []
    for i, r in enumerate(results):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    out = tmp_path / "h100.yaml"
    assert main(["roofline", "calibrate", *paths, "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    doc = yaml.safe_load(out.read_text())
    assert doc["fitted_to"]["model"] == "llama-3-8b" and len(doc["fitted_to"]["points"]) == 3
    assert doc["efficiencies"]["memory"] == pytest.approx(0.62, abs=0.03)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".h100.yaml")]
    assert main(["roofline", "--model", "llama-3-8b", "--gpu", "H100", "--batch", "8", "--context", "1152",
                 "--profile", str(out), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["tokens_per_s"] == pytest.approx(results[1]["output_throughput"], rel=0.03)
    assert main(["roofline", "calibrate", str(tmp_path / "missing.json"), "-o", str(out)]) == 2
    assert "no result file" in capsys.readouterr().err
