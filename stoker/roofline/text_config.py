"""The language model's config.json fields of a multimodal checkpoint (Gemma 3's
`Gemma3ForConditionalGeneration`): its `text_config`, with the defaults transformers fills in for
the fields it leaves out. The engine serves that language model on text prompts
(models/gemma3.py) and the roofline prices it (modelspec.get_model_spec). Pure data, no torch."""

from __future__ import annotations

from typing import Any

# transformers' Gemma3TextConfig defaults (configuration_gemma3.py): the Hub's multimodal Gemma 3
# configs list in text_config only the fields that differ from them (27B: no vocab_size).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
    final_logit_softcapping=None, attn_logit_softcapping=None, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    model_type="gemma3_text",
)

# config.json `model_type` of a multimodal checkpoint -> the defaults of its text model
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {"gemma3": GEMMA3_TEXT_DEFAULTS}


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json -> its language model's config: `text_config` over the text
    model's defaults, with the top level's `architectures`, `tie_word_embeddings` (the flag
    transformers ties by) and `quantization_config`."""
    text = {**TEXT_DEFAULTS.get(str(cfg.get("model_type")), {}), **(cfg.get("text_config") or {})}
    text["architectures"] = cfg.get("architectures")
    for key in ("tie_word_embeddings", "quantization_config"):
        if key in cfg:
            text[key] = cfg[key]
    return text


def is_multimodal(cfg: dict[str, Any]) -> bool:
    """A config whose language model's fields are under `text_config`, not at the top level."""
    return isinstance(cfg.get("text_config"), dict) and "hidden_size" not in cfg
