"""The EAGLE-3 draft head for a Llama target (`LlamaForCausalLMEagle3`, as published for
Llama-3.1-8B-Instruct: Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test", 2025).

One Llama decoder layer (`midlayer.*` in the checkpoint) that reads two things per position p:
  * the target's hidden states at p from three of its layers (low, mid, high), concatenated
    (T, 3 x target_hidden) and projected by `fc` to (T, hidden); on later draft steps, the head's
    own pre-norm output at the previous position instead (already (T, hidden));
  * the embedding of the token at p + 1 (the target's embedding unless the head ships its own).
Both are RMS-normed and concatenated, so q/k/v read 2 x hidden; the residual is the hidden
input. The LM head covers a smaller draft vocabulary; `d2t[i]` is the offset that maps draft id i
to target id i + d2t[i] (`t2d`, the inverse mask, is not needed to draft and is not read).

Under tensor parallelism (`tp`) the layer is cut as a Llama layer is (q/k/v and gate/up by
column, o_proj and down_proj by row, the LM head by vocabulary); `fc`, the norms and `d2t` are
whole on every rank, since their inputs (the target's residual stream) are whole there.

The layout follows vLLM's llama_eagle3.py (read to learn the names and the data flow); the code
is built from Stoker's layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.config import KVCacheSpec
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import kv_head_partition
from stoker.layers.attention import Attention
from stoker.layers.embedding import LMHead, VocabEmbedding
from stoker.layers.linear import Linear, MergedLinear
from stoker.layers.norm import RMSNorm
from stoker.layers.rotary import RotaryEmbedding
from stoker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of, split_evenly

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def aux_layer_ids(head_cfg: dict[str, Any], target_num_layers: int) -> tuple[int, ...]:
    """Which target layers feed the head: the hidden state entering layer j (j = 0: the
    embedding). The head's config may pin them (`eagle_aux_hidden_state_layer_ids`, vLLM's key);
    otherwise vLLM's default for Llama, (2, L // 2, L - 3)."""
    ids = head_cfg.get("eagle_aux_hidden_state_layer_ids") or (head_cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else (2, target_num_layers // 2, target_num_layers - 3)
    if len(ids) != 3 or any(not 0 <= i < target_num_layers for i in ids):
        raise ValueError(f"EAGLE-3 reads three target layers in [0, {target_num_layers}); got {list(ids)} "
                         f"(set eagle_aux_hidden_state_layer_ids in the head's config.json)")
    return ids


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any], rotary: RotaryEmbedding, tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        bias = bool(cfg.get("attention_bias", False))
        self.self_attn = LlamaAttention(cfg, 0, rotary, bias, None, tp)
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = self.self_attn.head_dim
        # [norm(embedding) | norm(hidden)]: 2 x hidden into q, k and v, cut over the ranks as the
        # Llama layer's are (this rank's query heads and KV heads)
        self.self_attn.qkv_proj = MergedLinear(
            2 * hidden, {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}, bias=bias,
            out_splits={"q": split_evenly(heads, "num_attention_heads", tp),
                        "k": kv_head_partition(kv_heads, tp.world_size, tp.rank),
                        "v": kv_head_partition(kv_heads, tp.world_size, tp.rank)})
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) positions, (T, hidden) token embeddings and hidden inputs -> (MLP output, residual)."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (T, 2 x hidden)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None,
                 has_embedding: bool = False) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup.single()
        self.config = cfg
        hidden = cfg["hidden_size"]
        self.draft_vocab_size = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
        target_hidden = int(cfg.get("target_hidden_size") or hidden)
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_position, cfg)
        self.midlayer = Eagle3Layer(cfg, self.rotary, tp)
        self.fc = Linear(3 * target_hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6))
        self.lm_head = LMHead(self.draft_vocab_size, hidden, tp)
        # Most published heads share the target's embedding (the drafter passes it in)
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], hidden, tp) if has_embedding else None
        # draft id i -> target id i + d2t[i] (filled from the checkpoint's `d2t`; zeros: same vocab)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """The loader reads every tensor but the vocabulary maps (read by load_vocab_map)."""
        return name in ("d2t", "t2d")

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """(T, 3 x target_hidden) low|mid|high target hidden states -> (T, hidden)."""
        return self.fc(aux)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ((T, hidden) normed output for the LM head, (T, hidden) pre-norm output: the next
        draft step's hidden input)."""
        x, residual = self.midlayer(positions, embeds, hidden)
        normed, prenorm = self.norm(x, residual)
        return normed, prenorm

    def draft_token_ids(self, normed: torch.Tensor) -> torch.Tensor | None:
        """(S, hidden) -> (S,) greedy draft tokens as target ids (None on a rank the LM head's
        gather leaves without logits)."""
        logits = self.lm_head(normed)  # (S, draft_vocab) on rank 0; None on the other ranks of a sharded head
        if logits is None:
            return None
        best = logits.argmax(dim=-1)
        return best + self.d2t[best]

    def target_logits(self, normed: torch.Tensor, target_vocab_size: int) -> torch.Tensor | None:
        """(S, hidden) -> (S, target_vocab_size) logits in the target's ids, -inf at every id the
        draft vocabulary lacks (what a grammar's bitmask applies to); None where draft_token_ids is."""
        logits = self.lm_head(normed)  # (S, draft_vocab)
        if logits is None:
            return None
        out = logits.new_full((logits.shape[0], target_vocab_size), float("-inf"))
        ids = torch.arange(self.draft_vocab_size, device=logits.device) + self.d2t  # draft id -> target id
        out[:, ids] = logits
        return out

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def kv_cache_spec(self, dtype: str) -> KVCacheSpec:
        attn = self.attention_layers()[0]
        return KVCacheSpec(1, attn.num_kv_heads, attn.head_dim, dtype)
