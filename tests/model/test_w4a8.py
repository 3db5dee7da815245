"""W4A8 in the engine: `activation_dtype="int8"` (`--activation-dtype int8`) runs int4 projections
through the int8-activation kernel (linear_q4_a8.h) on the same panels as W4A16.

Teacher-forced over 256 positions, against the same int4 weights with float activations
(W4A16, the default): mean KL(W4A16 || W4A8) of the next-token distributions and top-1
agreement. Measured on the tiny random llama (hidden 128, intermediate 256, 2 layers, online
int4 groups of 128, seed 0; AVX-512 build, every build gives the same bits): KL 4.8e-4, top-1
0.957 (int8 weights against float weights, test_int4.py: 5.8-8.0e-4, 0.95-0.97). Bounds: KL <
0.002 (4x), top-1 >= 0.9; a planted fault, one group's scale off by 2x in one layer of the W4A8
model, gives KL 0.28 and top-1 0.40, outside both. W4A8 must differ from W4A16 (KL > 0).

A GGUF Q4_K_M file's Q6_K tensors (the LM head, a "more bits" layer's v and down) run W6A8 with
the flag (linear_q6_a8.h: Q6_K's own 6-bit codes against the same int8 activations) and its Q4_K
tensors W4A8 in Q4_K's own bytes (linear_q4k_a8.h: 6-bit sub-scales, a float pair per 256):
measured on the tiny llama (hidden 256, intermediate 256, 2 layers, the tests' llama-quantize
rules), against the file with float activations, KL 2.1e-3 / top-1 0.949 (W4A8 on float32
scales alone: 2.0e-3 / 0.938); bounds KL < 0.006, top-1 >= 0.9; one planted fault (the head's
first super-scales doubled) gives KL 1.9, top-1 0.12.

Also: every int4 projection, and only those, reports W4A8; refusals, each naming the problem:
a float model, weights that are not int4, a model the CPU kernels do not run (bfloat16 here,
the same path as a CUDA device), an unknown value; the CLI flag reaches the engine.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from stoker import LLM
from stoker.kernels.cpu import linear as cpu_linear
from stoker.kernels.cpu import linear_q6
from stoker.layers.quantized_method import QuantizedLinearMethod
from stoker.engine.args import add_engine_args, engine_kwargs
from stoker.layers.int4_method import Int4LinearMethod
from stoker.layers.linear import Linear
from stoker.quantization.config import QuantizationError
from stoker.testing.gguf_checkpoint import llama_cpp_types, write_gguf
from stoker.testing.tiny_checkpoint import copy_demo_tokenizer
from tests.model.helpers import engine_logits, kl_and_top1, teacher_forced_positions

SHAPE = dict(hidden_size=128, intermediate_size=256)  # whole groups of 128 in every projection
MAX_KL, MIN_TOP1 = 0.002, 0.9


@pytest.fixture(scope="module")
def positions() -> list[int]:
    return teacher_forced_positions()


def _llm(path, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, device="cpu", max_model_len=512, quantization="int4", **kw)


def test_w4a8_stays_within_bounds_of_w4a16_and_a_planted_fault_does_not(tiny_checkpoints, positions) -> None:
    path = tiny_checkpoints("llama", **SHAPE)
    w4a16 = engine_logits(_llm(path), positions)
    llm = _llm(path, activation_dtype="int8")
    model = llm.engine.executor.driver_runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and isinstance(m.method, Int4LinearMethod)]
    assert len(layers) == 4 * llm.engine.hf_config["num_hidden_layers"]
    assert all(m.method.describe() == "int4 group 128 W4A8 (int8 activations) via cpu_q4" for m in layers)
    kl, top1 = kl_and_top1(w4a16, engine_logits(llm, positions))
    assert 0 < kl < MAX_KL and top1 >= MIN_TOP1, f"KL {kl:.5f}, top-1 {top1:.3f}"
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight_offset is None  # symmetric: doubling s doubles w
    layer.weight_scale.data[0] *= 2
    kl, top1 = kl_and_top1(w4a16, engine_logits(llm, positions))
    assert kl > MAX_KL and top1 < MIN_TOP1, f"planted fault: KL {kl:.5f}, top-1 {top1:.3f}"


def test_a_gguf_files_q6_k_tensors_run_w6a8_in_q6_ks_bytes(tiny_checkpoints, positions, tmp_path) -> None:
    src = tiny_checkpoints("llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2)
    (tmp_path / "file").mkdir()
    path = write_gguf(src, tmp_path / "file" / "model.gguf", llama_cpp_types("Q4_K_M", 2), "llama")
    copy_demo_tokenizer(tmp_path / "file")

    def gguf(**kw) -> LLM:
        return LLM(str(path), device="cpu", max_model_len=512, kv_cache_memory_bytes=8 << 20, **kw)

    ref = engine_logits(gguf(), positions)
    llm = gguf(activation_dtype="int8")
    model = llm.engine.executor.driver_runner.model
    held = {name: m for name, m in model.named_modules() if isinstance(m, Linear) and isinstance(m.method, QuantizedLinearMethod)}
    assert sorted(held) == ["lm_head", "model.layers.1.mlp.down_proj"]  # and layer 1's v, in its composite qkv
    nr = cpu_linear.panel_width()
    for m in held.values():
        assert m.method.describe() == "int8 group held 6-bit (Q6_K), W6A8 (int8 activations) via cpu_q8"
        padded = -(-m.out_features // nr) * nr
        assert m.weight.numel() == padded * m.in_features * 13 // 16  # 6.5 bits a weight, Q6_K's codes and sub-scales
        assert m.weight_scale.numel() == padded * m.in_features // linear_q6.SUPER  # a float32 d per 256
    assert "v: int8 group held 6-bit (Q6_K), W6A8" in model.model.layers[1].self_attn.qkv_proj.method.describe()
    q4k = [m for m in model.modules() if isinstance(m, Linear) and isinstance(m.method, Int4LinearMethod)]
    assert len(q4k) == 6 and all(m.method.held == "q4k" for m in q4k)  # Q4_K: gate_up x 2, o x 2, qkv, down
    for m in q4k:  # the codes' panels, one byte of sc and of m per 32, a float32 d and dmin per 256
        padded = -(-m.out_features // nr) * nr
        assert m.weight_scale.dtype == torch.uint8 and m.weight_scale.numel() == 2 * padded * m.in_features // 32
        assert m.weight_offset.numel() == 2 * padded * m.in_features // 256
    kl, top1 = kl_and_top1(ref, engine_logits(llm, positions))
    assert 0 < kl < 0.006 and top1 >= MIN_TOP1, f"KL {kl:.5f}, top-1 {top1:.3f}"
    held["lm_head"].weight_scale.data[0, :64] *= 2
    kl, top1 = kl_and_top1(ref, engine_logits(llm, positions))
    assert kl > 0.006 and top1 < MIN_TOP1, f"planted fault: KL {kl:.5f}, top-1 {top1:.3f}"


def test_what_w4a8_cannot_apply_to_is_refused(tiny_checkpoints) -> None:
    path = tiny_checkpoints("llama", **SHAPE)
    with pytest.raises(ValueError, match="weights are float"):
        LLM(str(path), kv_cache_memory_bytes=8 << 20, max_model_len=64, activation_dtype="int8")
    with pytest.raises(ValueError, match="no int4 projection"):
        LLM(str(path), kv_cache_memory_bytes=8 << 20, max_model_len=64, quantization="int8", activation_dtype="int8")
    with pytest.raises(QuantizationError, match="runs on the CPU kernels with a float32 model"):
        _llm(path, activation_dtype="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="activation_dtype 'fp8' is not supported"):
        _llm(path, activation_dtype="fp8")


def test_the_cli_flag_reaches_the_engine() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--model", "m", "--activation-dtype", "int8"]))["activation_dtype"] == "int8"
    assert engine_kwargs(parser.parse_args(["--model", "m"]))["activation_dtype"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--activation-dtype", "int4"])
