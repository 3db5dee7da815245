"""Build small random-weight Hugging Face checkpoints with `transformers`, deterministically.

The checkpoint is a real one (config.json, model.safetensors, tokenizer files,
generation_config.json), written by transformers itself, so loading it exercises the same
code path as a downloaded model, and transformers doubles as the reference implementation.
The tokenizer is Stoker's bundled 1024-token byte-level BPE with a Llama-3-style chat template.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

DEMO_TOKENIZER_VOCAB = 1024

_ARCH = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    # dense families with a layer feature of their own (issue 38)
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
# Gemma 2 and 3 (text)
_ARCH.update({
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
})

# Per family, the 1-D tensors transformers initialises to zero that the tests should see
# nonzero: biases, GLM-4.5's router correction bias (which steers the expert choice).
_RANDOM_VECTORS: dict[str, tuple[str, ...]] = {
    "glm4_moe": ("proj.bias", "e_score_correction_bias"),
    "gpt_oss": ("proj.bias", "router.bias", "sinks"),
    "deepseek_v3": ("e_score_correction_bias",),
}

# MLA (DeepSeek) expands the latent to every head: transformers' repeat_kv must be a no-op.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(num_key_value_heads=4),
    "deepseek_v3": dict(num_key_value_heads=4),
}
# Gemma's norms scale by (1 + w) with w initialised to 0: drawn around 0 so that they count
_RANDOM_VECTORS.update({
    "gemma2": ("norm.weight", "layernorm.weight"),
    "gemma3_text": ("norm.weight", "layernorm.weight"),
})
# Per family, TINY's fields it needs otherwise: Gemma's configs default to head_dim 256
_TINY_FOR: dict[str, dict[str, Any]] = {"gemma2": {"head_dim": 16}, "gemma3_text": {"head_dim": 16}}

# Per family, config defaults the tiny vocabulary needs (pad_token_id 32000 in Phi3Config, 128004 in SmolLM3Config).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "phi3": dict(pad_token_id=2),
    "smollm3": dict(pad_token_id=2),
}

# Small enough for CPU tests, shaped like the real thing (GQA 2:1, head_dim 16).
TINY: dict[str, Any] = dict(
    vocab_size=DEMO_TOKENIZER_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def demo_tokenizer_dir() -> Path:
    return Path(str(resources.files("stoker") / "assets" / "demo_tokenizer"))


def copy_demo_tokenizer(dest: Path) -> None:
    for f in demo_tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random checkpoint of family `arch` to `path` and return the path.

    `overrides` replace config fields (e.g. hidden_size=512, rope_scaling={...}).
    `max_shard_size` ("200KB") writes a sharded checkpoint with an index file.
    """
    import torch
    import transformers

    if arch not in _ARCH:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(_ARCH)}")
    config_cls, model_cls = (getattr(transformers, n) for n in _ARCH[arch])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {**TINY, **_TINY_FOR.get(arch, {}), **_FAMILY_DEFAULTS.get(arch, {}), **_ARCH_DEFAULTS.get(arch, {}), **overrides}
    kwargs.setdefault("bos_token_id", 0)
    kwargs.setdefault("eos_token_id", 4)  # <|eot_id|> in the demo tokenizer
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype)).eval()
    # HF inits with std 0.02: logits are then nearly flat and greedy ties are common;
    # a wider spread makes greedy agreement tests meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
        if arch in _RANDOM_VECTORS:  # zero-initialised vectors that change the output: make them count
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(_RANDOM_VECTORS[arch]):
                    t.normal_(0, 0.1)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    copy_demo_tokenizer(path)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": kwargs["bos_token_id"], "eos_token_id": kwargs["eos_token_id"]}, indent=2)
    )
    return path
