"""The CPU decode step in one C call: a Llama-family model's decoder layers through
kernels/cpu/decoder_layer.c, the way a GPU replays a captured graph (runner/cuda_graph.py).

`build` looks at the model once, after the KV cache is allocated, and either binds every
layer's weights, norms and cache into one slot array or says why not (the step then runs
module by module, as before). `can_run` takes pure-decode steps; `run` embeds the tokens,
makes the one call, and applies the model's final norm. The logits are the module path's
bit for bit: every stage is the same C function with the same arguments
(tests/model/test_cpu_fused_decode.py).

What it takes: the C kernels bound (CPU float32), one rank, LlamaModel's layers as built
(LlamaDecoderLayer with LlamaAttention or Qwen3's per-head q/k norms, a SiLU LlamaMLP: Llama,
Mistral, Qwen2, Qwen3 and their GGUF files), a float32 KV cache, and every projection a
method that is one C kernel (`LinearMethod.c_linear_slots`: float32, int8 / FP8, 4-bit
W4A16 / W4A8; not LoRA, not a composite GGUF layer). The families that scale embeddings,
cap logits, add sinks or change the norm (Gemma, Granite, gpt-oss, OLMo 2) keep the module path.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from stoker.kernels import ops
from stoker.kernels.cpu import build as cpu_build
from stoker.kernels.cpu.decoder_layer import DecoderLayers, LayerTensors, LinearSlots, decoder_decode
from stoker.layers.activation import SiluAndMul
from stoker.layers.attention import AttentionMetadata
from stoker.layers.linear import Linear
from stoker.layers.norm import RMSNorm

logger = logging.getLogger(__name__)


class CpuDecodeRunner:
    def __init__(self, model: nn.Module, layers: DecoderLayers) -> None:
        self.model = model
        self.layers = layers

    @staticmethod
    def build(model: nn.Module, tp_size: int) -> tuple[CpuDecodeRunner | None, str]:
        """(the runner, "") or (None, why not), for a model whose KV cache is bound."""
        from stoker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
        from stoker.models.qwen3 import Qwen3Attention

        if tp_size != 1:
            return None, "tensor parallelism (the all-reduces run between the layers)"
        if not cpu_build.available():
            return None, "the C kernels are not available"
        inner = getattr(model, "model", None)
        if type(inner) is not LlamaModel:
            return None, f"{type(model).__name__} is not built from LlamaModel's layers"
        norms = [inner.norm]
        tensors = []
        attn0 = inner.layers[0].self_attn if len(inner.layers) else None
        for i, layer in enumerate(inner.layers):
            if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) not in (LlamaAttention, Qwen3Attention):
                return None, f"layer {i} is a {type(layer).__name__} with {type(layer.self_attn).__name__}"
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not LlamaMLP or not isinstance(mlp.gate_up_proj.act, SiluAndMul):
                return None, f"layer {i}'s feed-forward block is not a SiLU LlamaMLP"
            core = attn.attn
            if core.with_sinks or core.logits_soft_cap is not None or core.kernels.name != "cpu":
                return None, f"layer {i}'s attention has sinks, a soft cap or a non-C kernel set"
            if core.k_cache.dtype != torch.float32 or core.k_cache.dim() != 4:
                return None, f"the KV cache is {core.k_cache.dtype} (the fused step stores float32)"
            if attn.rotary is not attn0.rotary or attn.rotary.kernels is not ops.CPU:
                return None, "the layers do not share one rotary table on the C kernels"
            if (attn.num_heads, attn.num_kv_heads, attn.head_dim, core.scale) != (
                    attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, attn0.attn.scale):
                return None, f"layer {i}'s heads differ from layer 0's"
            layer_norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if type(attn) is Qwen3Attention:
                layer_norms += [attn.q_norm, attn.k_norm]
            norms += layer_norms
            projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            slots = [_slots(p) for p in projections]
            if any(s is None for s in slots):
                bad = next(p for p, s in zip(projections, slots) if s is None)
                return None, f"layer {i}: {bad.method.describe() if bad.method else None} is not one C kernel call"
            qk = (attn.q_norm.weight.data, attn.k_norm.weight.data) if type(attn) is Qwen3Attention else (None, None)
            tensors.append(LayerTensors(layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data, *qk,
                                        core.k_cache, core.v_cache, core.sliding_window, *slots))
        if not tensors:
            return None, "the model has no layers"
        if any(type(n) is not RMSNorm or n.kernels is not ops.CPU for n in norms):
            return None, "a norm is not RMSNorm on the C kernels"
        eps = inner.norm.eps
        if any(n.eps != eps for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None, "the layers' norms differ in eps"
        qk_eps = attn0.q_norm.eps if type(attn0) is Qwen3Attention else eps
        if type(attn0) is Qwen3Attention and any(
                n.eps != qk_eps for layer in inner.layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)):
            return None, "the layers' q/k norms differ in eps"
        layers = DecoderLayers(tensors, inner.norm.weight.shape[0], attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
                               attn0.rotary.cos_sin_cache, eps, qk_eps, attn0.attn.scale)
        return CpuDecodeRunner(model, layers), ""

    def can_run(self, num_seqs: int, md: AttentionMetadata) -> bool:
        """A pure-decode step: one new token per sequence."""
        return 0 < num_seqs == md.num_decodes == len(md.context_lens_list)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """(B,) tokens and positions -> (B, hidden) final hidden states, as model(input_ids, positions)."""
        inner = self.model.model
        x = inner.embed_tokens(input_ids).contiguous()  # (B, hidden), a new tensor: overwritten below
        res = decoder_decode(self.layers, x, positions, md.slot_mapping, md.block_tables, md.context_lens)
        hidden, _ = inner.norm(x, res)
        return hidden


def _slots(layer: Linear) -> LinearSlots | None:
    if layer.reduce is not None or layer.method is None:
        return None
    return layer.method.c_linear_slots(layer)
