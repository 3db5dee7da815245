"""BERT-family encoders (`BertModel`, `XLMRobertaModel`) and the BERT cross-encoder
(`BertForSequenceClassification`), on packed tokens.

Post-LayerNorm blocks (Devlin et al. 2019): x = LN(x + attn(x)); x = LN(x + W2 act(W1 x)).
Module names match the Hugging Face checkpoint (encoder.layer.N.attention.self.query ...)
except that query/key/value run as one GEMM (`packed_modules` tells the loader). The
projections are Stoker's `Linear` (their weight method is chosen at build: packed CPU panels,
MKL layout or F.linear); LayerNorm is torch's.
Config fields honoured: vocab_size, hidden_size, num_hidden_layers, num_attention_heads,
intermediate_size, hidden_act, layer_norm_eps, max_position_embeddings, type_vocab_size,
pad_token_id (RoBERTa's position offset).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stoker.layers.linear import Linear, MergedLinear
from stoker.pooling.attention import VarlenAttention

_ACTS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.qkv = MergedLinear(hidden, {"q": hidden, "k": hidden, "v": hidden}, bias=True)
        self.attn = VarlenAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5, causal=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        num_tokens = hidden.shape[0]
        qkv = self.qkv(hidden).view(num_tokens, 3, self.num_heads, self.head_dim)  # q, k, v: (T, 3, H, D)
        return self.attn.forward_qkv(qkv).reshape(num_tokens, -1)


class BertResidualOutput(nn.Module):
    """dense, then LayerNorm(x + residual): BERT's attention.output and output blocks."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], eps: float) -> None:
        super().__init__()
        self.add_module("self", BertSelfAttention(cfg))  # the checkpoint's name: attention.self.query
        self.output = BertResidualOutput(cfg["hidden_size"], cfg["hidden_size"], eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.get_submodule("self")(hidden), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.dense = Linear(cfg["hidden_size"], cfg["intermediate_size"], bias=True)
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(_ACTS)}")
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, intermediate)
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], eps: float) -> None:
        super().__init__()
        self.attention = BertAttention(cfg, eps)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertResidualOutput(cfg["intermediate_size"], cfg["hidden_size"], eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any], eps: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, eps) for _ in range(cfg["num_hidden_layers"]))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden)
        return hidden


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any], eps: float) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(cfg.get("max_position_embeddings", 512), hidden)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)  # (T, hidden)


class BertPoolingModel(nn.Module):
    """The encoder, and for a cross-encoder BERT's pooler (dense + tanh on [CLS]) and classifier."""

    packed_modules: dict[str, tuple[str, str]] = {"query": ("qkv", "q"), "key": ("qkv", "k"), "value": ("qkv", "v")}

    def __init__(self, cfg: dict[str, Any], is_classifier: bool) -> None:
        super().__init__()
        self.config = cfg
        eps = cfg.get("layer_norm_eps", 1e-12)
        self.embeddings = BertEmbeddings(cfg, eps)
        self.encoder = BertEncoder(cfg, eps)
        self.is_classifier = is_classifier
        if is_classifier:
            self.pooler = nn.Module()
            self.pooler.dense = Linear(cfg["hidden_size"], cfg["hidden_size"], bias=True)
            self.classifier = Linear(cfg["hidden_size"], 1, bias=True)

    def checkpoint_name(self, name: str) -> str | None:
        """The model's name for a checkpoint tensor; None: not used (position_ids buffers, the
        pooler of an embedding model)."""
        for prefix in ("bert.", "roberta."):
            name = name.removeprefix(prefix)
        if name.endswith("position_ids") or (not self.is_classifier and name.startswith("pooler.")):
            return None
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids, positions, token types -> (T, hidden) last hidden states."""
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids))

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """(B, hidden) [CLS] states -> (B,) logits."""
        return self.classifier(torch.tanh(self.pooler.dense(first_tokens)))[:, 0]
