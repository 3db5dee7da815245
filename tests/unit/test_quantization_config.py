"""Reading quantization from --quantization and config.json (stoker/quantization/config.py):
what each format becomes, and what is refused, with what message."""

from __future__ import annotations

import pytest

from stoker.quantization.config import QuantizationError, online_config, parse_checkpoint_config, resolve


def ct(weights: dict, fmt: str = "float-quantized", acts: dict | None = None, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}, **extra}


FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}


def test_online_methods() -> None:
    q = online_config("int8")
    assert (q.method, q.source, q.weights.strategy, q.online) == ("int8", "online", "channel", True)
    assert q.is_ignored("lm_head") and not q.is_ignored("model.layers.0.mlp.down_proj")
    with pytest.raises(QuantizationError, match="choose one of: fp8, int8"):
        online_config("gptq")


def test_compressed_tensors_schemes() -> None:
    q = parse_checkpoint_config(ct(FP8_CHANNEL, acts={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}))
    assert (q.method, q.weights.strategy, q.weights.dynamic_activations, q.weights.scale_name) == ("fp8", "channel", True, "weight_scale")
    q = parse_checkpoint_config(ct({"num_bits": 8, "type": "int", "strategy": "group", "group_size": 64}, fmt="pack-quantized"))
    assert (q.method, q.weights.group_size, q.weights.packed, q.weights.weight_name) == ("int8", 64, True, "weight_packed")
    q = parse_checkpoint_config(ct({**FP8_CHANNEL, "strategy": "block", "block_structure": [128, 128]},
                                   kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}))
    assert q.weights.block == (128, 128) and q.kv_cache_fp8


def test_fp8_checkpoints() -> None:
    q = parse_checkpoint_config({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
    assert (q.weights.strategy, q.weights.block, q.weights.scale_name) == ("block", (128, 128), "weight_scale_inv")
    q = parse_checkpoint_config({"quant_method": "fp8", "activation_scheme": "static"})
    assert q.weights.strategy == "tensor" and q.weights.static_input_scale


def test_mxfp4_checkpoints() -> None:
    """gpt-oss's: the experts only, E2M1 with an E8M0 scale per 32; the rest stays in the model dtype."""
    q = parse_checkpoint_config({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]})
    assert (q.method, q.weights.dtype, q.weights.group_size, q.experts_only, q.online) == ("mxfp4", "mxfp4", 32, True, False)
    with pytest.raises(QuantizationError, match=r"mxfp4 quantization_config fields \['weight_block_size'\] are not supported"):
        parse_checkpoint_config({"quant_method": "mxfp4", "weight_block_size": [32]})
    with pytest.raises(QuantizationError, match="mxfp4 modules_to_not_convert must be a list"):
        parse_checkpoint_config({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"})


def test_ignore_patterns() -> None:
    q = parse_checkpoint_config(ct(FP8_CHANNEL, ignore=["lm_head", "re:.*mlp\\.down_proj$"]))
    assert q.is_ignored("model.layers.3.mlp.down_proj") and not q.is_ignored("model.layers.3.mlp.up_proj")


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported; supported: compressed-tensors"),
    ({"quant_method": "gptq", "bits": 3}, "gptq checkpoints of 3 bits are not supported"),
    (ct({**FP8_CHANNEL, "num_bits": 4}), "4 bits are not supported"),
    (ct({**FP8_CHANNEL, "symmetric": False}), "asymmetric"),
    (ct({**FP8_CHANNEL, "type": "int"}), "format 'float-quantized' for int weights is not supported"),
    (ct({**FP8_CHANNEL, "strategy": "block"}), "block_structure"),
    (ct(FP8_CHANNEL, kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor"}), "kv_cache_scheme"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
])
def test_unsupported_configs_are_refused_by_name(config: dict, message: str) -> None:
    with pytest.raises(QuantizationError, match=message):
        parse_checkpoint_config(config)


def test_flag_and_checkpoint_must_agree() -> None:
    hf = {"quantization_config": ct(FP8_CHANNEL)}
    assert resolve(hf, None).method == "fp8"
    assert resolve(hf, "fp8").method == "fp8"
    with pytest.raises(QuantizationError, match="--quantization int8 disagrees with the checkpoint"):
        resolve(hf, "int8")
    assert resolve({}, None) is None
    assert resolve({}, "int8").online


@pytest.mark.parametrize("config, message", [
    (ct({**FP8_CHANNEL, "actorder": "group"}), "actorder 'group' is not supported"),
    (ct(FP8_CHANNEL, acts={"num_bits": 8, "type": "float", "strategy": "group", "dynamic": True}), "input_activations"),
])
def test_schemes_the_kernels_cannot_apply_are_refused(config: dict, message: str) -> None:
    with pytest.raises(QuantizationError, match=message):
        parse_checkpoint_config(config)


def test_w8a8_runs_only_where_the_scheme_quantizes_activations(monkeypatch) -> None:
    """A weight-only FP8 checkpoint must not get its activations quantized on an FP8 GPU;
    online FP8 (vLLM's: dynamic per-token) and W8A8 checkpoints do."""
    import torch

    from stoker.models import method_chooser as backends

    monkeypatch.setattr(backends, "fp8_matmul_supported", lambda device: True)
    monkeypatch.setattr(backends.ops, "triton_available", lambda: True)
    cuda = torch.device("cuda")
    weight_only = parse_checkpoint_config(ct(FP8_CHANNEL)).weights
    w8a8 = parse_checkpoint_config(ct(FP8_CHANNEL, acts={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})).weights
    assert backends.quantized_backend(weight_only, cuda, torch.bfloat16) == "triton_w8"
    assert backends.quantized_backend(w8a8, cuda, torch.bfloat16) == "scaled_mm"
    assert backends.quantized_backend(online_config("fp8").weights, cuda, torch.bfloat16) == "scaled_mm"
    assert backends.quantized_backend(online_config("int8").weights, cuda, torch.bfloat16) == "triton_w8"
