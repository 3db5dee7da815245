"""LongRoPE (Phi-3 / Phi-3.5 / Phi-4-mini: `rope_scaling.type` "longrope", legacy "su"):
per-dimension rescale factors for the rotary frequencies, one list for short contexts and
one for long ones, and an attention factor on cos and sin.

    inv_freq[i] = 1 / (ext_factor[i] * theta^(2i / rot_dim)),   ext_factor = short_factor or long_factor
    attention_factor = sqrt(1 + ln(factor) / ln(original_max_position_embeddings))   (when factor > 1)
    factor = max_position_embeddings / original_max_position_embeddings              (unless given)

as transformers computes them (`_compute_longrope_parameters`; LongRoPE, arXiv:2402.13753).

Which list: transformers picks per forward pass (long when the forward's largest position + 1
exceeds original_max_position_embeddings) and, in Phi-3's `prepare_inputs_for_generation`,
throws the KV cache away and recomputes the whole sequence with the long factors when a
sequence first grows past it. A paged engine cannot re-rotate cached keys per sequence, and a
cache holding keys rotated under both lists breaks attention; so Stoker, as vLLM does since
its PR 27431, chooses once when the model is built: the long factors when the engine serves
positions past original_max_position_embeddings (max_model_len above it), the short ones
otherwise, for every position of every sequence. This equals transformers exactly when
max_model_len <= original_max_position_embeddings, and, with a longer max_model_len, for
every sequence whose prompt is already longer than original_max_position_embeddings; a
shorter sequence on such an engine is rotated with the long factors where transformers would
use the short ones (serve with --max-model-len original_max_position_embeddings to get them).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def longrope_inv_freq(base: float, rot_dim: int, p: dict[str, Any], hf_config: dict[str, Any],
                      max_position: int) -> tuple[torch.Tensor, float]:
    """(rot_dim / 2,) float32 inverse frequencies for an engine serving positions < max_position,
    and the attention factor that multiplies cos and sin."""
    original = p.get("original_max_position_embeddings") or hf_config.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings (in rope_scaling or at the "
                         "config's top level)")
    for key in ("short_factor", "long_factor"):
        if len(p.get(key) or ()) != rot_dim // 2:
            raise ValueError(f"longrope {key} must list rot_dim / 2 = {rot_dim // 2} factors, got "
                             f"{len(p.get(key) or ())}")
    factor = p.get("factor")
    if factor is None:
        factor = hf_config.get("max_position_embeddings", max_position) / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(p["long_factor"] if max_position > original else p["short_factor"], dtype=torch.float32)
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    return 1.0 / (ext * base**exponent), float(attention_factor)
