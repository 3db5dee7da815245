"""Architecture presets: the fields of each model's public HF `config.json`, and its published size.

`published_params` is the size the model card or paper states; tests hold our parameter count to
within 1% of it. Llama-2 presets exist because gpt-fast's published batch-1 runs use them.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
        published_params=1.24e9, source="huggingface.co/meta-llama/Llama-3.2-1B config.json; model card 1.24B",
    ),
    "llama-3-8b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256,
        published_params=8.03e9, source="huggingface.co/meta-llama/Meta-Llama-3-8B config.json; 8.03B",
    ),
    "llama-3-70b": dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=128256,
        published_params=70.6e9, source="huggingface.co/meta-llama/Meta-Llama-3-70B config.json; 70.6B",
    ),
    "llama-3.1-405b": dict(
        hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
        intermediate_size=53248, vocab_size=128256,
        published_params=405.9e9, source="huggingface.co/meta-llama/Llama-3.1-405B config.json; 405B (HF: 406B)",
    ),
    "mixtral-8x7b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
        published_params=46.7e9, published_active_params=12.9e9,
        source="huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json; Mistral blog: 46.7B total, 12.9B active",
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, attention_bias=True,
        published_params=7.61e9, source="huggingface.co/Qwen/Qwen2.5-7B config.json; model card 7.61B",
    ),
    "qwen3-32b": dict(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, intermediate_size=25600, vocab_size=151936, qk_norm=True,
        published_params=32.8e9, source="huggingface.co/Qwen/Qwen3-32B config.json; model card 32.8B",
    ),
    "llama-2-7b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=32000,
        published_params=6.74e9, source="huggingface.co/meta-llama/Llama-2-7b-hf config.json; 6.74B",
    ),
    "llama-2-13b": dict(
        hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
        intermediate_size=13824, vocab_size=32000,
        published_params=13.02e9, source="huggingface.co/meta-llama/Llama-2-13b-hf config.json; 13.0B",
    ),
    "llama-2-70b": dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=32000,
        published_params=68.98e9, source="huggingface.co/meta-llama/Llama-2-70b-hf config.json; 68.98B",
    ),
}

# Common spellings of HF repo ids -> preset (after lowercasing and dropping the org).
ALIASES: dict[str, str] = {
    "meta-llama-3-8b": "llama-3-8b", "llama-3.1-8b": "llama-3-8b", "meta-llama-3.1-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b", "llama-3.1-70b": "llama-3-70b", "meta-llama-3.1-70b": "llama-3-70b",
    "llama-3.3-70b": "llama-3-70b", "meta-llama-3.1-405b": "llama-3.1-405b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b", "llama-2-7b-hf": "llama-2-7b", "llama-2-70b-hf": "llama-2-70b", "llama-2-13b-hf": "llama-2-13b",
}
