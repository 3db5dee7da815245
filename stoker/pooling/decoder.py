"""Decoder-based embedding models (Qwen3-Embedding style): a Llama/Qwen/Mistral decoder run
once over each whole sequence, causal, no KV cache, no LM head; the runner pools the last
token.

The decoder layers are the generative models' own (models/llama.py and the family files);
only their attention is swapped for the cache-free `VarlenAttention`, a transform applied
from outside (DESIGN.md rule 8), so the model files stay as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.rotary import RotaryEmbedding
from stoker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, head_dim_of
from stoker.models.registry import get_model_class
from stoker.pooling.attention import VarlenAttention

_CAUSAL_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM"}


class DecoderEmbeddingModel(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, cfg: dict[str, Any], family: str, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        family_cls: type[LlamaForCausalLM] = get_model_class([_CAUSAL_ARCH[family]])  # type: ignore[assignment]
        tp = TensorParallelGroup.single()
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_position, cfg)
        layers = []
        for i in range(cfg["num_hidden_layers"]):
            if family_cls.sliding_window(cfg, i) is not None:
                raise ValueError(f"layer {i} uses a sliding window, which the pooling attention does not apply yet")
            attn = family_cls.attention_cls(cfg, i, self.rotary, family_cls.qkv_bias(cfg), None, tp)
            old = attn.attn
            attn.attn = VarlenAttention(old.num_heads, old.num_kv_heads, old.head_dim, old.scale, causal=True)
            layers.append(LlamaDecoderLayer(attn, cfg, tp))
        self.model = LlamaModel(cfg, layers, tp)

    def checkpoint_name(self, name: str) -> str | None:
        """A Qwen3Model-saved checkpoint (sentence-transformers) has no "model." prefix; a
        *ForCausalLM one has it and an lm_head, which embedding does not use."""
        if name.startswith("lm_head.") or name.endswith("rotary_emb.inv_freq"):
            return None
        return name if name.startswith("model.") else "model." + name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids and positions (token types unused) -> (T, hidden) final-normed hidden states."""
        return self.model(input_ids, positions)
