"""gpt-oss beyond the shared MoE family tests (tests/model/test_moe_families.py): its layers'
attention takes sinks on the C kernels (the torch twins on CUDA: Triton takes none) with the
windows its layer_types say; what it does not serve yet is refused by name: MXFP4 checkpoints, online
quantization of its experts, LoRA."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from stoker import LLM
from stoker.kernels import ops
from stoker.kernels.cpu import build
from stoker.quantization.config import QuantizationError

GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, head_dim=16, sliding_window=24,
               num_hidden_layers=3)


def engine(path, **kw) -> LLM:
    return LLM(str(path), max_model_len=128, kv_cache_memory_bytes=1 << 20, **kw)


def test_attention_takes_sinks_on_the_c_kernels_with_alternating_windows(tiny_checkpoints) -> None:
    model = engine(tiny_checkpoints("gpt_oss", **GPT_OSS)).engine.executor.driver_runner.model
    attns = model.attention_layers()
    assert [a.sliding_window for a in attns] == [24, None, 24]  # transformers' default layer_types
    assert all(a.with_sinks and a.kernels.name == ("cpu" if build.available() else "torch") for a in attns)
    assert model.model.layers[0].self_attn.o_proj.has_bias


def test_on_cuda_a_layer_with_sinks_gets_the_torch_twins(monkeypatch) -> None:
    """The Triton kernels take no sinks: bind_kernels gives such a layer the twins."""
    import torch

    from stoker.layers.attention import Attention
    from stoker.models import method_chooser

    triton_like = dataclasses.replace(ops.TORCH, name="triton")
    monkeypatch.setattr(method_chooser.ops, "select", lambda *args, **kwargs: triton_like)
    model = torch.nn.ModuleList([Attention(4, 2, 16, 0.25, with_sinks=True), Attention(4, 2, 16, 0.25)])
    method_chooser.bind_kernels(model, torch.device("cpu"), torch.float32)
    assert model[0].kernels is ops.TORCH and model[1].kernels.name == "triton"


def test_mxfp4_checkpoints_are_refused_by_name(tiny_checkpoints, tmp_path) -> None:
    path = shutil.copytree(tiny_checkpoints("gpt_oss", **GPT_OSS), tmp_path / "mxfp4")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mxfp4"):
        engine(path)


def test_online_quantization_of_its_experts_is_refused(tiny_checkpoints) -> None:
    with pytest.raises(QuantizationError, match=r"fp8 quantization .* Mixture-of-Experts experts is not supported"):
        engine(tiny_checkpoints("gpt_oss", **GPT_OSS), quantization="fp8")


def test_lora_is_refused(tiny_checkpoints) -> None:
    with pytest.raises(ValueError, match=r"LoRA \(--enable-lora\) is not supported on Mixture-of-Experts .*GptOssExperts"):
        engine(tiny_checkpoints("gpt_oss", **GPT_OSS), enable_lora=True)


def test_the_family_refuses_mxfp4_and_tensor_parallelism_itself(tiny_checkpoints) -> None:
    """The engine's quantization config refuses mxfp4 first today; the family says it too,
    for the day a checkpoint format reader accepts it before the experts do."""
    from types import SimpleNamespace

    from stoker.models.gpt_oss import GptOssForCausalLM

    cfg = json.loads((tiny_checkpoints("gpt_oss", **GPT_OSS) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"gpt-oss MXFP4 checkpoints \(quantization_config quant_method mxfp4"):
        GptOssForCausalLM({**cfg, "quantization_config": {"quant_method": "mxfp4"}}, 128)
    with pytest.raises(ValueError, match=r"tensor parallelism .* not supported for gpt-oss"):
        GptOssForCausalLM(cfg, 128, SimpleNamespace(world_size=2, rank=0))
