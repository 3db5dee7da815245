"""Gemma 3 text (`Gemma3ForCausalLM`, and the text tower of `Gemma3ForConditionalGeneration`
checkpoints): Gemma 2's layer (models/gemma2.py: four (1 + w) norms, GeGLU, scaled embeddings,
`query_pre_attn_scalar`) with

* an RMSNorm over each head of q and k (q_norm, k_norm, (1 + w) like the others), before rotary;
* 5 local : 1 global layers (`layer_types`, else `sliding_window_pattern`, 6 by default): the
  local ones attend through a `sliding_window`, the global ones to the whole context;
* two rotary tables: local layers rotate with `rope_local_base_freq` (10 000) and no scaling,
  global ones with `rope_theta` (1 000 000) and `rope_scaling` (Gemma 3 4B-27B: linear, factor 8);
  transformers 5 writes both as `rope_parameters: {sliding_attention: {...}, full_attention: {...}}`;
* no soft-capping by default; `final_logit_softcapping` is honoured when set (as transformers
  does). `attn_logit_softcapping` set is refused: transformers' Gemma 3 attention does not apply
  it, so there is no reference for what it would mean.

The multimodal checkpoints (`Gemma3ForConditionalGeneration`) serve their language model on
text prompts: config.json's `text_config` is the model's config (`text_model_config`), the
language model's tensors are read under their text-model names (transformers 4's
`language_model.model.*`, transformers 5's `model.language_model.*`), and the vision tower and
projector are not loaded. Image inputs are not served.
"""

from __future__ import annotations

from typing import Any

import torch

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.norm import GemmaRMSNorm
from stoker.layers.rotary import RotaryEmbedding
from stoker.models.gemma2 import Gemma2ForCausalLM, GemmaAttention
from stoker.models.llama import head_dim_of
from stoker.roofline.text_config import GEMMA3_TEXT_DEFAULTS as TEXT_CONFIG_DEFAULTS
from stoker.roofline.text_config import is_multimodal, text_model_config

SLIDING_WINDOW_PATTERN = 6  # transformers' default: every sixth layer global


def rope_configs(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) configs for RotaryEmbedding: each `cfg` with its own rope parameters."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # transformers 4's fields
        full = dict(cfg.get("rope_scaling") or {})
        full["rope_theta"] = cfg.get("rope_theta", TEXT_CONFIG_DEFAULTS["rope_theta"])
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", TEXT_CONFIG_DEFAULTS["rope_local_base_freq"])}
    full.setdefault("rope_theta", TEXT_CONFIG_DEFAULTS["rope_theta"])
    local.setdefault("rope_theta", TEXT_CONFIG_DEFAULTS["rope_local_base_freq"])
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return {**base, "rope_parameters": full}, {**base, "rope_parameters": local}


class Gemma3Attention(GemmaAttention):
    def __init__(self, cfg: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # (T, H, D), normalised over D


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        if cfg.get("attn_logit_softcapping"):
            raise ValueError("attn_logit_softcapping is set in this Gemma 3 config, but transformers' Gemma 3 "
                             "attention does not apply it, so its meaning here is undefined; set it to null")
        full, local = rope_configs(cfg)
        super().__init__(full, max_position, tp)
        self.config = cfg
        # Local (sliding) layers rotate with their own base; the global ones keep self.rotary.
        self.rotary_local = RotaryEmbedding(head_dim_of(cfg), max_position, local)
        for layer in self.model.layers:
            if layer.self_attn.attn.sliding_window is not None:
                layer.self_attn.rotary = self.rotary_local

    @classmethod
    def sliding_period(cls, cfg: dict[str, Any]) -> int:
        return int(cfg.get("sliding_window_pattern") or SLIDING_WINDOW_PATTERN)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint, on text prompts."""

    #: checkpoint prefixes of the language model -> this model's names
    _PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
    _VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    @staticmethod
    def model_config(cfg: dict[str, Any]) -> dict[str, Any]:
        return text_model_config(cfg) if is_multimodal(cfg) else cfg

    def skips_checkpoint_tensor(self, name: str) -> bool:
        return name.startswith(self._VISION)

    def checkpoint_name(self, name: str) -> str:
        for prefix, ours in self._PREFIXES:
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return name
