"""Exact arithmetic of the roofline: KV bytes, parameter counts, ridge points, bus factors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stoker.roofline.collectives import bus_factor, collective_time
from stoker.roofline.costmodel import step_cost
from stoker.roofline.hardware import get_gpu, get_link, list_gpus
from stoker.roofline.modelspec import get_model_spec, list_models
from stoker.roofline.presets import PRESETS


def test_no_torch_imported() -> None:
    code = ("import sys, stoker.roofline.cli, stoker.roofline.hardware, stoker.roofline.modelspec, "
            "stoker.roofline.costmodel, stoker.roofline.collectives, stoker.roofline.memory, "
            "stoker.roofline.planner, stoker.roofline.measured, stoker.roofline.calibrate, stoker.roofline.report, "
            "stoker.roofline.plot; assert 'torch' not in sys.modules; assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kv_bytes_per_token_match_facts() -> None:
    # facts.md: Llama-3-8B bf16 131072 B, Llama-3-70B bf16 327680 B.
    assert get_model_spec("llama-3-8b").kv_bytes_per_token("bf16") == 131072
    assert get_model_spec("llama-3-70b").kv_bytes_per_token("bf16") == 327680
    assert get_model_spec("llama-3-70b").kv_bytes_per_token("fp8") == 163840
    # 8 KV heads over TP8: one head per GPU; over TP16 replicated, still one per GPU.
    assert get_model_spec("llama-3-70b").kv_bytes_per_token("bf16", tp=8) == 327680 / 8
    assert get_model_spec("llama-3-70b").kv_bytes_per_token("bf16", tp=16) == 327680 / 8


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_counts_within_1pct_of_published(name: str) -> None:
    spec = get_model_spec(name)
    assert spec.num_params == pytest.approx(spec.published_params, rel=PRESETS[name].get("published_params_rel", 0.01))


def test_mixtral_active_params() -> None:
    # Mistral AI, "Mixtral of experts" (mistral.ai/news/mixtral-of-experts): 46.7B total, 12.9B per token.
    spec = get_model_spec("mixtral-8x7b")
    assert spec.is_moe and spec.num_active_params == pytest.approx(12.9e9, rel=0.01)


def test_preset_aliases_and_config_path(tmp_path) -> None:
    assert get_model_spec("meta-llama/Meta-Llama-3-70B-Instruct").name == "llama-3-70b"
    cfg = tmp_path / "ckpt" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text('{"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, '
                   '"num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}')
    assert get_model_spec(str(cfg.parent)).num_params == get_model_spec("llama-3-8b").num_params
    with pytest.raises(ValueError, match="llama-3-8b"):
        get_model_spec("llama-9-1t")
    assert "qwen3-32b" in list_models()


def test_ridge_points_match_facts() -> None:
    # facts.md: H100 SXM bf16 ~295 FLOP/B, H200 ~206.
    assert get_gpu("H100").ridge_point("bf16") == pytest.approx(295, abs=1)
    assert get_gpu("h200").ridge_point("bf16") == pytest.approx(206, abs=1)


def test_gpu_names_aliases_and_mig() -> None:
    for name in ("H100", "h100-sxm", "H200", "A100-80GB", "L40S", "L4", "B200", "MI300X", "h100-pcie"):
        assert get_gpu(name).bf16_tflops > 0
    assert get_gpu("h100") is get_gpu("H100-SXM")
    mig = get_gpu("H100:3g.40gb")
    assert mig.memory_gb == 40 and mig.hbm_gb_per_s == pytest.approx(3350 * 4 / 8)
    assert mig.bf16_tflops == pytest.approx(989 * 3 / 7) and mig.link.kind == "none"
    assert get_gpu("H200:1g.18gb").memory_gb == 18
    with pytest.raises(ValueError, match="3g.40gb"):
        get_gpu("H100:5g.50gb")
    with pytest.raises(ValueError, match="MIG"):
        get_gpu("L40S:1g.6gb")
    with pytest.raises(ValueError, match="H100-SXM"):
        get_gpu("V100")
    assert "MI300X" in list_gpus()


def test_busbw_factors_match_nccl_tests() -> None:
    # nccl-tests doc/PERFORMANCE.md.
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 2) == 1.0
    t = collective_time("all_reduce", 1 << 30, 8, get_link("nvlink4"), protocol="Simple")
    assert t.busbw_gb_per_s == pytest.approx(t.algbw_gb_per_s * 1.75)


def test_alpha_beta_small_and_large_messages() -> None:
    link = get_link("nvlink4")
    small = collective_time("all_reduce", 8, 8, link)
    assert small.protocol == "LL"  # latency-bound: LL's 6.6 us base + 14 hops x 0.6 us
    assert small.time_s == pytest.approx((6.6 + 14 * 0.6) * 1e-6, rel=0.01)
    big = collective_time("all_reduce", 8 << 30, 8, link)
    assert big.protocol == "Simple" and big.busbw_gb_per_s == pytest.approx(450, rel=0.01)
    tree = collective_time("all_reduce", 8, 8, link, algorithm="tree")
    assert tree.time_s < small.time_s  # log-depth latency wins at tiny sizes


def test_decode_floor_is_the_jax_scaling_book_bound() -> None:
    # T >= (batch x KV bytes per seq + weight bytes) / HBM BW (facts.md), at datasheet peaks.
    spec, gpu = get_model_spec("llama-3-8b"), get_gpu("h100")
    s = step_cost(spec, gpu, batch=8, context_len=2048)
    # Decode gathers only `batch` rows of the input embedding table, so it is not streamed.
    streamed = spec.weight_bytes("bf16") - 2 * spec.vocab_size * spec.hidden_size
    bound = (8 * 2048 * spec.kv_bytes_per_token() + streamed) / gpu.hbm_bytes_per_s
    assert s.latency_floor_s >= bound
    assert s.latency_floor_s == pytest.approx(bound, rel=0.02)  # only activations on top
    assert s.step_time_s > s.latency_floor_s


def test_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    assert step_cost("llama-3-8b", "h100", phase="prefill", batch=1, context_len=4096).bound == "compute"
    assert step_cost("llama-3-8b", "h100", batch=1, context_len=4096).bound == "memory"


def test_dtype_names_as_torch_and_vllm_spell_them() -> None:
    from stoker.roofline.modelspec import dtype_bytes

    assert dtype_bytes("bfloat16") == dtype_bytes("bf16") == 2.0  # once mangled into "bfp16"
    assert dtype_bytes("float16") == dtype_bytes("half") == 2.0
    assert dtype_bytes("float32") == 4.0 and dtype_bytes("fp8_e4m3") == 1.0
