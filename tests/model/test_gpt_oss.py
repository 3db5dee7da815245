"""gpt-oss beyond the shared MoE family tests (tests/model/test_moe_families.py): its layers'
attention takes sinks on the C kernels (the torch twins on CUDA: Triton takes none) with the
windows its layer_types say; its experts are a FusedMoE with biases and the clamped SwiGLU, run
by the one-call C kernel on CPU float32; an attention adapter equals PEFT's."""

from __future__ import annotations

import dataclasses

import pytest

from stoker import LLM
from stoker.kernels import ops
from stoker.kernels.cpu import build

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


def test_its_experts_are_a_fused_moe_on_the_c_kernel(tiny_checkpoints) -> None:
    from stoker.layers.activation import ClampedSwiGLU
    from stoker.layers.moe import FusedMoE, PackedCpuMoEMethod

    if not build.available():
        pytest.skip("the C kernels are not built here")
    model = engine(tiny_checkpoints("gpt_oss", **GPT_OSS, swiglu_limit=5.0)).engine.executor.driver_runner.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == GPT_OSS["num_hidden_layers"]
    for moe in moes:
        assert moe.has_bias and isinstance(moe.act, ClampedSwiGLU) and moe.act.limit == 5.0
        assert isinstance(moe.method, PackedCpuMoEMethod) and moe.method.fused_moe is not None
        assert moe.method.activation == "swigluoai" and not moe.method.fuse_silu_and_mul


def test_an_attention_adapter_equals_peft(tiny_checkpoints, tmp_path) -> None:
    """LoRA on the attention projections (biased, with sinks); the experts take none, as on every MoE family."""
    from stoker import LoRARequest, SamplingParams
    from tests.model.helpers import make_adapter, peft_greedy

    base = tiny_checkpoints("gpt_oss", **GPT_OSS)
    adapter = make_adapter(base, tmp_path / "a", ["q_proj", "k_proj", "v_proj", "o_proj"], 8, seed=1)
    llm = engine(base, enable_lora=True, max_lora_rank=16)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 17, 300, 42, 7, 99, 5], [600, 2, 3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(adapter)))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == peft_greedy(base, adapter, prompt, 8)
    llm.engine.check_integrity()
