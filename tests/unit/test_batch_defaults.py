"""The batcher's default preferred batch (pooling/batch_defaults.py): the token count where a
pooling model's projections cross the ridge on this device, from the roofline. A pooling model
computes no logits, so its vocabulary must not move the answer (an LM head priced in made a
MiniLM-shaped encoder 'compute-bound' at 9 tokens on a 2-core CPU, where its projections
cross at ~19)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.roofline.costmodel import Efficiencies, step_cost
from stoker.roofline.device_file import DeviceFile, to_spec, write_device_file
from stoker.roofline.modelspec import spec_from_config
from stoker.pooling.batch_defaults import _spec_config, preferred_batch_tokens

MINILM = dict(model_type="bert", hidden_size=384, intermediate_size=1536, num_attention_heads=12,
              num_hidden_layers=6, vocab_size=30522, max_position_embeddings=512)
QWEN3_EMB = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, num_hidden_layers=28, vocab_size=151669,
                 max_position_embeddings=32768, tie_word_embeddings=True)
CPU = DeviceFile(fp32_tflops=0.32, bf16_tflops=0.166, read_gb_per_s=34.6, memory_gb=23.5, cpu_model="test CPU",
                 isa="avx512", threads=2, measured_at="2026-11-24T00:00:00")


@pytest.fixture
def device_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DeviceFile:
    monkeypatch.setenv("STOKER_DEVICE_FILE", str(write_device_file(CPU, tmp_path / "this-device.yaml")))
    return CPU


def _projections_compute_bound(cfg: dict, tokens: int, weight_dtype: str) -> bool:
    """More than half the projections' GEMM time compute-bound at `tokens` (the LM head left out)."""
    step = step_cost(spec_from_config(_spec_config(cfg), name="m"), to_spec(CPU), batch=tokens, context_len=1,
                     weight_dtype=weight_dtype, act_dtype="fp32", eff=Efficiencies.ideal())
    gemms = [op for op in step.ops if op.op_class == "gemm" and op.name != "lm_head"]
    return sum(op.time_s for op in gemms if op.bound == "compute") > sum(op.time_s for op in gemms) / 2


@pytest.mark.parametrize("cfg", [MINILM, QWEN3_EMB], ids=["bert", "decoder-embedder"])
def test_the_default_is_where_the_projections_cross_the_ridge(device_file: DeviceFile, cfg: dict) -> None:
    tokens = preferred_batch_tokens(cfg, None, "fp32")
    assert tokens is not None and tokens > 1
    assert _projections_compute_bound(cfg, tokens, "fp32") and not _projections_compute_bound(cfg, tokens - 1, "fp32")
    # first principles for fp32 weights: 2 FLOPs per 4-byte weight per token, so at least
    # 2 x ridge tokens (activations' bytes only push it up)
    ridge = CPU.fp32_tflops * 1e12 / (CPU.read_gb_per_s * 1e9)
    assert tokens >= 2 * ridge


def test_a_pooling_models_vocabulary_does_not_move_it(device_file: DeviceFile) -> None:
    small = preferred_batch_tokens(MINILM, None, "fp32")
    assert preferred_batch_tokens({**MINILM, "vocab_size": 250002}, None, "fp32") == small  # XLM-R's vocabulary
    assert preferred_batch_tokens({**MINILM, "vocab_size": 1000}, None, "fp32") == small


def test_a_gpu_from_the_table_and_no_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_DEVICE_FILE", str(tmp_path / "absent.yaml"))
    assert preferred_batch_tokens(MINILM, None, "fp32") is None  # CPU without a device file: no default
    h100 = preferred_batch_tokens(MINILM, "NVIDIA H100 80GB HBM3", "bf16")
    assert h100 is not None and h100 > 32 * 8  # 32 eight-token queries are still weight-bound there
    assert preferred_batch_tokens({**MINILM, "vocab_size": 250002}, "NVIDIA H100 80GB HBM3", "bf16") == h100


def test_a_cpu_without_a_device_file_is_measured_once_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  device_file: DeviceFile) -> None:
    from stoker.pooling.batch_defaults import measured_cpu_spec

    from_file = preferred_batch_tokens(MINILM, None, "fp32")
    monkeypatch.setenv("STOKER_DEVICE_FILE", str(tmp_path / "absent.yaml"))
    calls: list[int] = []

    def measure() -> DeviceFile:
        calls.append(1)
        return CPU

    measured_cpu_spec.cache_clear()
    try:
        assert preferred_batch_tokens(MINILM, None, "fp32") is None and not calls  # not asked: nothing measured
        assert preferred_batch_tokens(MINILM, None, "fp32", measure_cpu=measure) == from_file  # the same roofs
        assert preferred_batch_tokens(QWEN3_EMB, None, "fp32", measure_cpu=measure) is not None
        assert calls == [1], "measured once per process"
        assert preferred_batch_tokens(MINILM, "NVIDIA H100 80GB HBM3", "bf16", measure_cpu=measure) > 32 * 8
    finally:
        measured_cpu_spec.cache_clear()


def test_the_quick_measurement_of_this_cpu() -> None:
    """The real probe: positive roofs and a crossover a MiniLM-shaped encoder can reach (on the
    2-core Xeon VM it was 19 tokens with the doctor's full device file)."""
    from stoker.doctor.device import quick_cpu_device
    from stoker.roofline.costmodel import crossover_batch

    device = quick_cpu_device()
    assert device.fp32_tflops > 0 and device.read_gb_per_s > 0
    assert any(k.startswith("read_") and "256mib" in k for k in device.measurements)
    assert not any(k.startswith("read_") and "64mib" in k for k in device.measurements), "no cache-sized buffer"
    tokens = crossover_batch(spec_from_config(_spec_config(MINILM), name="m"), to_spec(device), context_len=1,
                             weight_dtype="fp32", act_dtype="fp32", lm_head=False)
    assert 1 < tokens < 4096
