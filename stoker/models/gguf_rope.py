"""Llama 3.1-style rope scaling from a GGUF file's `rope_freqs.weight`, recovered and verified.

convert_hf_to_gguf.py does not write Llama 3's `rope_scaling` (factor, low_freq_factor,
high_freq_factor, original_max_position_embeddings) as metadata: it writes the per-dimension
factors f_i that divide each rotary frequency (head_dim / 2 float32 values), computed from them:
f = 1 where the wavelength 2 pi / freq is below original / high, `factor` where it is above
original / low, and 1 / ((1 - s) / factor + s) between, s = (original / wavelength - low) /
(high - low). Taking those parameters back: `factor` is the largest f; s of the in-between
dimensions is linear in original / wavelength, so two or more of them give low and high (for a
given original length: the metadata's, else 8192, the converter's own default); with fewer, Llama
3's low 1 and high 4. The result is accepted only if recomputing the factors from it gives the
file's to float32 precision; anything else is refused, naming the tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

DEFAULT_ORIGINAL = 8192  # convert_hf_to_gguf.py's default original_max_position_embeddings


def rope_factors(base: float, head_dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The f_i convert_hf_to_gguf.py writes for these llama3 parameters, (head_dim / 2,) float32."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            s = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.asarray(out, dtype=np.float32)


def llama3_rope_scaling(freq_factors: np.ndarray, base: float, head_dim: int, original: int | None) -> dict[str, Any]:
    """HF's `rope_scaling` for a file's rope_freqs, or ValueError naming it when no llama3
    parameters reproduce it."""
    f = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
    if f.shape[0] != head_dim // 2:
        raise ValueError(f"GGUF tensor rope_freqs.weight holds {f.shape[0]} factors; head_dim {head_dim} needs {head_dim // 2}")
    original = int(original or DEFAULT_ORIGINAL)
    factor = float(f.max())
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32).astype(np.float64) / head_dim))
    u = original * freqs / (2 * math.pi)  # original / wavelength
    tol = 1e-6 * factor
    middle = (f > 1 + tol) & (f < factor - tol)
    low, high = 1.0, 4.0
    if factor > 1 and middle.sum() >= 2:
        s = (1 / f[middle] - 1 / factor) / (1 - 1 / factor)  # = (u - low) / (high - low)
        slope, intercept = np.polyfit(u[middle], s, 1)
        span = 1 / slope
        low = float(round(-intercept * span, 6))
        high = float(round(low + span, 6))
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
              "original_max_position_embeddings": original}
    if factor <= 1 or not np.allclose(rope_factors(base, head_dim, factor, low, high, original), f, rtol=1e-5, atol=0):
        raise ValueError(
            "GGUF tensor rope_freqs.weight matches no Llama 3 rope scaling (factor, low_freq_factor, "
            f"high_freq_factor with original_max_position_embeddings {original}); serve the Hugging Face checkpoint, "
            "whose config.json carries rope_scaling"
        )
    return params
