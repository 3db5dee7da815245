"""4-bit weights in the engine (layers/int4_method.py).

Online `--quantization int4` (round-to-nearest, symmetric, groups of 128) against the float
model it comes from, teacher-forced over 256 positions (as test_online_quantization.py):
mean KL(float || int4) of the next-token distributions and top-1 agreement. Measured on these
tiny random models (hidden 128, intermediate 256, 2 layers; seeds 0 and 1, AVX-512 build):

                      mean KL        top-1
    llama             0.18-0.20      0.46-0.51
    qwen3             0.20-0.22      0.42-0.49
    (int8, same models: 5.8-8.0e-4, 0.95-0.97)

4-bit RTN on random Gaussian weights is the hard case (no outliers to spend the range on; the
error is ~18x int8's, so KL ~300x). The bounds, KL < 0.3 and top-1 >= 0.38, are 1.4x the worst
KL and 4 points under the worst top-1; a planted fault, one group's scale and offset off by 2x
in one layer (that layer's group weighs twice), gives KL 0.43-0.46 and top-1 0.24-0.30, outside
both. The quantized model must differ from the float one (KL > 0).

Also: the same int4 model through the dequantizing twin (no C kernels) and through the nibble
kernel; the bytes held are exactly the packed codes plus float32 scales and offsets; a K that is
not whole groups is refused naming the layer; LoRA on an int4 base equals PEFT on the
dequantized base; compressed-tensors pack-quantized W4A16 checkpoints (symmetric and with zero
points) equal HF transformers on the dequantized weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stoker import LLM, LoRARequest, SamplingParams
from stoker.layers.int4_method import Int4LinearMethod
from stoker.layers.linear import Linear
from stoker.quantization import int4
from stoker.quantization.config import QuantizationError, parse_checkpoint_config
from stoker.testing.quantized_checkpoint import quantize_checkpoint
from tests.model.helpers import (engine_logits, hf_greedy, hf_logits, kl_and_top1, load_hf, make_adapter, peft_greedy,
                                 teacher_forced_positions)

SHAPE = dict(hidden_size=128, intermediate_size=256)  # whole groups of 128 in every projection
ARCHS = {"llama": ("llama", SHAPE), "qwen3": ("qwen3", dict(SHAPE, head_dim=32))}
MAX_KL, MIN_TOP1 = 0.3, 0.38


@pytest.fixture(scope="module")
def positions() -> list[int]:
    return teacher_forced_positions()


def _llm(path, **kw) -> LLM:
    return LLM(str(path), kv_cache_memory_bytes=8 << 20, device="cpu", max_model_len=512, **kw)


def _int4_layers(llm: LLM) -> list[Linear]:
    model = llm.engine.executor.driver_runner.model
    return [m for m in model.modules() if isinstance(m, Linear) and isinstance(getattr(m.method, "base", m.method), Int4LinearMethod)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_online_int4_stays_within_bounds_of_the_float_model(arch, tiny_checkpoints, positions) -> None:
    family, overrides = ARCHS[arch]
    path = tiny_checkpoints(family, **overrides)
    ref = engine_logits(_llm(path), positions)
    llm = _llm(path, quantization="int4")
    layers = _int4_layers(llm)
    assert len(layers) == 4 * llm.engine.hf_config["num_hidden_layers"]
    assert all(m.method.describe() == "int4 group 128 via cpu_q4" for m in layers)
    kl, top1 = kl_and_top1(ref, engine_logits(llm, positions))
    assert 0 < kl < MAX_KL and top1 >= MIN_TOP1, f"KL {kl:.3f}, top-1 {top1:.3f}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_scale_off_by_2x_in_one_group_exceeds_the_bounds(arch, tiny_checkpoints, positions) -> None:
    family, overrides = ARCHS[arch]
    path = tiny_checkpoints(family, **overrides)
    ref = engine_logits(_llm(path), positions)
    llm = _llm(path, quantization="int4")
    layer = llm.engine.executor.driver_runner.model.model.layers[0].mlp.down_proj
    # (G, P * NR) in panel order: group 0 of every output row; w = (q - 8) s + (o + 8 s), and
    # symmetric weights hold no offset (o + 8 s = 0): doubling s doubles w
    assert layer.weight_offset is None
    layer.weight_scale.data[0] *= 2
    kl, top1 = kl_and_top1(ref, engine_logits(llm, positions))
    assert kl > MAX_KL and top1 < MIN_TOP1, f"KL {kl:.3f}, top-1 {top1:.3f}"


def test_twin_backend_equals_the_c_kernel(tiny_checkpoints, positions, monkeypatch) -> None:
    path = tiny_checkpoints("llama", **SHAPE)
    kernel = engine_logits(_llm(path, quantization="int4"), positions[:64])
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    llm = _llm(path, quantization="int4")
    assert all(m.method.backend == "dequant" for m in _int4_layers(llm))
    torch.testing.assert_close(engine_logits(llm, positions[:64]), kernel, rtol=1e-4, atol=1e-4)


def test_weight_bytes_are_the_packed_codes_plus_scales_and_offsets(tiny_checkpoints) -> None:
    from stoker.kernels.cpu import linear as cpu_linear

    path = tiny_checkpoints("llama", **SHAPE)
    llm = _llm(path, quantization="int4")
    nr = cpu_linear.panel_width()
    for m in _int4_layers(llm):
        rows = -(-m.out_features // nr) * nr  # panels pad N to whole panels of NR columns
        groups = m.in_features // 128
        # symmetric: float16 scales (exact: online int4 rounds them so), no offsets
        assert m.weight_offset is None and m.weight_scale.dtype == torch.float16
        held = sum(p.numel() * p.element_size() for p in (m.weight, m.weight_scale))
        assert held == rows * m.in_features // 2 + 2 * rows * groups
    # The start-up log's prediction (roofline's formula for Stoker's int4) is what is held:
    # these shapes fill whole panels, so there is no padding to tell them apart.
    from stoker.roofline.modelspec import spec_from_config

    runner = llm.engine.executor.driver_runner
    held = runner.weight_bytes_held()
    assert spec_from_config(runner.hf_config).engine_int4_weight_bytes(128, "float32") == held
    # and what the planner prices for this shape with --quantization int4 (roofline's int4)
    assert spec_from_config(runner.hf_config).weight_bytes("int4", rest_dtype="float32") == held
    assert "int4 (fp16 scales) projections" in runner.weights_summary()


def test_an_asymmetric_checkpoint_is_priced_from_the_bytes_the_engine_holds(tiny_checkpoints, tmp_path) -> None:
    """AWQ (zero points, float16 scales, groups of 32): the planner's spec of the checkpoint's
    config.json prices half a byte a weight plus a float16 scale and a float32 offset per group,
    and the float embedding and LM head (AWQ leaves lm_head unquantized) in the engine's float32:
    to the byte what the engine holds (these shapes fill whole CPU panels: no padding)."""
    from stoker.roofline.modelspec import get_model_spec

    q = quantize_checkpoint(tiny_checkpoints("llama", **SHAPE), tmp_path / "awq", "awq")
    llm = _llm(q)
    layers = _int4_layers(llm)
    assert layers and all(m.weight_offset is not None and m.weight_offset.dtype == torch.float32
                          and m.weight_scale.dtype == torch.float16 for m in layers)
    runner = llm.engine.executor.driver_runner
    spec = get_model_spec(str(q))  # as `stoker plan` reads the folder
    assert (spec.checkpoint_dtype, spec.int4_group_size, spec.int4_symmetric) == ("int4", 32, False)
    held = runner.weight_bytes_held()
    assert spec.weight_bytes("int4", rest_dtype="float32") == held
    c = spec.param_counts()
    quantized = c["attention"] + c["mlp"]
    assert held == quantized // 2 + (quantized // 32) * (2 + 4) + (c["embedding"] + c["lm_head"] + c["norms"]) * 4
    assert "int4 (fp16 scales, float32 offsets) projections" in runner.weights_summary()


def test_k_not_whole_groups_is_refused_naming_the_layer(tiny_llama) -> None:
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj: 64 input columns are not whole int4 groups of 128"):
        _llm(tiny_llama, quantization="int4")


def _dequantized_copy(src: Path, dst: Path) -> Path:
    """src with each decoder projection replaced by what --quantization int4 makes of it."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            tensors[name] = int4.dequantize(*int4.quantize(t, 128, symmetric=True), 128).to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_lora_on_an_int4_base_equals_peft_on_the_dequantized_base(tiny_checkpoints, tmp_path) -> None:
    base = tiny_checkpoints("llama", **SHAPE)
    deq = _dequantized_copy(base, tmp_path / "deq")
    adapter = make_adapter(deq, tmp_path / "a", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, seed=1)
    llm = _llm(base, quantization="int4", enable_lora=True, max_lora_rank=8)
    prompts = [[1, 17, 300, 42, 7, 99, 5], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [600, 2, 3]]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False,
                                                         lora_request=LoRARequest("a", 1, str(adapter)))]
    assert got == [peft_greedy(deq, adapter, p, 10) for p in prompts]
    plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    assert plain != got and plain == [hf_greedy(load_hf(deq), p, 10) for p in prompts]


# ---------------------------------------------------------------- compressed-tensors W4A16
W4_ARCHS = {"llama": ("llama", {}), "qwen3": ("qwen3", dict(head_dim=32))}  # hidden 64: groups of 32
PROMPTS = [[0] + list(range(7, 70)), [0, 99, 5, 17, 256, 800, 3]]


@pytest.mark.parametrize("fmt", ["ct-w4a16-group", "ct-w4a16-asym-group"])
@pytest.mark.parametrize("arch", list(W4_ARCHS))
def test_w4a16_checkpoint_matches_hf_on_dequantized_weights(arch, fmt, tiny_checkpoints, tmp_path) -> None:
    family, overrides = W4_ARCHS[arch]
    q = quantize_checkpoint(tiny_checkpoints(family, **overrides), tmp_path / "q", fmt, dequantized_dst=tmp_path / "deq")
    llm = _llm(q)
    layers = _int4_layers(llm)
    assert len(layers) == 4 * llm.engine.hf_config["num_hidden_layers"]
    assert all(m.method.scheme.symmetric == ("asym" not in fmt) and m.method.group_k == 32 for m in layers)
    hf = load_hf(tmp_path / "deq")
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("fmt", ["gptq-sym", "gptq-asym", "awq"])
@pytest.mark.parametrize("arch", list(W4_ARCHS))
def test_gptq_and_awq_checkpoints_match_hf_on_dequantized_weights(arch, fmt, tiny_checkpoints, tmp_path) -> None:
    family, overrides = W4_ARCHS[arch]
    q = quantize_checkpoint(tiny_checkpoints(family, **overrides), tmp_path / "q", fmt, dequantized_dst=tmp_path / "deq")
    llm = _llm(q)
    layers = _int4_layers(llm)
    assert len(layers) == 4 * llm.engine.hf_config["num_hidden_layers"]
    assert all(m.method.layout == fmt.split("-")[0] and m.method.group_k == 32 for m in layers)
    hf = load_hf(tmp_path / "deq")
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)


def test_gptq_act_order_g_idx_is_refused_by_name(tiny_checkpoints, tmp_path) -> None:
    q = quantize_checkpoint(tiny_checkpoints("llama"), tmp_path / "q", "gptq-sym")
    tensors = load_file(str(q / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # desc_act: columns in activation order
    save_file(tensors, str(q / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="g_idx is not in plain group order .*desc_act"):
        _llm(q)


@pytest.mark.parametrize("change, message", [
    (dict(quant_method="gptq", bits=8), "gptq checkpoints of 8 bits are not supported"),
    (dict(quant_method="gptq", bits=4, checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (dict(quant_method="awq", bits=4, version="gemv"), "awq version 'gemv'"),
    (dict(quant_method="awq", bits=4, zero_point=False), "zero_point false"),
])
def test_gptq_awq_variants_are_refused_by_field(change, message) -> None:
    with pytest.raises(QuantizationError, match=message):
        parse_checkpoint_config({"group_size": 128, **change})
    ok = parse_checkpoint_config({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False, "desc_act": True})
    assert (ok.weights.strategy, ok.weights.symmetric, ok.weights.int4_layout) == ("channel", False, "gptq")


def _w4_config(**weights) -> dict:
    w = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True, "actorder": None, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None}}}


def test_w4a16_config_maps_onto_int4_and_refuses_what_it_cannot_honour() -> None:
    cfg = parse_checkpoint_config(_w4_config(symmetric=False, group_size=64))
    assert (cfg.method, cfg.weights.dtype, cfg.weights.group_size, cfg.weights.symmetric) == ("int4", "int4", 64, False)
    assert parse_checkpoint_config(_w4_config(strategy="channel", group_size=None)).weights.strategy == "channel"
    with pytest.raises(QuantizationError, match="actorder 'group'"):
        parse_checkpoint_config(_w4_config(actorder="group"))
    with pytest.raises(QuantizationError, match="strategy 'tensor'"):
        parse_checkpoint_config(_w4_config(strategy="tensor"))
    bad_format = _w4_config()
    bad_format["format"] = "int-quantized"
    with pytest.raises(QuantizationError, match="format 'int-quantized' for 4-bit"):
        parse_checkpoint_config(bad_format)
    w4a8 = _w4_config()
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token"}
    with pytest.raises(QuantizationError, match="W4A8"):
        parse_checkpoint_config(w4a8)


def test_w4a16_with_g_idx_is_refused_by_name(tiny_checkpoints, tmp_path) -> None:
    q = quantize_checkpoint(tiny_checkpoints("llama"), tmp_path / "q", "ct-w4a16-group")
    tensors = load_file(str(q / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight_g_idx"] = torch.arange(128, dtype=torch.int32)
    save_file(tensors, str(q / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weight_g_idx"):
        _llm(q)
    assert json.loads((q / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == 4


def test_packings_read_as_their_producers_write() -> None:
    """Written out by hand from each producer's packing loop, not with our packer: AutoAWQ's
    GEMM puts column order_map[i] (0 2 4 6 1 3 5 7) in nibble i; AutoGPTQ puts row i of eight in
    nibble i; compressed-tensors puts column i in nibble i, as the signed value + 8."""
    from stoker.layers.int4_method import AWQ_NIBBLE_OF_COLUMN, unpack_int32_nibbles

    values = list(range(1, 9))  # column (or row) j holds j + 1
    awq = sum(values[o] << (4 * i) for i, o in enumerate((0, 2, 4, 6, 1, 3, 5, 7)))
    awq_t = torch.tensor([[awq - 2**32 if awq >= 2**31 else awq]], dtype=torch.int32)
    assert unpack_int32_nibbles(awq_t, 8, dim=1, where="t", order=AWQ_NIBBLE_OF_COLUMN).tolist() == [values]
    plain = sum(v << (4 * i) for i, v in enumerate(values))
    plain_t = torch.tensor([[plain - 2**32 if plain >= 2**31 else plain]], dtype=torch.int32)
    assert unpack_int32_nibbles(plain_t, 8, dim=0, where="t").flatten().tolist() == values  # GPTQ qweight: rows
    assert unpack_int32_nibbles(plain_t, 8, dim=1, where="t").tolist() == [values]  # compressed-tensors: columns
