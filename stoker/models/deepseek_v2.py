"""DeepSeek-V2 / V2-Lite (`DeepseekV2ForCausalLM`): multi-head latent attention
(layers/mla_attention.py) over a latent KV cache, the first `first_k_dense_replace` layers
dense (`intermediate_size`), the rest Mixture-of-Experts with V2's softmax router and
`n_shared_experts` ungated shared experts. DeepSeek-V3 (models/deepseek_v3.py) is this model
with V3's grouped sigmoid router.

Config fields: q_lora_rank (null in V2-Lite: a plain q_proj), kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim, rope_scaling (DeepSeek YaRN: mscale / mscale_all_dim; the
latter's square folded into the softmax scale), rope_interleave (true: DeepSeek's paired
layout, as transformers), n_routed_experts, num_experts_per_tok, moe_intermediate_size,
n_shared_experts, first_k_dense_replace, moe_layer_freq (1 only), topk_method (greedy or
group_limited_greedy), n_group, topk_group, norm_topk_prob, routed_scaling_factor.

Checkpoint: model.layers.{i}.self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj},
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; mlp.{gate,up,down}_proj (dense);
mlp.gate.weight, mlp.experts.{e}.{gate,up,down}_proj, mlp.shared_experts.{gate,up,down}_proj.
Layers numbered from num_hidden_layers up (V3's multi-token-prediction module) are skipped
on load: this model does not run them.

Tensor parallelism splits the heads (layers/mla_attention.MLAAttention) and every rank caches
the whole latent; expert parallelism (--enable-expert-parallel) deals the routed experts out
whole to the same ranks (DeepseekMoeBlock). An FP8 KV cache (--kv-cache-dtype fp8) stores the
latent as E4M3 under the layer's k_scale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stoker.config import KVCacheSpec
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.layers.embedding import LMHead
from stoker.layers.mla_attention import LatentAttention, MLAAttention
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_router import RouterLinear
from stoker.layers.rotary import RotaryEmbedding
from stoker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, LlamaMLP, split_evenly
from stoker.models.moe_block import dense_mlp, moe_partitions
from stoker.models.moe_loading import QWEN_EXPERT_PARAMS

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2Router(RouterLinear):
    """V2's router: softmax over the experts; `greedy` takes the top k, `group_limited_greedy`
    first keeps the `topk_group` groups with the best single expert score and takes the top k
    inside them; optionally renormalised (`norm_topk_prob`), then times `routed_scaling_factor`.
    Checkpoint tensor `gate.weight` (E, H)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, method: str, num_groups: int,
                 topk_groups: int, renormalize: bool, scaling_factor: float) -> None:
        super().__init__(hidden_size, num_experts)
        if method not in V2_TOPK_METHODS:
            raise ValueError(f"topk_method {method!r} is not supported for DeepseekV2ForCausalLM; "
                             f"supported: {', '.join(V2_TOPK_METHODS)}")
        if method == "group_limited_greedy" and (num_experts % num_groups or not 1 <= topk_groups <= num_groups):
            raise ValueError(f"n_group {num_groups} must divide n_routed_experts {num_experts} and topk_group "
                             f"{topk_groups} be between 1 and n_group")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts {num_experts}")
        self.num_experts, self.top_k, self.topk_method = num_experts, top_k, method
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.renormalize, self.scaling_factor = renormalize, scaling_factor

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> topk_weights (T, k) float32, topk_ids (T, k) int64."""
        scores = torch.softmax(self(x), dim=-1)  # (T, E) float32
        if self.topk_method == "group_limited_greedy":
            t, e = scores.shape
            group_scores = scores.view(t, self.num_groups, e // self.num_groups).amax(dim=-1)  # (T, G)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, torch.topk(group_scores, self.topk_groups, dim=-1)[1], True)
            scores = scores.masked_fill(~keep.repeat_interleave(e // self.num_groups, dim=1), 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.renormalize and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling_factor, ids

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}, method={self.topk_method}, scaling={self.scaling_factor}"


class DeepseekMoeBlock(nn.Module):
    """`n_routed_experts` experts of `moe_intermediate_size` behind `gate` (the family's router),
    plus `n_shared_experts` shared experts every token takes, held as one dense MLP
    `n_shared_experts` x `moe_intermediate_size` wide.

    Tensor parallelism cuts every expert's I; expert parallelism (`tp.expert_parallel`) deals
    the routed experts out whole to the ranks (models/moe_block.moe_partitions) while the
    shared experts stay cut over the same ranks as a tensor-parallel MLP: both end in one
    all-reduce of partial sums, as under tensor parallelism."""

    def __init__(self, cfg: dict[str, Any], gate: RouterLinear, tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.gate = gate
        part, held = moe_partitions(gate.num_experts, inter, "moe_intermediate_size", tp)
        self.experts = FusedMoE(gate.num_experts, hidden, inter, cfg.get("hidden_act", "silu"), split=part, tp=tp,
                                experts=held)
        shared = int(cfg.get("n_shared_experts") or 0) * inter
        self.shared_experts: LlamaMLP | None = dense_mlp(cfg, shared, tp) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        topk_weights, topk_ids = self.gate.route(x)  # (T, k) float32, (T, k)
        out = self.experts(x, topk_weights, topk_ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def check_mla_config(cfg: dict[str, Any], tp: TensorParallelGroup) -> None:
    """What the MLA families cannot honour, refused by name before any tensor exists."""
    arch = (cfg.get("architectures") or ["this model"])[0]
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise ValueError(f"{arch}: config.json has no {key!r}, which multi-head latent attention needs")
    if int(cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"{arch}: moe_layer_freq {cfg['moe_layer_freq']} is not supported (only 1: every layer "
                         "after first_k_dense_replace is sparse)")


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # q_proj is a projection of its own here, not a shard of a q/k/v stack
    packed_modules = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    expert_params = QWEN_EXPERT_PARAMS

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        nn.Module.__init__(self)
        tp = tp or TensorParallelGroup.single()
        check_mla_config(cfg, tp)
        self.config = cfg
        # the rotary turns only the qk_rope_head_dim part of q and the shared rope key
        self.rotary = RotaryEmbedding(int(cfg["qk_rope_head_dim"]), max_position, cfg)
        heads = split_evenly(cfg["num_attention_heads"], "num_attention_heads", tp)  # the latent is replicated
        layers = [LlamaDecoderLayer(MLAAttention(cfg, self.rotary, heads, tp), cfg, tp, self.mlp_block(cfg, i, tp))
                  for i in range(cfg["num_hidden_layers"])]
        self.model = LlamaModel(cfg, layers, tp)
        self.lm_head = LMHead(cfg["vocab_size"], cfg["hidden_size"], tp)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def router(cls, cfg: dict[str, Any]) -> RouterLinear:
        num_experts = int(cfg["n_routed_experts"])
        return DeepseekV2Router(
            cfg["hidden_size"], num_experts, cfg["num_experts_per_tok"], method=cfg.get("topk_method") or "greedy",
            num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )  # fmt: skip

    @classmethod
    def mlp_block(cls, cfg: dict[str, Any], layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        if layer_idx < int(cfg.get("first_k_dense_replace") or 0) or not cfg.get("n_routed_experts"):
            return dense_mlp(cfg, cfg["intermediate_size"], tp)
        return DeepseekMoeBlock(cfg, cls.router(cfg), tp)

    def kv_cache_spec(self, dtype: str) -> KVCacheSpec:
        """One latent of kv_lora_rank + qk_rope_head_dim per token and layer, no V: the same on
        every rank (the latent is not split over heads). `fp8_e4m3`: one byte per value, the
        latent stored under the layer's k_scale (layers/mla_kernels.py)."""
        layers = self.attention_layers()
        return KVCacheSpec(len(layers), 1, layers[0].head_dim, dtype, kv_tensors=1)

    def attention_layers(self) -> list[LatentAttention]:  # type: ignore[override]
        return [layer.self_attn.attn for layer in self.model.layers]

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """The multi-token-prediction layers, numbered after the decoder's last."""
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 3 or not parts[2].isdigit():
            return False
        return int(parts[2]) >= self.config["num_hidden_layers"]



