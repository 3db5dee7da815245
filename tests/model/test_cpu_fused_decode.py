"""The CPU decode step in one C call (runner/cpu_decode.py, kernels/cpu/decoder_layer.c).

The fused step must give the module path's logits bit for bit: the same greedy tokens and the
same logprobs (floats compared exactly) from an engine with it and one without
(`enforce_eager=True` keeps the module path), over several sequences of different lengths
decoding together, for each thing the C call does differently:
float32 panels with an intermediate size they cannot fuse (the separate SiLU-and-mul); Qwen2's
q/k/v biases with a sliding window shorter than the contexts, int8 weights; Qwen3's per-head q/k
norms with W4A8 int4; W4A16 int4 (these three with the fused SiLU epilogue); and a Q4_K_M GGUF
file, whose "more bits" layer runs q/k and v as two kernels writing one output. Each case also checks
that the fused call ran for every decode step.

And: what it does not take is refused at bind time with the reason (a Gemma model, an FP8 KV
cache, LoRA), and a bad per-step input is refused naming the stage, before anything is written
past it.
"""

from __future__ import annotations

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.kernels.cpu import build as cpu_build
from stoker.kernels.cpu.decoder_layer import decoder_decode
from stoker.runner.cpu_decode import CpuDecodeRunner
from stoker.testing.gguf_checkpoint import llama_cpp_types, write_gguf
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C kernels are not available")

PROMPTS = [[5, 9, 17], list(range(20, 40)), [7] * 11]  # 3, 20 and 11 tokens: different contexts
CASES = {
    "llama-f32-unfused": ("llama", dict(intermediate_size=72), {}),  # 72: not whole panels of gate and up
    "qwen2-bias-window-int8": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
                               dict(quantization="int8")),
    "qwen3-qknorm-w4a8": ("qwen3", dict(hidden_size=128, intermediate_size=256),
                          dict(quantization="int4", activation_dtype="int8")),
    "llama-w4a16": ("llama", dict(hidden_size=128, intermediate_size=256), dict(quantization="int4")),
}

def _generate(path, eager: bool, **kw) -> tuple[list, int]:
    llm = LLM(str(path), device="cpu", max_model_len=128, kv_cache_memory_bytes=4 << 20, max_num_seqs=4,
              enforce_eager=eager, **kw)
    runner = llm.engine.executor.driver_runner
    calls = 0
    if not eager:
        assert runner.cpu_decode is not None, "the fused decode was not bound"
        run = runner.cpu_decode.run

        def counted(*args):
            nonlocal calls
            calls += 1
            return run(*args)

        runner.cpu_decode.run = counted
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fused_step_gives_the_module_paths_logprobs_bit_for_bit(tiny_checkpoints, case) -> None:
    arch, shape, engine_kw = CASES[case]
    path = tiny_checkpoints(arch, **shape)
    module, _ = _generate(path, eager=True, **engine_kw)
    fused, calls = _generate(path, eager=False, **engine_kw)
    assert calls >= 9, f"the fused step ran {calls} times"  # every step after the prefill is a pure decode
    for (ids_m, lp_m), (ids_f, lp_f) in zip(module, fused):
        assert ids_f == ids_m
        assert lp_f == lp_m  # every logprob float equal: the same logits


def test_a_gguf_k_quant_mix_runs_fused_with_its_composite_layers(tiny_checkpoints, tmp_path) -> None:
    """Q4_K_M: layer 1's q/k (asymmetric int4, Q4_K) beside its v (int8 groups of 16, Q6_K) write
    their columns of one qkv output; its down is Q6_K. W4A8 on the int4 runs."""
    src = tiny_checkpoints("llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2)
    (tmp_path / "file").mkdir()
    path = write_gguf(src, tmp_path / "file" / "model.gguf", llama_cpp_types("Q4_K_M", 2), "llama")
    copy_demo_tokenizer(tmp_path / "file")
    module, _ = _generate(path, eager=True, activation_dtype="int8")
    fused, calls = _generate(path, eager=False, activation_dtype="int8")
    assert calls >= 9
    assert fused == module


def test_what_the_fused_step_does_not_take_is_refused_with_the_reason(tiny_checkpoints) -> None:
    cases = [
        (tiny_checkpoints("gemma2"), {}, "is not built from LlamaModel's layers"),
        (tiny_checkpoints("llama"), dict(kv_cache_dtype="fp8"), "KV cache is torch.float8_e4m3fn"),
    ]
    for path, kw, why in cases:
        llm = LLM(str(path), device="cpu", max_model_len=64, kv_cache_memory_bytes=2 << 20, **kw)
        runner = llm.engine.executor.driver_runner
        assert runner.cpu_decode is None
        built, reason = CpuDecodeRunner.build(runner.model, 1)
        assert built is None and why in reason, reason
        assert CpuDecodeRunner.build(runner.model, 2) == (None, "tensor parallelism (the all-reduces run between the layers)")
        del llm
    lora = LLM(str(tiny_checkpoints("llama")), device="cpu", max_model_len=64, kv_cache_memory_bytes=2 << 20,
               enable_lora=True, max_lora_rank=8)
    assert lora.engine.executor.driver_runner.cpu_decode is None


def test_a_bad_step_input_is_refused_naming_the_stage(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints("llama")), device="cpu", max_model_len=64, kv_cache_memory_bytes=2 << 20)
    runner = llm.engine.executor.driver_runner
    layers = runner.cpu_decode.layers
    k_cache = layers.layers[0].k_cache
    before = k_cache.clone()
    x = torch.randn(1, layers.hidden)
    ok = dict(positions=torch.tensor([3]), slot_mapping=torch.tensor([0]), block_tables=torch.zeros(1, 4, dtype=torch.int32),
              context_lens=torch.tensor([4], dtype=torch.int32))
    bad = [
        (dict(positions=torch.tensor([10_000])), "outside the rotary table"),
        (dict(slot_mapping=torch.tensor([k_cache.shape[0] * k_cache.shape[1]])), "past the KV cache's slots"),
        (dict(context_lens=torch.tensor([10_000], dtype=torch.int32)), "needs more blocks"),
        (dict(block_tables=torch.full((1, 4), k_cache.shape[0], dtype=torch.int32)), "block id is outside"),
        (dict(positions=torch.tensor([3], dtype=torch.int32)), "positions must be contiguous (1,) torch.int64"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            decoder_decode(layers, x.clone(), **{**ok, **change})
        if "rotary" in message:  # refused in layer 0 before its store: the cache is untouched
            assert torch.equal(k_cache, before)
    res = decoder_decode(layers, x.clone(), **ok)
    assert res.shape == x.shape and torch.isfinite(res).all()
