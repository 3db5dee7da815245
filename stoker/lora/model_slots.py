"""The LoRA slots of a whole model: built once on its target projections, filled per adapter.

Targets are found by module name (model.layers.{i}.self_attn.qkv_proj, ...o_proj,
...mlp.gate_up_proj, ...down_proj); a merged projection's shards map back to the checkpoint
names PEFT uses (q_proj, k_proj, v_proj; gate_proj, up_proj) through the model's
`packed_modules`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from stoker.core.step import SeqStep
from stoker.layers.linear import Linear
from stoker.lora.adapter import LoRAAdapter
from stoker.lora.layers import LoRAMapping, LoRASlots

_TARGET = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")


class ModelLoRASlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        shard_names = {(merged, shard): name for name, (merged, shard) in getattr(model, "packed_modules", {}).items()}
        self.layers: list[LoRASlots] = []
        for name, module in model.named_modules():
            m = _TARGET.search(name)
            if m is None or not isinstance(module, Linear):
                continue
            layer_idx, kind = int(m.group(1)), m.group(2)
            if module.shard_offsets:
                shards = [(shard_names[(kind, shard)], first, rows) for shard, (first, rows) in module.shard_offsets.items()]
            else:
                shards = [(kind, 0, module.out_features)]
            module.lora = LoRASlots(layer_idx, shards, module.in_features, module.out_features, max_loras, max_rank,
                                    dtype, device)
            self.layers.append(module.lora)
        if not self.layers:
            raise ValueError("this model has no projections LoRA can target")

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in self.layers:
            layer.load(slot, adapter)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear(slot)

    def mapping(self, seqs: list[SeqStep], cu_seqlens: list[int]) -> LoRAMapping | None:
        """The step's (T, S * R) token -> slot mask; None when no sequence has an adapter."""
        if all(s.lora_slot < 0 for s in seqs):
            return None
        r = self.max_rank
        mask = torch.zeros(cu_seqlens[-1], self.max_loras * r)
        slot_ids = torch.full((cu_seqlens[-1],), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            if s.lora_slot >= 0:
                mask[cu_seqlens[i]:cu_seqlens[i + 1], s.lora_slot * r:(s.lora_slot + 1) * r] = 1.0
                slot_ids[cu_seqlens[i]:cu_seqlens[i + 1]] = s.lora_slot
        on_gpu = self.device.type == "cuda"
        return LoRAMapping(mask.to(device=self.device, dtype=self.dtype, non_blocking=True),
                           slot_ids.to(self.device, non_blocking=True) if on_gpu else None)
