"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("stoker.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("stoker.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    # Gemma 2 and 3 (text; a multimodal Gemma 3 checkpoint serves its language model)
    "Gemma2ForCausalLM": ("stoker.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("stoker.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("stoker.models.gemma3", "Gemma3ForConditionalGeneration"),
    "Glm4MoeForCausalLM": ("stoker.models.glm4_moe", "Glm4MoeForCausalLM"),
    "GptOssForCausalLM": ("stoker.models.gpt_oss", "GptOssForCausalLM"),
    "LlamaForCausalLM": ("stoker.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("stoker.models.mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("stoker.models.mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("stoker.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("stoker.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("stoker.models.qwen3", "Qwen3ForCausalLM"),
    "OlmoeForCausalLM": ("stoker.models.olmoe", "OlmoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("stoker.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    # dense families with a layer feature of their own (issue 38)
    "Phi3ForCausalLM": ("stoker.models.phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("stoker.models.olmo2", "Olmo2ForCausalLM"),
    "GraniteForCausalLM": ("stoker.models.granite", "GraniteForCausalLM"),
    "SmolLM3ForCausalLM": ("stoker.models.smollm3", "SmolLM3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, cls_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), cls_name)
    raise ValueError(
        f"architecture {architectures!r} is not supported; supported: {', '.join(supported_architectures())}"
    )
