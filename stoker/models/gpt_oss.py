"""gpt-oss (`GptOssForCausalLM`): attention with a learned sink per head (one more logit in the
softmax's denominator), sliding-window and full layers alternating (`layer_types`,
`sliding_window`), YaRN rotary, biases on q/k/v and o; every layer sparse: a biased router
(top-k of the logits, softmax over those k) and `num_local_experts` experts of
`intermediate_size` with biases and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).

Checkpoint (transformers 5's float layout, what its save_pretrained writes; the Hub's MXFP4
checkpoints name the biases, router and sinks the same and hold the expert weights as
`*_blocks` / `*_scales` instead):
self_attn.{q,k,v,o}_proj (+ bias), self_attn.sinks (H,), mlp.router.{weight,bias},
mlp.experts.gate_up_proj (E, H, 2I) with gate and up interleaved column by column,
mlp.experts.gate_up_proj_bias (E, 2I), mlp.experts.down_proj (E, I, H),
mlp.experts.down_proj_bias (E, H).

What is not served yet, each refused by name when the model is built:
* the Hub's MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`, experts as
  `*_blocks` / `*_scales`): 4-bit experts come with their own quantized method;
* tensor parallelism: the experts and sinks here are whole on every rank.
The attention takes its sinks on the C kernels (CPU float32) and the torch twins; on CUDA it
runs the twins (the Triton kernels take no sinks yet: layers/attention.py). The experts are
this file's own module (`GptOssExperts`, biases and the
clamped activation that `FusedMoE` does not take), so CUDA graphs stay off and LoRA is refused
for this family, as for the FusedMoE ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.activation import clamped_swiglu
from stoker.layers.attention import Attention
from stoker.layers.moe import expert_by_expert
from stoker.layers.moe_router import BiasedTopKRouter
from stoker.layers.rotary import RotaryEmbedding
from stoker.models.llama import LlamaAttention, LlamaForCausalLM


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, rotary: RotaryEmbedding, qkv_bias: bool,
                 sliding_window: int | None, tp: TensorParallelGroup) -> None:
        # attention_bias (true in every gpt-oss config) puts a bias on o_proj too
        super().__init__({**cfg, "attention_bias": cfg.get("attention_bias", True)}, layer_idx, rotary, qkv_bias,
                         sliding_window, tp)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, sliding_window,
                              with_sinks=True)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)  # (H,) one logit per head

    def attention_sinks(self) -> torch.Tensor:
        return self.sinks


class GptOssExperts(nn.Module):
    """E experts in the checkpoint's own layout (x @ W, W (H, 2I), gate and up interleaved),
    with biases; tokens grouped by expert once per call (layers/moe.expert_by_expert) and each
    token's k contributions summed in ascending expert order, as `MoEMethod.apply` does, so a
    token's result does not depend on the slot order of its choices."""

    #: the grouping reads each expert's token count on the host: the runner decodes eagerly
    graph_capturable = False
    #: experts outside FusedMoE: runner/lora.py refuses LoRA on them as on FusedMoE
    moe_experts = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.alpha, self.limit = e, alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, i, h), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # x (T, H), topk_weights (T, k) float32, topk_ids (T, k) -> (T, H)
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
            h = rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # (n, 2I), gate and up interleaved
            return clamped_swiglu(h, self.alpha, self.limit) @ self.down_proj[e] + self.down_proj_bias[e]

        return expert_by_expert(x, topk_weights, topk_ids, self.num_experts, expert)


class GptOssMoeBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, num_experts = cfg["hidden_size"], int(cfg["num_local_experts"])
        self.router = BiasedTopKRouter(hidden, num_experts, int(cfg["num_experts_per_tok"]))
        self.experts = GptOssExperts(num_experts, hidden, cfg["intermediate_size"], float(cfg.get("swiglu_alpha", 1.702)),
                                     float(cfg.get("swiglu_limit", 7.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        topk_weights, topk_ids = self.router.route(x)  # (T, k) float32, (T, k)
        return self.experts(x, topk_weights, topk_ids)


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        quant = (cfg.get("quantization_config") or {}).get("quant_method")
        if quant == "mxfp4":
            raise ValueError("gpt-oss MXFP4 checkpoints (quantization_config quant_method mxfp4, experts stored as "
                             "*_blocks / *_scales) are not supported yet; use a bf16 or float32 checkpoint (transformers "
                             "5 writes one with save_pretrained after loading with dequantize)")
        if tp is not None and tp.world_size > 1:
            raise ValueError("tensor parallelism (--tensor-parallel-size) is not supported for gpt-oss yet: its "
                             "experts and attention sinks are held whole on every rank")
        super().__init__(cfg, max_position, tp)

    @classmethod
    def qkv_bias(cls, cfg: dict[str, Any]) -> bool:
        return bool(cfg.get("attention_bias", True))

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return GptOssMoeBlock(cfg)
