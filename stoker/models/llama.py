"""Llama 2 / 3 / 3.1 / 3.2 (`LlamaForCausalLM`), the base the other families extend.

Parameter names match the Hugging Face checkpoint, except that q/k/v and gate/up are
stacked into one GEMM each (`packed_modules` tells the loader where each shard goes).
Config fields honoured: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads (GQA), head_dim, hidden_act, rms_norm_eps,
rope_theta / rope_scaling / rope_parameters (default, linear, llama3, yarn),
max_position_embeddings, attention_bias, mlp_bias, tie_word_embeddings, sliding_window /
layer_types where a family uses them.

Tensor parallelism (`tp`, this rank's group; Megatron-LM's layout): q/k/v and gate/up are
column-parallel (each rank holds num_heads / tp query heads, its KV heads, and
intermediate_size / tp MLP columns), o_proj and down_proj row-parallel (one all-reduce each
per layer), embedding and LM head vocabulary-parallel; norms and rotary are replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.config import KVCacheSpec
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import Partition, kv_head_partition
from stoker.layers.attention import Attention
from stoker.layers.embedding import LMHead, VocabEmbedding
from stoker.layers.linear import GateUpLinear, Linear, MergedLinear
from stoker.layers.norm import RMSNorm
from stoker.layers.rotary import RotaryEmbedding


def head_dim_of(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def split_evenly(total: int, field: str, tp: TensorParallelGroup) -> Partition:
    if total % tp.world_size:
        raise ValueError(f"{field} {total} is not divisible by tensor_parallel_size {tp.world_size}; choose a size that divides it")
    return Partition(tp.world_size, tp.rank)


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool, sliding_window: int | None,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        total_kv_heads = cfg.get("num_key_value_heads") or total_heads
        self.head_dim = head_dim_of(cfg)
        q_part = split_evenly(total_heads, "num_attention_heads", tp)
        kv_part = kv_head_partition(total_kv_heads, tp.world_size, tp.rank)
        # This rank's heads: (T, num_heads, head_dim) queries over (T, num_kv_heads, head_dim) keys.
        self.num_heads = q_part.size(total_heads)
        self.num_kv_heads = kv_part.size(total_kv_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_rows, kv_rows = total_heads * self.head_dim, total_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, {"q": q_rows, "k": kv_rows, "v": kv_rows}, bias=qkv_bias,
                                     out_splits={"q": q_part, "k": kv_part, "v": kv_part})
        self.o_proj = Linear(q_rows, hidden, bias=bool(cfg.get("attention_bias", False)), in_split=q_part, tp=tp)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, sliding_window)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for Qwen3's per-head q/k RMSNorm; identity here."""
        return q, k

    def attention_sinks(self) -> torch.Tensor | None:
        """Hook for gpt-oss's per-head sink logits (H,); none here."""
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (T, q_size + 2 * kv_size)
        # heads first, then split: the same (T, heads, D) views as splitting q/k/v and reshaping
        # each, in 4 tensor objects instead of 6 (each one costs a few us of a decode step)
        q, k, v = qkv.reshape(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary(positions, q, k)
        sinks = self.attention_sinks()  # only gpt-oss has them; other attentions take (q, k, v) alone
        out = self.attn(q, k, v) if sinks is None else self.attn(q, k, v, sinks)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        bias = bool(cfg.get("mlp_bias", False))
        part = split_evenly(inter, "intermediate_size", tp)
        self.gate_up_proj = GateUpLinear(hidden, inter, cfg.get("hidden_act", "silu"), bias=bias, split=part)
        self.down_proj = Linear(inter, hidden, bias=bias, in_split=part, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # (T, hidden) -> (T, inter) activated -> (T, hidden)


class LlamaDecoderLayer(nn.Module):
    """Attention then a feed-forward block; the block is the family's choice (`mlp`: a dense
    LlamaMLP when not given, a Mixture-of-Experts block in the MoE families)."""

    def __init__(self, self_attn: nn.Module, cfg: dict[str, Any], tp: TensorParallelGroup,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = self_attn
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def norm_input(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_layernorm, fused with the residual add after the first layer: (normed, residual)."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.norm_input(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        """Hook for a family whose checkpoint names the block otherwise (Mixtral: block_sparse_moe)."""
        return self.mlp(hidden)


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], layers: list[nn.Module], tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], cfg["hidden_size"], tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint shard name -> (merged module name, shard key)
    packed_modules: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    attention_cls: type[LlamaAttention] = LlamaAttention
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    model_cls: type[LlamaModel] = LlamaModel  # a family that scales its embeddings (Granite, Gemma) brings its own

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup.single()
        self.config = cfg
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_position, cfg)
        layers = [
            self.decoder_layer_cls(
                self.attention_cls(cfg, i, self.rotary, self.qkv_bias(cfg), self.sliding_window(cfg, i), tp), cfg, tp,
                self.mlp_block(cfg, i, tp),
            )
            for i in range(cfg["num_hidden_layers"])
        ]
        self.model = self.model_cls(cfg, layers, tp)
        self.lm_head = LMHead(cfg["vocab_size"], cfg["hidden_size"], tp)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    # ---- family hooks
    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        """Layer `layer_idx`'s feed-forward block (mini-sglang's MLP / MoE swap): dense here."""
        return LlamaMLP(cfg, tp)

    @classmethod
    def qkv_bias(cls, cfg: dict[str, Any]) -> bool:
        return bool(cfg.get("attention_bias", False))

    @classmethod
    def sliding_window(cls, cfg: dict[str, Any], layer_idx: int) -> int | None:
        """Window for layer `layer_idx` from `layer_types` when the config lists them."""
        layer_types = cfg.get("layer_types")
        if layer_types and layer_types[layer_idx] == "sliding_attention":
            return cfg.get("sliding_window")
        return None

    # ---- execution
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(T,) token ids and positions -> (T, hidden) final hidden states."""
        return self.model(input_ids, positions)

    def kv_cache_spec(self, dtype: str) -> KVCacheSpec:
        """What one token of this rank's KV cache is, stored as `dtype` (the runner's choice:
        the model dtype, or "fp8_e4m3"); with tensor parallelism, this rank's KV heads."""
        layers = self.attention_layers()
        return KVCacheSpec(len(layers), layers[0].num_kv_heads, layers[0].head_dim, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(num_sampled, hidden) -> (num_sampled, vocab) float32 logits on the rank that
        samples (rank 0); None on the other tensor-parallel ranks."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
