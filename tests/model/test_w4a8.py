"""W4A8 in the engine: `activation_dtype="int8"` (`--activation-dtype int8`) runs int4 projections
through the int8-activation kernel (linear_q4_a8.h) on the same panels as W4A16.

Teacher-forced over 256 positions, against the same int4 weights with float activations
(W4A16, the default): mean KL(W4A16 || W4A8) of the next-token distributions and top-1
agreement. Measured on the tiny random llama (hidden 128, intermediate 256, 2 layers, online
int4 groups of 128, seed 0; AVX-512 build, every build gives the same bits): KL 4.8e-4, top-1
0.957 (int8 weights against float weights, test_int4.py: 5.8-8.0e-4, 0.95-0.97). Bounds: KL <
0.002 (4x), top-1 >= 0.9; a planted fault, one group's scale off by 2x in one layer of the W4A8
model, gives KL 0.28 and top-1 0.40, outside both. W4A8 must differ from W4A16 (KL > 0).

Also: every int4 projection, and only those, reports W4A8; refusals, each naming the problem:
a float model, weights that are not int4, a model the CPU kernels do not run (bfloat16 here,
the same path as a CUDA device), an unknown value; the CLI flag reaches the engine.
"""

from __future__ import annotations

import argparse

import pytest

from stoker import LLM
from stoker.engine.args import add_engine_args, engine_kwargs
from stoker.layers.int4_method import Int4LinearMethod
from stoker.layers.linear import Linear
from stoker.quantization.config import QuantizationError
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
