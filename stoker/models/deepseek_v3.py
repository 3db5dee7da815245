"""DeepSeek-V3 / R1 and Kimi-K2 (`DeepseekV3ForCausalLM`; Kimi-K2's config says model_type
`kimi_k2` with the same architecture): DeepSeek-V2's model (models/deepseek_v2.py: MLA over a
latent KV cache, dense first layers, shared experts) with V3's router: sigmoid scores, the
`e_score_correction_bias` steering the choice, grouped top-k (`n_group` / `topk_group`),
renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`)
(layers/moe_router.GroupedTopKRouter). `topk_method` noaux_tc and `scoring_func` sigmoid
are what it implements; another value is refused.

The multi-token-prediction module (`num_nextn_predict_layers`, checkpoint layers numbered
from num_hidden_layers) is skipped on load; it is not used as a speculative drafter.
"""

from __future__ import annotations

from typing import Any

from stoker.layers.moe_router import GroupedTopKRouter, RouterLinear
from stoker.models.deepseek_v2 import DeepseekV2ForCausalLM


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @classmethod
    def router(cls, cfg: dict[str, Any]) -> RouterLinear:
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"DeepseekV3ForCausalLM: topk_method {cfg.get('topk_method')!r} with scoring_func "
                             f"{cfg.get('scoring_func')!r} is not supported; supported: noaux_tc with sigmoid")
        return GroupedTopKRouter(
            cfg["hidden_size"], int(cfg["n_routed_experts"]), cfg["num_experts_per_tok"],
            num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )  # fmt: skip
