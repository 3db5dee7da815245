"""Phi-3 / Phi-3.5 / Phi-4 (`Phi3ForCausalLM`): Llama's shape with the checkpoint's q/k/v and
gate/up already stacked (`self_attn.qkv_proj`: rows [q; k; v], `mlp.gate_up_proj`: rows
[gate; up]), LongRoPE on the long-context checkpoints (layers/longrope.py: short / long factor
lists chosen once from max_model_len, as vLLM does), partial rotary where the config sets
`partial_rotary_factor` (Phi-4-mini: 0.75), and `sliding_window` (Phi-3-mini-4k: 2047) on
every layer.

The stacked tensors load into Stoker's merged layers through the loader's
`fused_checkpoint_modules` (models/loader.py cuts each at the shard boundaries): under tensor
parallelism each rank reads its q heads' rows, its KV heads' k rows and v rows, and its
columns of gate and of up, from the one checkpoint tensor. A PEFT adapter trained on Phi-3
targets qkv_proj / o_proj / gate_up_proj / down_proj; its stacked B is cut into the q, k, v
(gate, up) rows when it is read (lora/adapter.py), with A shared.

Refused when built: biases on the projections (`attention_bias` / `mlp_bias` true: no released
Phi-3 has them, and transformers' Phi3 builds none).
"""

from __future__ import annotations

from typing import Any

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # checkpoint module -> the shards it stacks, in row order (the merged layer's order)
    fused_checkpoint_modules: dict[str, tuple[str, ...]] = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}

    def __init__(self, cfg: dict[str, Any], max_position: int, tp: TensorParallelGroup | None = None) -> None:
        for field in ("attention_bias", "mlp_bias"):
            if cfg.get(field):
                raise ValueError(f"Phi-3 with {field} true is not supported (Phi-3 checkpoints have no projection "
                                 "biases); set it to false or null")
        super().__init__(cfg, max_position, tp)

    @classmethod
    def qkv_bias(cls, cfg: dict[str, Any]) -> bool:
        return False

    @classmethod
    def sliding_window(cls, cfg: dict[str, Any], layer_idx: int) -> int | None:
        return cfg.get("sliding_window")  # every layer (transformers' Phi3Model masks all layers with it)
