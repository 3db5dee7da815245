"""Write pre-quantized checkpoints the way the tools do, from a float one (for the tests).

`quantize_checkpoint(src, dst, fmt)` quantizes every decoder-layer projection weight of the
float checkpoint `src` (`model.layers.*.*_proj.weight`, and Mixtral's experts' `w1`/`w2`/`w3`) and writes to `dst` the tensors and the
`quantization_config` that these formats hold:

  ct-fp8-tensor          compressed-tensors float-quantized, weight_scale (1,) per tensor
  ct-fp8-channel         ... per channel, weight_scale (N, 1); dynamic per-token activations
  ct-fp8-channel-static  ... per channel, plus a static input_scale (1,) per projection
  ct-int8-channel        compressed-tensors int-quantized, weight_scale (N, 1) in bfloat16
  ct-int8-pack-group     compressed-tensors pack-quantized 8-bit, groups of 32: weight_packed
                         (N, K / 4) int32, weight_shape, weight_scale (N, K / 32)
  fp8-block              "quant_method": "fp8", weight_block_size [128, 128], weight_scale_inv
                         (ceil(N / 128), ceil(K / 128)) (Qwen3-FP8, DeepSeek)
  fp8-tensor             "quant_method": "fp8", static activations: weight_scale () and input_scale ()
  ct-w4a16-group         compressed-tensors pack-quantized 4-bit (llm-compressor's W4A16), symmetric,
                         groups of 32: weight_packed (N, K / 8) int32 (value i of each int32 in bits
                         4i.., stored as q + 8), weight_shape, weight_scale (N, K / 32)
  ct-w4a16-asym-group    ... asymmetric: weight_zero_point (ceil(N / 8), K / 32) int32, zero points
                         (signed, + 8) packed eight rows to an int32
  gptq-sym / gptq-asym   "quant_method": "gptq" 4-bit, groups of 32 (AutoGPTQ): qweight (K / 8, N)
                         int32, eight rows of K per value; qzeros (K / 32, N / 8) int32 holding
                         zero - 1; scales (K / 32, N) float16; g_idx (K,) in group order
  awq                    "quant_method": "awq" GEMM, groups of 32 (AutoAWQ): qweight (K, N / 8), eight
                         columns per value in the order 0 2 4 6 1 3 5 7; qzeros (K / 32, N / 8) the
                         same way; scales (K / 32, N) float16

It also writes `dequantized_dst` (when given): the same model with each weight replaced by the
float weight its quantized form stands for, which HF transformers loads as the reference.
`kv_scales`: per-layer (k_scale, v_scale) written as `model.layers.{i}.self_attn.k_scale`, with a
compressed-tensors kv_cache_scheme (ct-* formats).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from stoker.quantization import formats

FORMATS = ("ct-fp8-tensor", "ct-fp8-channel", "ct-fp8-channel-static", "ct-int8-channel", "ct-int8-pack-group", "fp8-block",
           "fp8-tensor", "ct-w4a16-group", "ct-w4a16-asym-group", "gptq-sym", "gptq-asym", "awq")
# decoder projections, Mixture-of-Experts experts included (Mixtral's are experts.{e}.w1/w2/w3)
_PROJECTION = re.compile(r"model\.layers\.\d+\.(.*_proj|.*_proj_with_mqa|.*experts\.\d+\.w[123])\.weight$")


def _ct_config(wtype: str, strategy: str, fmt: str, group_size: int | None, acts: dict | None, kv: bool, ignore: list[str],
               num_bits: int = 8, symmetric: bool = True) -> dict[str, Any]:
    weights = {"num_bits": num_bits, "type": wtype, "strategy": strategy, "symmetric": symmetric, "dynamic": False,
               "group_size": group_size, "observer": "minmax", "actorder": None, "block_structure": None}
    config = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "ignore": ignore, "kv_cache_scheme": None,
    }
    if kv:
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    return config


def _quantize(w: torch.Tensor, fmt: str, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One (N, K) float weight -> (checkpoint tensors by suffix, the dequantized float weight)."""
    n, k = w.shape
    if fmt in ("ct-fp8-tensor", "fp8-tensor"):
        scale = (w.abs().max() / formats.FP8_MAX).reshape(1, 1)
        q = formats.quantize_with(w, scale, "fp8")
        shape = (1,) if fmt == "ct-fp8-tensor" else ()
        tensors = {"weight": q, "weight_scale": scale.reshape(shape).float()}
        if fmt == "fp8-tensor":
            tensors["input_scale"] = (torch.rand((), generator=gen) * 0.02 + 0.01).float()
        return tensors, formats.dequantize(q, scale.expand(n, 1), k)
    if fmt.startswith("ct-fp8-channel"):
        q, scale = formats.quantize_rows(w, "fp8")
        tensors = {"weight": q, "weight_scale": scale}
        if fmt.endswith("static"):
            tensors["input_scale"] = (torch.rand(1, generator=gen) * 0.02 + 0.01).float()
        return tensors, formats.dequantize(q, scale, k)
    if fmt == "ct-int8-channel":
        q, scale = formats.quantize_rows(w, "int8")
        scale16 = scale.to(torch.bfloat16)  # llm-compressor keeps scales in the model dtype
        q = formats.quantize_with(w, scale16.float(), "int8")
        return {"weight": q, "weight_scale": scale16}, formats.dequantize(q, scale16.float(), k)
    if fmt == "ct-int8-pack-group":
        group = 32
        groups = w.float().reshape(n, -1, group)
        scale = groups.abs().amax(dim=2).clamp(min=1e-8) / formats.INT8_MAX  # (N, K / 32)
        q = formats.quantize_with(w, formats.expand_groups(scale, group, k), "int8")
        tensors = {"weight_packed": formats.pack_int32(q), "weight_shape": torch.tensor([n, k], dtype=torch.int32),
                   "weight_scale": scale}
        return tensors, formats.dequantize(q, scale, group)
    if fmt.startswith("ct-w4a16"):
        return _quantize_w4a16(w, 32, symmetric="asym" not in fmt)
    if fmt.startswith("gptq") or fmt == "awq":
        return _quantize_gptq_awq(w, 32, fmt)
    if fmt == "fp8-block":
        b = 128
        nb, kb = -(-n // b), -(-k // b)
        padded = torch.zeros(nb * b, kb * b)
        padded[:n, :k] = w.float()
        amax = padded.reshape(nb, b, kb, b).abs().amax(dim=(1, 3)).clamp(min=1e-8)  # (nb, kb)
        scale_inv = amax / formats.FP8_MAX
        per_element = scale_inv.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
        q = formats.quantize_with(w, per_element, "fp8")
        return {"weight": q, "weight_scale_inv": scale_inv}, q.float() * per_element
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


def _quantize_w4a16(w: torch.Tensor, group: int, symmetric: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """As llm-compressor's W4A16 (compressed-tensors' quantize, then pack_to_int32): signed codes
    in [-8, 7], w ~ (q - zp) * scale per group; symmetric: scale = max |w| / 7.5 (half the
    range), zp = 0; asymmetric: scale = (max - min) / 15, zp = round(-min / scale) - 8."""
    from stoker.layers.int4_method import pack_int32_nibbles

    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    if symmetric:
        scale = groups.abs().amax(dim=2).clamp(min=1e-8) / 7.5
        zp = torch.zeros_like(scale)
    else:
        lo, hi = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zp = (torch.round(-lo / scale) - 8).clamp(-8, 7)
    q = (torch.round(groups / scale.unsqueeze(2)) + zp.unsqueeze(2)).clamp(-8, 7).reshape(n, k)
    dequantized = ((q.reshape(n, -1, group) - zp.unsqueeze(2)) * scale.unsqueeze(2)).reshape(n, k)
    tensors = {"weight_packed": pack_int32_nibbles((q + 8).to(torch.uint8), dim=1),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64), "weight_scale": scale.to(w.dtype)}
    if not symmetric:
        tensors["weight_zero_point"] = pack_int32_nibbles((zp + 8).to(torch.uint8), dim=0)
    return tensors, dequantized


def _quantize_gptq_awq(w: torch.Tensor, group: int, fmt: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Round-to-nearest into AutoGPTQ's / AutoAWQ's tensors: unsigned codes q in [0, 15], zero z
    and float16 scale s per group, w ~ (q - z) * s (symmetric GPTQ: z = 8)."""
    from stoker.layers.int4_method import AWQ_NIBBLE_OF_COLUMN, pack_int32_nibbles

    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    if fmt == "gptq-sym":
        scale = (groups.abs().amax(dim=2).clamp(min=1e-8) / 7.5).half().float()
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        # AutoGPTQ's format stores zero - 1 in 4 bits: a zero of 0 cannot be written (it wraps)
        zero = torch.round(-lo / scale).clamp(1 if fmt.startswith("gptq") else 0, 15)
    q = (torch.round(groups / scale.unsqueeze(2)) + zero.unsqueeze(2)).clamp(0, 15)
    dequantized = ((q - zero.unsqueeze(2)) * scale.unsqueeze(2)).reshape(n, k)
    codes = q.reshape(n, k).to(torch.uint8)
    scales = scale.t().contiguous().half()  # (G, N)
    if fmt == "awq":
        return {"qweight": pack_int32_nibbles(codes.t(), 1, AWQ_NIBBLE_OF_COLUMN),
                "qzeros": pack_int32_nibbles(zero.t().to(torch.uint8), 1, AWQ_NIBBLE_OF_COLUMN), "scales": scales}, dequantized
    return {"qweight": pack_int32_nibbles(codes.t(), 0), "qzeros": pack_int32_nibbles((zero.t() - 1).to(torch.uint8), 1),
            "scales": scales, "g_idx": (torch.arange(k) // group).to(torch.int32)}, dequantized


def quantize_checkpoint(
    src: str | Path, dst: str | Path, fmt: str, *, dequantized_dst: str | Path | None = None,
    ignore: tuple[str, ...] = ("lm_head",), kv_scales: list[tuple[float, float]] | None = None, seed: int = 0,
) -> Path:
    src, dst = Path(src), Path(dst)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if _PROJECTION.match(name) and not _ignored(module, ignore):
            parts, deq = _quantize(t, fmt, gen)
            for suffix, value in parts.items():
                quantized[f"{module}.{suffix}"] = value.contiguous()
            dequantized[name] = deq.to(t.dtype)
        else:
            quantized[name] = t
            dequantized[name] = t
    config = json.loads((src / "config.json").read_text())
    if fmt.startswith("gptq"):
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": fmt == "gptq-sym",
                                         "desc_act": False, "damp_percent": 0.01, "true_sequential": True}
    elif fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": None}
    elif fmt.startswith("ct-w4a16"):
        config["quantization_config"] = _ct_config("int", "group", "pack-quantized", 32, None, False, list(ignore),
                                                   num_bits=4, symmetric="asym" not in fmt)
    elif fmt.startswith("ct-"):
        wtype = "int" if "int8" in fmt else "float"
        strategy = "group" if "group" in fmt else "tensor" if fmt == "ct-fp8-tensor" else "channel"
        fmt_name = "pack-quantized" if "pack" in fmt else "int-quantized" if wtype == "int" else "float-quantized"
        acts = None
        if wtype == "float":
            acts = {"num_bits": 8, "type": "float", "strategy": "tensor" if fmt.endswith("static") else "token",
                    "dynamic": not fmt.endswith("static"), "symmetric": True}
        config["quantization_config"] = _ct_config(wtype, strategy, fmt_name, 32 if strategy == "group" else None, acts,
                                                   kv_scales is not None, list(ignore))
    elif fmt == "fp8-block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"}
    for i, (k_scale, v_scale) in enumerate(kv_scales or []):
        quantized[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale, dtype=torch.float32)
        quantized[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale, dtype=torch.float32)
    _write(src, dst, quantized, config)
    if dequantized_dst is not None:
        plain = json.loads((src / "config.json").read_text())
        _write(src, Path(dequantized_dst), dequantized, plain)
    return dst


def _ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' matching: "re:<regex>" with re.match, else the module name."""
    return any(re.match(i[3:], module) if i.startswith("re:") else module == i or module.endswith("." + i) for i in ignore)


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
