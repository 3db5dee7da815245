"""gpt-oss's MXFP4 checkpoints (layers/moe_mxfp4.py): a tiny checkpoint written here in the Hub's
on-disk layout (experts quantized to MXFP4 by the test: `*_blocks` (E, N, K / 32, 16) uint8 and
`*_scales` (E, N, K / 32) uint8, gate and up rows interleaved, biases float;
quantization_config quant_method mxfp4) against HF transformers on the same weights
dequantized by transformers' own MXFP4 reader (integrations/mxfp4.convert_moe_packed_tensors):
prefill logits to 1e-4, greedy tokens over 32 steps; a planted fault (one scale one exponent
off) fails that comparison. The experts stay 4-bit in memory (4.25 bits a weight), the bytes
the roofline prices; other quant_methods, unknown fields, missing scales and tensor
parallelism are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stoker import LLM, SamplingParams
from stoker.kernels.cpu import build
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_mxfp4 import Mxfp4MoEMethod
from stoker.quantization.formats import quantize_mxfp4
from tests.model.helpers import engine_logits, hf_greedy, hf_logits, load_hf

# H = 64 and I = 32: whole 32-value blocks; k = 2 of 4 experts, a limit the clamps reach
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=24,
               num_hidden_layers=3, swiglu_limit=2.0)
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
PROMPT = [0] + [(i * 37) % 900 + 5 for i in range(63)]


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _mxfp4(float_dir: Path) -> dict[str, torch.Tensor]:
    """The float checkpoint's tensors with each layer's expert weights as MXFP4 blocks and scales,
    stored (E, out, in) as the Hub's files are: gate_up (E, H, 2I) -> (E, 2I, H / 32, 16)."""
    out = {}
    for name, t in load_file(str(float_dir / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2).contiguous())
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = t
    return out


def _dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers makes of MXFP4 experts (its reader, float32): the float layout (E, in, out)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = {}
    for name, t in tensors.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = convert_moe_packed_tensors(t, tensors[base + "_scales"], dtype=torch.float32).contiguous()
        elif not name.endswith("_scales"):
            out[name] = t
    return out


def write_mxfp4_checkpoint(float_dir: Path, dst: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A float gpt-oss checkpoint's MXFP4 twin at `dst` (config included); returns it and its tensors."""
    tensors = _mxfp4(float_dir)
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    return _write(float_dir, dst, tensors, qc), tensors


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(the MXFP4 checkpoint, HF's float checkpoint of its dequantized weights, the MXFP4 tensors)."""
    src = tiny_checkpoints("gpt_oss", **GPT_OSS)
    root = tmp_path_factory.mktemp("mxfp4")
    path, tensors = write_mxfp4_checkpoint(src, root / "mxfp4")
    return path, _write(src, root / "dequantized", _dequantized(tensors), None), tensors


def _llm(path: Path, **kw) -> LLM:
    return LLM(str(path), max_model_len=256, kv_cache_memory_bytes=4 << 20, device="cpu", **kw)


def test_logits_and_greedy_tokens_equal_hf_on_the_dequantized_weights(checkpoints) -> None:
    mxfp4, dequantized, _ = checkpoints
    llm = _llm(mxfp4)
    moes = [m for m in llm.engine.executor.driver_runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == GPT_OSS["num_hidden_layers"] and all(isinstance(m.method, Mxfp4MoEMethod) for m in moes)
    assert all(m.w13_blocks.dtype == torch.uint8 and not hasattr(m, "w13") for m in moes)  # held 4-bit
    assert all(m.method.backend == ("cpu" if build.available() else "dequant") for m in moes)
    hf = load_hf(dequantized)
    for ids in (PROMPT, PROMPT[:9]):
        torch.testing.assert_close(engine_logits(llm, ids), hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for ids in (PROMPT[:20], [0, 99, 5, 17]):
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out == hf_greedy(hf, ids, 32)
    llm.engine.check_integrity()


def test_the_torch_backend_equals_hf_too(checkpoints, monkeypatch) -> None:
    """Without the C kernels (CUDA's path too): each routed expert dequantized in torch."""
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")
    mxfp4, dequantized, _ = checkpoints
    llm = _llm(mxfp4)
    assert all(m.method.backend == "dequant" for m in llm.engine.executor.driver_runner.model.modules()
               if isinstance(m, FusedMoE))
    torch.testing.assert_close(engine_logits(llm, PROMPT), hf_logits(load_hf(dequantized), PROMPT), rtol=1e-4, atol=1e-4)


def test_one_scale_one_exponent_off_fails_the_comparison(checkpoints, tmp_path) -> None:
    mxfp4, dequantized, tensors = checkpoints
    planted = dict(tensors)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    planted[name] = tensors[name].clone()
    planted[name][0, 0, 0] += 1  # expert 0, output row 0, the first block of 32: doubled
    faulty = _write(mxfp4, tmp_path / "faulty", planted, None)
    ours = engine_logits(_llm(faulty), PROMPT)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ours, hf_logits(load_hf(dequantized), PROMPT), rtol=1e-4, atol=1e-4)


def test_the_experts_are_held_in_4_25_bits_as_the_roofline_counts(checkpoints, monkeypatch) -> None:
    """Blocks and scales: 0.5 + 1/32 bytes a weight; the engine's held bytes equal the spec's
    count with the experts in mxfp4 and the rest in float32 (the biases are float32 too)."""
    from stoker.roofline.modelspec import spec_from_config

    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")  # no panel padding in the attention projections
    mxfp4, _, _ = checkpoints
    runner = _llm(mxfp4).engine.executor.driver_runner
    moe = next(m for m in runner.model.modules() if isinstance(m, FusedMoE))
    e, h, i = 4, 64, 32
    assert moe.w13_blocks.numel() + moe.w13_scales.numel() + moe.w2_blocks.numel() + moe.w2_scales.numel() == \
        3 * e * h * i * (0.5 + 1 / 32)
    spec = spec_from_config(runner.hf_config)
    assert spec.expert_dtype == "mxfp4"
    assert runner.weight_bytes_held() == spec.weight_bytes("fp32", rest_dtype="fp32")
    assert "mxfp4 experts" in runner.weights_summary()


def test_what_it_cannot_honour_is_refused_by_name(checkpoints, tmp_path) -> None:
    mxfp4, _, tensors = checkpoints
    from stoker.quantization.config import QuantizationError

    def with_config(name: str, qc: dict) -> Path:
        path = shutil.copytree(mxfp4, tmp_path / name)
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
        return path

    with pytest.raises(QuantizationError, match="quant_method 'bitsandbytes' is not supported"):
        _llm(with_config("bnb", {"quant_method": "bitsandbytes"}))
    with pytest.raises(QuantizationError, match=r"mxfp4 quantization_config fields \['group_size'\]"):
        _llm(with_config("field", {"quant_method": "mxfp4", "group_size": 64}))
    no_scales = {n: t for n, t in tensors.items() if n != "model.layers.1.mlp.experts.down_proj_scales"}
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        _llm(_write(mxfp4, tmp_path / "no-scales", no_scales, None))
    as_float = with_config("float-under-mxfp4", {"quant_method": "mxfp4"})
    save_file(_dequantized(tensors), str(as_float / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds its experts as \*_blocks and \*_scales, not 'weight'"):
        _llm(as_float)
    with pytest.raises(QuantizationError, match="--quantization int8 disagrees with the checkpoint"):
        _llm(mxfp4, quantization="int8")
