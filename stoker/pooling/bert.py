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
from stoker.pooling.attention import VarlenAttention, current_batch

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
        self.act_name = act
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
    """The layers, run through their modules (the reference, any device and dtype) or, on CPU
    float32 with the C kernels, all of them in one C call (`FusedBertLayers`). Which is decided at
    the first forward, when the weights are loaded and re-laid, and kept; `use_fused = False`
    before it keeps the modules (the tests' twin)."""

    def __init__(self, cfg: dict[str, Any], eps: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, eps) for _ in range(cfg["num_hidden_layers"]))
        self.num_heads, self.eps = cfg["num_attention_heads"], eps
        self.use_fused: bool | None = None
        self.fused: FusedBertLayers | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.use_fused is None:
            self.fused = FusedBertLayers.build(self, hidden)
            self.use_fused = self.fused is not None
        if self.use_fused:
            assert self.fused is not None
            return self.fused(hidden)
        for layer in self.layer:
            hidden = layer(hidden)
        return hidden


class FusedBertLayers:
    """All the layers of a BERT encoder in one C call (kernels/cpu/encoder_layer.c), the GIL
    released throughout: through the modules a layer is ~35 torch and ctypes calls, each of
    which gives the GIL back and takes it again, and in an embedding server each re-take can
    wait behind the event loop (docs/benchmarks.md, issue 18). The modules are its twin."""

    def __init__(self, encoder: BertEncoder) -> None:
        from stoker.kernels.cpu import encoder_layer as cpu_encoder

        first = encoder.layer[0]
        self.hidden = first.attention.output.dense.out_features
        self.intermediate = first.intermediate.dense.out_features
        self.num_heads, self.eps = encoder.num_heads, encoder.eps
        self.act = cpu_encoder.BERT_ACTIVATIONS[first.intermediate.act_name]
        self.scale = (self.hidden // self.num_heads) ** -0.5
        self.tensors = [self._tensors(layer) for layer in encoder.layer]  # kept: the array points into them
        self.params = cpu_encoder.bert_encoder_params([cpu_encoder.bert_layer_params(t, self.hidden, self.intermediate)
                                                       for t in self.tensors])  # 12 x L pointers: every layer in one call

    @staticmethod
    def _tensors(layer: BertLayer) -> list[torch.Tensor]:
        attn_out, out = layer.attention.output, layer.output
        tensors = []
        for linear, norm in ((layer.attention.get_submodule("self").qkv, None), (attn_out.dense, attn_out.LayerNorm),
                             (layer.intermediate.dense, None), (out.dense, out.LayerNorm)):
            tensors += [linear.weight.data, linear.bias.data]
            if norm is not None:
                tensors += [norm.weight.data, norm.bias.data]
        return tensors

    @classmethod
    def build(cls, encoder: BertEncoder, hidden: torch.Tensor) -> FusedBertLayers | None:
        """The fused layers, or None where they cannot run: not CPU float32, no C kernels, a
        head_dim the attention kernel does not take, an activation it lacks, or a projection not
        on the packed C weights (another weight method, or its torch twin in a test)."""
        from stoker.kernels.cpu import encoder_layer as cpu_encoder
        from stoker.kernels.cpu import linear as cpu_linear
        from stoker.layers.weight_method import PackedCpuMethod
        from stoker.pooling.attention import kernel_supports

        if not encoder.layer or not kernel_supports(hidden, encoder.layer[0].attention.get_submodule("self").head_dim):
            return None
        for layer in encoder.layer:
            linears = (layer.attention.get_submodule("self").qkv, layer.attention.output.dense, layer.intermediate.dense,
                       layer.output.dense)
            for linear in linears:
                method = linear.method
                if not (isinstance(method, PackedCpuMethod) and method.kernel is cpu_linear.linear
                        and not method.fuse_silu_and_mul and linear.bias is not None):
                    return None
            if layer.intermediate.act_name not in cpu_encoder.BERT_ACTIVATIONS:
                return None
        return cls(encoder)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        from stoker.kernels.cpu import encoder_layer as cpu_encoder

        batch = current_batch()
        x = hidden.contiguous()  # overwritten layer by layer: the embeddings' fresh output
        workspace = torch.empty(x.shape[0] * (5 * self.hidden + self.intermediate), dtype=torch.float32)
        cpu_encoder.bert_encoder(x, self.params, self.num_heads, self.intermediate, self.eps, self.act, batch.token_table,
                                 batch.cu_tensor, batch.lengths, self.scale, workspace)
        return x


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
