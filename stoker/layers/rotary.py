"""Rotary position embedding with the scalings Hugging Face configs use.

`rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta` (older configs) give
the type: default, linear (positions divided by `factor`), llama3 (Llama 3.1: long
wavelengths divided by `factor`, short ones kept, a smooth ramp between), yarn (NTK-by-parts
interpolation with an attention temperature), longrope (Phi-3: per-dimension short / long
factors, layers/longrope.py, which says how the list is chosen). Inverse frequencies follow the formulas in
the Llama 3.1 paper / YaRN paper as transformers implements them, in float32, so the
cos/sin cache matches the reference bit for bit. `partial_rotary_factor` (in the rope
parameters, or at the config's top level, which transformers moves there) rotates only the
first head_dim x factor dims of each head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stoker.kernels import ops
from stoker.layers.longrope import longrope_inv_freq

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Normalise old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) config forms."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    if hf_config.get("partial_rotary_factor") is not None:  # the Hub's GLM-4.5 config says it at the top level
        params.setdefault("partial_rotary_factor", hf_config["partial_rotary_factor"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su" or (rope_type == "yarn" and "long_factor" in params):
        rope_type = "longrope"  # early Phi-3 configs' names for it (transformers' Phi3Config renames them too)
    params["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "longrope" and not (params.get("short_factor") and params.get("long_factor")):
        raise ValueError("longrope rope scaling needs both short_factor and long_factor lists in rope_scaling")
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    orig = p.get("original_max_position_embeddings") or max_pos
    if factor is None:
        factor = max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, hf_config: dict[str, Any]) -> None:
        super().__init__()
        p = rope_parameters(hf_config)
        base = float(p["rope_theta"])
        rot_dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
        attention_factor = 1.0
        if p["rope_type"] == "longrope":
            inv_freq, attention_factor = longrope_inv_freq(base, rot_dim, p, hf_config, max_position)
        elif p["rope_type"] == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(base, rot_dim, p, hf_config.get("max_position_embeddings", max_position))
        else:
            inv_freq = _base_inv_freq(base, rot_dim)
            if p["rope_type"] == "linear":
                inv_freq = inv_freq / p["factor"]
            elif p["rope_type"] == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, p)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # (max_position, rot_dim): [cos | sin], float32 whatever the model dtype.
        cache = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.kernels: ops.Kernels = ops.TORCH  # the builder binds the device's set (kernels/ops.py)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,), q (T, H, D), k (T, Hkv, D) -> rotated (q, k)."""
        return self.kernels.rotary_embedding(positions, q, k, self.cos_sin_cache)
