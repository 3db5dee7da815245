"""gpt-oss (`GptOssForCausalLM`): attention with a learned sink per head (one more logit in the
softmax's denominator), sliding-window and full layers alternating (`layer_types`,
`sliding_window`), YaRN rotary, biases on q/k/v and o; every layer sparse: a biased router
(top-k of the logits, softmax over those k) and `num_local_experts` experts of
`intermediate_size` with biases and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).

The experts are a `FusedMoE` (layers/moe.py) with its options for this family: the clamped
SwiGLU as its activation (layers/activation.ClampedSwiGLU) and per-expert biases, so every
MoE method serves them (float torch, the C kernels' packed panels, FP8/INT8, MXFP4) and
tensor parallelism (I cut, w2's bias on rank 0) and `--enable-expert-parallel` (E cut) apply.

Checkpoints (models/gpt_oss_loading.py reads them):
* transformers 5's float layout, what its save_pretrained writes: self_attn.{q,k,v,o}_proj
  (+ bias), self_attn.sinks (H,), mlp.router.{weight,bias}, mlp.experts.gate_up_proj (E, H, 2I)
  with gate and up interleaved column by column, mlp.experts.gate_up_proj_bias (E, 2I),
  mlp.experts.down_proj (E, I, H), mlp.experts.down_proj_bias (E, H);
* the Hub's MXFP4 layout (`quantization_config.quant_method: mxfp4`): the same names, the
  expert weights as `gate_up_proj_blocks` / `_scales` and `down_proj_blocks` / `_scales`
  (layers/moe_mxfp4.py); attention, router and embeddings in the model dtype.

Under tensor parallelism each rank holds its heads' sinks. The attention takes its sinks on
the C kernels (CPU float32) and the torch twins; on CUDA it runs the twins (the Triton kernels
take no sinks yet: layers/attention.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.activation import ClampedSwiGLU
from stoker.layers.attention import Attention
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_router import BiasedTopKRouter
from stoker.layers.rotary import RotaryEmbedding
from stoker.models import gpt_oss_loading
from stoker.models.llama import LlamaAttention, LlamaForCausalLM, split_evenly
from stoker.models.moe_block import moe_partitions


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 sliding_window: int | None, tp: TensorParallelGroup) -> None:
        # attention_bias (true in every gpt-oss config) puts a bias on o_proj too
        super().__init__({**cfg, "attention_bias": cfg.get("attention_bias", True)}, layer_idx, rotary, qkv_bias,
                         sliding_window, tp)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, sliding_window,
                              with_sinks=True)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)  # (H / tp,) one logit per head
        total_heads = cfg["num_attention_heads"]
        # this rank's heads' sinks (the loader reads `checkpoint_slice` of a plain parameter)
        self.sinks.checkpoint_slice = (slice(*split_evenly(total_heads, "num_attention_heads", tp).range(total_heads)),)

    def attention_sinks(self) -> torch.Tensor:
        return self.sinks


class GptOssMoeBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any], tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, num_experts, inter = cfg["hidden_size"], int(cfg["num_local_experts"]), cfg["intermediate_size"]
        self.router = BiasedTopKRouter(hidden, num_experts, int(cfg["num_experts_per_tok"]))
        part, experts = moe_partitions(num_experts, inter, "intermediate_size", tp)
        act = ClampedSwiGLU(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))
        self.experts = FusedMoE(num_experts, hidden, inter, split=part, tp=tp, experts=experts, activation=act,
                                has_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        topk_weights, topk_ids = self.router.route(x)  # (T, k) float32, (T, k)
        return self.experts(x, topk_weights, topk_ids)


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention
    #: the checkpoint's stacked, interleaved expert tensors (and MXFP4 blocks) -> FusedMoE shards
    load_expert_tensor = staticmethod(gpt_oss_loading.load_expert_tensor)
    expert_params = gpt_oss_loading.EXPERT_PARAMS
    expert_checkpoint_name = staticmethod(gpt_oss_loading.checkpoint_name)

    @classmethod
    def qkv_bias(cls, cfg: dict[str, Any]) -> bool:
        return bool(cfg.get("attention_bias", True))

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return GptOssMoeBlock(cfg, tp)
