"""The "this" device file, the cost model's float32 engine, and the microbenchmark fit (pure Python)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from stoker.roofline import costmodel, hardware, microfit
from stoker.roofline.device_file import (
    DeviceFile,
    read_device_file,
    to_spec,
    write_device_file,
)
from stoker.roofline.modelspec import ModelSpec

ISSUE2 = ModelSpec("issue2", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                   intermediate_size=1408, vocab_size=1024)


def _device(**kw) -> DeviceFile:
    base = dict(fp32_tflops=0.16, bf16_tflops=0.08, read_gb_per_s=13.0, memory_gb=23.5, cpu_model="Test CPU",
                isa="avx512", threads=2, measured_at="2026-01-01T00:00:00", measurements={"read_sum_256mib_gb_per_s": 12.0})
    return DeviceFile(**(base | kw))


def test_device_file_round_trip_and_get_gpu_this(tmp_path, monkeypatch):
    path = write_device_file(_device(), tmp_path / "this.yaml")
    assert read_device_file(path) == _device()
    # The file is load_gpu_yaml's format: the hardware table reads it, fp32 rate included.
    spec = hardware.load_gpu_yaml(path)[0]
    assert spec.peak_flops("fp32") == pytest.approx(0.16e12) and spec.peak_flops("bf16") == pytest.approx(0.08e12)
    assert spec.hbm_gb_per_s == 13.0 and spec.link.kind == "none" and "Test CPU" in spec.source
    monkeypatch.setenv("STOKER_DEVICE_FILE", str(path))
    hardware._ALIASES.pop("this", None)  # as in a fresh process: get_gpu("this") loads the file
    assert hardware.get_gpu("this").fp32_tflops == pytest.approx(0.16)


def test_missing_or_foreign_device_file_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_DEVICE_FILE", str(tmp_path / "absent.yaml"))
    with pytest.raises(ValueError, match="write-device-file"):
        read_device_file()
    (tmp_path / "gpu.yaml").write_text("devices:\n- {name: X, bf16_tflops: 1, memory_gb: 1, hbm_gb_per_s: 1, source: s}\n")
    with pytest.raises(ValueError, match="not written by"):
        read_device_file(tmp_path / "gpu.yaml")
    with pytest.raises(ValueError, match="read_gb_per_s"):
        _device(read_gb_per_s=0)


def test_fp32_engine_prices_fp32_bytes_and_rate():
    dev = to_spec(_device())
    old = costmodel.step_cost(ISSUE2, dev, batch=1, context_len=128, weight_dtype="fp32")
    new = costmodel.step_cost(ISSUE2, dev, batch=1, context_len=128, weight_dtype="fp32", act_dtype="fp32", kv_dtype="fp32")
    head = {s: next(op for op in x.ops if op.name == "lm_head") for s, x in (("old", old), ("new", new))}
    assert head["new"].weight_bytes == 2 * head["old"].weight_bytes == 4 * 1024 * 512  # 4-byte LM head
    assert costmodel.compute_dtype("fp32", dev) == "fp32"
    # Prefill: the LM head on the last token only, as the runner's logits_indices do.
    full = costmodel.step_cost(ISSUE2, dev, phase="prefill", context_len=512, **microfit.FP32 | {"last_token_logits": False})
    last = costmodel.step_cost(ISSUE2, dev, phase="prefill", context_len=512, **microfit.FP32)
    f_head = [op.flops for s in (full, last) for op in s.ops if op.name == "lm_head"]
    assert f_head == [512 * 2 * 1024 * 512, 2 * 1024 * 512]
    # GPU entries keep the old pricing: no fp32 rate, bf16 activations by default.
    h100 = hardware.get_gpu("h100")
    assert costmodel.compute_dtype("fp32", h100) == "bf16" and h100.fp32_tflops is None


def _synthetic(dev, e_gemm: dict[int, float], e_dec: float, e_pre: float, host: float) -> microfit.Microbenchmarks:
    """Microbenchmark seconds a machine with exactly these efficiencies would measure."""
    chain = {m: microfit.projection_floor_s(ISSUE2, dev, m) / e for m, e in e_gemm.items()}
    dec = microfit._attention_op(microfit._floor(ISSUE2, dev, "decode", 8, 768))
    pre = {n: microfit._attention_op(microfit._floor(ISSUE2, dev, "prefill", 1, n)).time_s / e_pre for n in (384, 1536)}
    rows = {1: 1e-4, 2048: 1e-4 + 0.02}  # row kernels: dispatch at one row, + 20 ms of traffic at 2048
    return microfit.Microbenchmarks(chain, (8, 768, dec.time_s / e_dec), pre, {1: host, 64: 2 * host}, {1: 0.0, 64: 0.0}, rows)


def test_fit_recovers_efficiencies_and_prices_steps():
    dev = to_spec(_device())
    mb = _synthetic(dev, {1: 0.9, 64: 0.6, 2048: 0.95}, e_dec=0.8, e_pre=0.5, host=2e-3)
    f = microfit.fit(ISSUE2, dev, mb)
    assert f.gemm_eff == pytest.approx({1: 0.9, 64: 0.6, 2048: 0.95})
    assert f.attention_memory == pytest.approx(0.8) and f.attention_compute(1000) == pytest.approx(0.5)
    # Interpolated in log M: halfway between M = 1 and 64 is M = 8.
    assert f.gemm_efficiency(8) == pytest.approx(0.75) and f.gemm_efficiency(10**6) == pytest.approx(0.95)
    p = microfit.predict_step(ISSUE2, f, phase="decode", batch=1, context_len=128)
    # Batch-1 decode: the projections stream 8 layers x 2.88 M float32 weights at 0.9 x 13 GB/s.
    w = 8 * (512 * 1024 + 512 * 512 + 2 * 512 * 1408 + 1408 * 512) * 4
    assert p.parts_s["projections"] == pytest.approx(w / (13e9 * 0.9), rel=0.01)
    assert p.parts_s["overhead"] == 2e-3 and p.step_time_s == pytest.approx(sum(p.parts_s.values()))
    long = microfit.predict_step(ISSUE2, f, phase="decode", batch=64, context_len=2048)
    kv = 64 * 2048 * 2 * 8 * 4 * 64 * 4  # B x C x (K and V, layers, KV heads, head_dim, 4 bytes)
    assert long.parts_s["attention"] == pytest.approx(kv / (13e9 * 0.8), rel=0.05)
    assert long.parts_s["overhead"] == 4e-3 and long.parts_s["row_ops"] == pytest.approx(0.02 * 6 / 11)  # log-interpolated
    prefill = microfit.predict_step(ISSUE2, f, phase="prefill", batch=1, context_len=2048)
    assert prefill.parts_s["row_ops"] == pytest.approx(0.02) and prefill.parts_s["overhead"] == 2e-3



def test_fixed_parts_are_charged_once_and_prefill_pays_per_token_host_work():
    # At 2 threads every parallel region pays a wake-up of the other thread (10-130 us on a
    # 2-vCPU VM): the probe's step charges it once per call; the chain and the decode attention
    # microbenchmarks contain it too, so their fixed parts (measured at near-empty shapes) come
    # off before the efficiencies are fitted. The prompt's input building adds host time per token.
    dev = to_spec(_device())
    base = _synthetic(dev, {1: 0.9, 2048: 0.95}, e_dec=0.8, e_pre=0.5, host=6e-3)
    chain_fixed, attn_fixed = 3e-3, 1e-3
    mb = dataclasses.replace(
        base, projection_chain_s={m: t + chain_fixed for m, t in base.projection_chain_s.items()},
        decode_attention=(*base.decode_attention[:2], base.decode_attention[2] + attn_fixed),
        chain_fixed_s=chain_fixed, decode_attention_fixed_s=attn_fixed, host_inputs_s={1: 2e-5, 2048: 2e-5 + 1e-3})
    f, plain = microfit.fit(ISSUE2, dev, mb), microfit.fit(ISSUE2, dev, base)
    assert f.gemm_eff == pytest.approx(plain.gemm_eff) and f.attention_memory == pytest.approx(plain.attention_memory)
    dec = microfit.predict_step(ISSUE2, f, phase="decode", batch=1, context_len=128)
    assert dec.step_time_s == pytest.approx(microfit.predict_step(ISSUE2, plain, phase="decode", batch=1,
                                                                  context_len=128).step_time_s)
    assert microfit.predict_step(ISSUE2, f, phase="prefill", batch=1, context_len=2048).parts_s["overhead"] == \
        pytest.approx(6e-3 + 1e-3)
    # A fixed part measured during a burst (above half the measurement) is capped at half.
    burst = dataclasses.replace(base, chain_fixed_s=1.0)
    assert microfit.fit(ISSUE2, dev, burst).gemm_eff[1] == pytest.approx(min(1.0, 2 * plain.gemm_eff[1]))

def test_a_microbenchmark_above_the_roof_raises_the_roof():
    # The peak was measured during a burst of load (half the real one): the microbenchmarks
    # show more, the roofs rise to the best rate shown, and the prediction hardly moves.
    dev = to_spec(_device())
    mb = _synthetic(dev, {1: 0.9, 2048: 0.95}, e_dec=0.8, e_pre=0.5, host=1e-3)
    slow = to_spec(_device(fp32_tflops=0.08, read_gb_per_s=6.0))
    good, bad = microfit.fit(ISSUE2, dev, mb), microfit.fit(ISSUE2, slow, mb)
    assert bad.device.hbm_gb_per_s > 6.0 and bad.device.fp32_tflops > 0.08
    assert max(bad.gemm_eff.values()) == pytest.approx(1.0) and bad.attention_memory <= 1.0
    for phase, b, c in (("decode", 1, 128), ("decode", 64, 2048), ("prefill", 1, 2048)):
        t_good = microfit.predict_step(ISSUE2, good, phase=phase, batch=b, context_len=c).step_time_s
        t_bad = microfit.predict_step(ISSUE2, bad, phase=phase, batch=b, context_len=c).step_time_s
        assert t_bad == pytest.approx(t_good, rel=0.01)  # not exact: a lower ridge moves a few ops' bound


def test_roofline_cli_reads_a_device_file_path(tmp_path, capsys):
    """`stoker roofline --device PATH --dtype fp32`: this machine's measured roofs, priced as the
    float32 CPU engine runs (fp32 weights, KV and activations)."""
    from stoker.cli import main

    path = write_device_file(_device(), tmp_path / "cpu.yaml")
    assert main(["roofline", "--model", "llama-3.2-1b", "--device", str(path), "--dtype", "fp32", "--batch", "1,4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    steps = out["steps"] if isinstance(out, dict) and "steps" in out else out
    assert steps and all(s["gpu"] == "this" for s in steps)
