"""`stoker roofline` / `stoker plan` as a user runs them, plus calibration and YAML devices."""

from __future__ import annotations

import json

import pytest

from stoker.cli import main
from stoker.roofline.calibrate import calibrate
from stoker.roofline.costmodel import decode_tokens_per_s
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import get_gpu, load_gpu_yaml


def test_roofline_table_and_verdict(capsys) -> None:
    assert main(["roofline", "--model", "llama-3-8b", "--gpu", "H100", "--batch", "1,8,64"]) == 0
    out = capsys.readouterr().out
    assert "decode at batch 1 is memory-bound" in out and "weight reads" in out and "floor" in out
    assert "mlp_gate_up" in out and "batch 64 raises throughput" in out


def test_roofline_json_keys(capsys) -> None:
    assert main(["roofline", "--model", "llama-3-70b", "--gpu", "h100", "--tp", "8", "--batch", "1,8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in rows] == [1, 8]
    for r in rows:
        for key in ("batch", "phase", "step_time_s", "tokens_per_s", "bound", "latency_floor_s", "arithmetic_intensity", "ops"):
            assert key in r
        assert {"name", "flops", "bytes", "time_s", "bound"} <= set(r["ops"][0])
        assert any(op["name"] == "all_reduce" and op["bound"] == "communication" for op in r["ops"])


def test_roofline_plot(tmp_path, capsys) -> None:
    png = tmp_path / "r.png"
    assert main(["roofline", "--model", "llama-3.2-1b", "--gpu", "L4", "--batch", "1,16", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_measured_serve_result(tmp_path, capsys) -> None:
    f = tmp_path / "serve.json"
    f.write_text(json.dumps({"model_id": "meta-llama/Meta-Llama-3-70B-Instruct", "hardware": "H100",
                             "output_throughput": 280.0, "total_token_throughput": 1400.0, "request_throughput": 1.1,
                             "max_concurrency": 4, "completed": 100, "num_prompts": 100, "total_input_tokens": 102400,
                             "total_output_tokens": 25600, "mean_tpot_ms": 14.0, "median_ttft_ms": 600.0}))
    assert main(["roofline", "--measured", str(f), "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "MBU" in out and "MFU" in out and "batch 4 = max_concurrency" in out


def test_measured_offline_result_takes_batch_from_flag(tmp_path, capsys) -> None:
    f = tmp_path / "offline.json"
    f.write_text(json.dumps({"model": "llama-3-8b", "num_prompts": 1000, "input_len": 512, "output_len": 128,
                             "elapsed_s": 60.0, "output_throughput": 2133.0, "total_token_throughput": 10666.0,
                             "request_throughput": 16.7}))
    assert main(["roofline", "--measured", str(f), "--gpu", "H100", "--batch", "32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    m = rows[-1]
    assert m["kind"] == "measured" and m["batch"] == 32 and m["context_len"] == 576
    assert 0 < m["mbu"] < 1 and "from --batch" in " ".join(m["assumptions"])


def test_plan_cli_json_and_text(capsys) -> None:
    args = ["plan", "--model", "llama-3-70b", "--gpu", "H100", "--target-tokens-per-s", "2000", "--ttft-p50-ms", "1000"]
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    keys = {"gpus", "tp", "replicas", "weight_dtype", "kv_dtype", "max_batch", "tokens_per_s", "ttft_ms", "tpot_ms",
            "memory_per_gpu_gb", "cost_per_million_tokens"}
    assert keys <= set(data["feasible"][0]) and data["rejected"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "rejected:" in out
    assert main(["plan", "--model", "llama-3-70b", "--gpu", "L4", "--target-tokens-per-s", "1e6"]) == 1
    assert "no feasible plan" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["roofline", "--model", "llama-3-8b", "--gpu", "V100"], "choose one of"),
    (["roofline", "--model", "gpt-5", "--gpu", "H100"], "llama-3-70b"),
    (["roofline", "--model", "llama-3-8b", "--gpu", "H100", "--batch", "1,x"], "--batch"),
    (["roofline", "--model", "llama-3-8b", "--gpu", "H100", "--dtype", "fp4"], "int4"),
    (["roofline", "--model", "llama-3-8b", "--gpu", "H100:3g.40gb", "--tp", "2"], "no GPU-GPU link"),
])
def test_bad_input_is_one_line_exit_2(argv, needle, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_calibrate_recovers_memory_efficiency() -> None:
    truth = Efficiencies(memory=0.65, layer_overhead_s=20e-6)
    points = [{"batch": b, "context_len": 1024,
               "output_tokens_per_s": decode_tokens_per_s("llama-3-8b", "H100", batch=b, context_len=1024, eff=truth)}
              for b in (1, 4, 16, 64, 256)]
    fitted = calibrate({"model": "llama-3-8b", "gpu": "H100", "points": points})
    for p in points:
        pred = decode_tokens_per_s("llama-3-8b", "H100", batch=p["batch"], context_len=1024, eff=fitted)
        assert pred == pytest.approx(p["output_tokens_per_s"], rel=0.03)
    assert fitted.memory == pytest.approx(0.65, abs=0.05)


def test_device_yaml(tmp_path) -> None:
    f = tmp_path / "dev.yaml"
    f.write_text("devices:\n  - name: TestGPU-96\n    bf16_tflops: 500\n    fp8_tflops: 1000\n    memory_gb: 96\n"
                 "    hbm_gb_per_s: 4000\n    link: pcie5\n    source: test fixture\n    aliases: [tg96]\n")
    (spec,) = load_gpu_yaml(f)
    assert get_gpu("tg96") is spec and spec.link.name == "pcie5" and spec.ridge_point() == pytest.approx(125)
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices:\n  - name: X\n")
    with pytest.raises(ValueError, match="missing"):
        load_gpu_yaml(bad)


def test_plan_prints_the_serve_command_and_the_engine_takes_it(capsys, tiny_llama) -> None:
    """The planner's FP8 recommendation is a command line the engine runs (issue 13)."""
    import shlex

    from stoker.cli import build_parser
    from stoker.engine.llm import LLM
    from stoker.roofline.planner import Candidate, serve_command
    from stoker.server.cli import _llm_kwargs

    args = ["plan", "--model", "llama-3-70b", "--gpu", "H100", "--target-tokens-per-s", "2000", "--ttft-p50-ms", "1000"]
    assert main(args) == 0
    run_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run ("))
    assert "--quantization fp8 --kv-cache-dtype fp8" in run_line and "<llama-3-70b checkpoint folder>" in run_line
    best = Candidate(gpus=1, tp=1, replicas=1, weight_dtype="fp8", kv_dtype="fp8", max_batch=8, tokens_per_s=1.0,
                     ttft_ms=1.0, tpot_ms=1.0, memory_per_gpu_gb=1.0, cost_per_million_tokens=1.0, bound="memory")
    command = serve_command(str(tiny_llama), best)
    argv = shlex.split(command)[1:]  # drop "stoker"
    kwargs = _llm_kwargs(build_parser().parse_args(argv + ["--kv-cache-memory-bytes", str(4 << 20), "--device", "cpu"]))
    llm = LLM(argv[1], **kwargs)
    assert llm.engine.executor.driver_runner.quant.method == "fp8" and llm.engine.executor.driver_runner.kv_spec.dtype == "fp8_e4m3"


@pytest.mark.parametrize("model, gpu, target, tp", [("gpt-oss-120b", "H200", "5000", None),
                                                    ("qwen3-235b-a22b", "H100", "1500", 8)])
def test_plan_cli_sizes_moe_models_and_prints_the_serve_line(model: str, gpu: str, target: str, tp: int | None,
                                                            capsys) -> None:
    assert main(["plan", "--model", model, "--gpu", gpu, "--target-tokens-per-s", target, "--ttft-p50-ms", "1000"]) == 0
    out = capsys.readouterr().out
    run = next(line for line in out.splitlines() if line.startswith("run ("))
    assert f"stoker serve <{model} checkpoint folder>" in run and "--max-num-seqs" in run
    assert (f"--tensor-parallel-size {tp}" in run) if tp else ("--tensor-parallel-size" not in run)
    assert " fp8 weights" not in out and " int8 " not in out  # MoE: bf16 weights only, as the engine runs them


def test_roofline_cli_moe_header_and_ep(capsys) -> None:
    assert main(["roofline", "--model", "gpt-oss-120b", "--gpu", "H100", "--batch", "1,64"]) == 0
    out = capsys.readouterr().out
    assert "MoE: 128 experts, 4 per token on 36 layers; 5.13B active" in out and "experts in mxfp4" in out
    assert "B=1 4.0" in out and "sliding window: 18 of 36 layers" in out
    assert main(["roofline", "--model", "qwen3-235b-a22b", "--gpu", "H100", "--tp", "8", "--ep", "8", "--batch", "1",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["tp"] == 8
    assert main(["roofline", "--model", "qwen3-235b-a22b", "--gpu", "H100", "--tp", "8", "--ep", "4"]) == 2
