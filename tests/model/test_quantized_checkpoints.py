"""Pre-quantized checkpoints, written by the test as llm-compressor and the FP8 exporters write
them (stoker/testing/quantized_checkpoint.py), load and compute what HF transformers computes
with the same weights dequantized: on CPU every path is weight-only, the dequantized weights
are exactly the float weights HF loads, so prefill logits agree to float32 tolerance and
greedy decoding agrees token for token over 32 steps. Llama, Qwen2 (biases) and Qwen3 (q/k norm).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from stoker import LLM, SamplingParams
from stoker.layers.linear import Linear
from stoker.layers.quantized_method import QuantizedLinearMethod
from stoker.testing.quantized_checkpoint import quantize_checkpoint
from tests.model.helpers import engine_logits, hf_greedy, hf_logits, load_hf

ARCHS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", dict(head_dim=32))}
# Block scales need projections wider than one 128 x 128 block, partial blocks included.
WIDE = dict(hidden_size=192, intermediate_size=320, num_attention_heads=6, num_key_value_heads=2)
PROMPTS = [[0] + list(range(7, 70)), [0, 99, 5, 17, 256, 800, 3]]


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    """(arch, format) -> (quantized checkpoint, dequantized float checkpoint), built once."""
    cache = {}

    def get(arch: str, fmt: str):
        if (arch, fmt) not in cache:
            family, overrides = ARCHS[arch]
            src = tiny_checkpoints(family, **{**overrides, **(WIDE if fmt == "fp8-block" else {})})
            root = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            q = quantize_checkpoint(src, root / "q", fmt, dequantized_dst=root / "deq")
            cache[arch, fmt] = (q, root / "deq")
        return cache[arch, fmt]

    return get


CASES = [
    ("llama", "ct-fp8-channel"),
    ("llama", "ct-fp8-tensor"),
    ("llama", "ct-fp8-channel-static"),
    ("llama", "ct-int8-channel"),
    ("llama", "ct-int8-pack-group"),
    ("llama", "fp8-block"),
    ("llama", "fp8-tensor"),
    ("qwen2", "ct-fp8-channel"),
    ("qwen2", "ct-int8-pack-group"),
    ("qwen2", "fp8-block"),
    ("qwen3", "ct-fp8-tensor"),
    ("qwen3", "ct-int8-channel"),
    ("qwen3", "fp8-block"),
]


@pytest.mark.parametrize("arch, fmt", CASES)
def test_quantized_checkpoint_matches_hf_on_dequantized_weights(arch: str, fmt: str, quantized) -> None:
    qpath, deq = quantized(arch, fmt)
    llm = LLM(str(qpath), max_model_len=256, kv_cache_memory_bytes=8 << 20, device="cpu")
    layers = [m for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, Linear) and isinstance(m.method, QuantizedLinearMethod)]
    assert len(layers) == 4 * llm.engine.hf_config["num_hidden_layers"], "every decoder projection is quantized"
    expected_kind = "int8" if "int8" in fmt else "fp8"
    assert all(m.method.kind == expected_kind for m in layers)
    hf = load_hf(deq)
    for ids in PROMPTS:
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=2e-4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)


def test_ignored_modules_stay_float(tiny_checkpoints, tmp_path) -> None:
    src = tiny_checkpoints("llama")
    q = quantize_checkpoint(src, tmp_path / "q", "ct-fp8-channel", dequantized_dst=tmp_path / "deq",
                            ignore=("lm_head", "re:.*mlp.down_proj"))
    llm = LLM(str(q), kv_cache_memory_bytes=4 << 20, device="cpu")
    model = llm.engine.executor.driver_runner.model
    for name, m in model.named_modules():
        if isinstance(m, Linear) and "layers" in name:
            assert isinstance(m.method, QuantizedLinearMethod) == (not name.endswith("down_proj")), name
    hf = load_hf(tmp_path / "deq")
    torch.testing.assert_close(engine_logits(llm, PROMPTS[0]), hf_logits(hf, PROMPTS[0]), rtol=1e-4, atol=2e-4)


def test_kv_cache_scales_are_read_from_the_checkpoint(tiny_checkpoints, tmp_path) -> None:
    src = tiny_checkpoints("llama")
    scales = [(0.02, 0.03), (0.05, 0.01)]
    q = quantize_checkpoint(src, tmp_path / "q", "ct-fp8-channel", kv_scales=scales)
    assert json.loads((q / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    llm = LLM(str(q), kv_cache_memory_bytes=4 << 20, device="cpu", kv_cache_dtype="fp8")
    attn = llm.engine.executor.driver_runner.model.attention_layers()
    assert [s for a in attn for s in (a.k_scale, a.v_scale)] == pytest.approx([s for pair in scales for s in pair])
    assert llm.engine.executor.driver_runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    # the same checkpoint with a float cache: the scales mean nothing there
    llm = LLM(str(q), kv_cache_memory_bytes=4 << 20, device="cpu")
    assert all((a.k_scale, a.v_scale) == (1.0, 1.0) for a in llm.engine.executor.driver_runner.model.attention_layers())


# ------------------------------------------------------------------------------ bad input
def _edit(path, tmp_path, change) -> str:
    dst = tmp_path / "edited"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_unknown_quant_method_is_refused_with_what_is_supported(tiny_llama, tmp_path) -> None:
    path = _edit(tiny_llama, tmp_path, lambda c: c.update(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported; supported: compressed-tensors .*fp8.*gptq.*awq"):
        LLM(path, device="cpu")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda g: g["weights"].update(num_bits=2), "2 bits are not supported"),
        # 4-bit int weights are read only as pack-quantized (W4A16, tests/model/test_int4.py)
        (lambda g: g["weights"].update(num_bits=4), "format 'int-quantized' for 4-bit int weights is not supported"),
        (lambda g: g["weights"].update(symmetric=False), "asymmetric"),
        (lambda g: g["weights"].update(strategy="token"), "strategy 'token'"),
        (lambda g: g.update(output_activations={"num_bits": 8}), "output_activations"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_named(quantized, tmp_path, edit, message) -> None:
    qpath, _ = quantized("llama", "ct-int8-channel")
    path = _edit(qpath, tmp_path, lambda c: edit(c["quantization_config"]["config_groups"]["group_0"]))
    with pytest.raises(ValueError, match=message):
        LLM(path, device="cpu")


def test_missing_scale_names_the_tensor(quantized, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    qpath, _ = quantized("llama", "ct-fp8-channel")
    dst = tmp_path / "noscale"
    shutil.copytree(qpath, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.self_attn\.k_proj\.weight_scale"):
        LLM(str(dst), device="cpu")


def test_quantization_flag_must_agree_with_the_checkpoint(quantized) -> None:
    qpath, _ = quantized("llama", "ct-int8-channel")
    with pytest.raises(ValueError, match="disagrees with the checkpoint, which is already quantized as int8"):
        LLM(str(qpath), device="cpu", quantization="fp8")
    LLM(str(qpath), device="cpu", quantization="int8", kv_cache_memory_bytes=4 << 20)  # agreeing is fine


def test_online_quantization_of_a_quantized_tensor_is_refused(tiny_llama, tmp_path) -> None:
    """--quantization quantizes float weights; a checkpoint whose weights are already 8-bit but
    whose config says nothing is named, not silently re-quantized."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(tiny_llama, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="quantizes a float checkpoint.*down_proj"):
        LLM(str(dst), device="cpu", quantization="fp8")


def test_partly_ignored_merged_projection_is_refused(tiny_checkpoints, tmp_path) -> None:
    q = quantize_checkpoint(tiny_checkpoints("llama"), tmp_path / "q", "ct-fp8-channel", ignore=("lm_head", "re:.*q_proj"))
    with pytest.raises(ValueError, match="must agree"):
        LLM(str(q), device="cpu")


def test_an_8bit_weight_where_the_config_expects_floats_is_refused(quantized, tmp_path) -> None:
    """A quantized tensor for a projection the config leaves unquantized would be read without
    its scale: refused, naming the tensor."""
    qpath, _ = quantized("llama", "ct-fp8-channel")
    path = _edit(qpath, tmp_path, lambda c: c["quantization_config"].update(ignore=["lm_head", "re:.*o_proj"]))
    with pytest.raises(ValueError, match=r"runs unquantized.*model\.layers\.\d\.self_attn\.o_proj"):
        LLM(path, device="cpu")


def test_activation_quantization_run_weight_only_is_said(quantized, caplog) -> None:
    import logging

    qpath, _ = quantized("llama", "ct-fp8-channel-static")
    with caplog.at_level(logging.INFO, logger="stoker.models.method_chooser"):
        LLM(str(qpath), device="cpu", kv_cache_memory_bytes=4 << 20)
    assert "quantizes activations too" in caplog.text and "weight-only" in caplog.text
