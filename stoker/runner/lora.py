"""The LoRA slots of a whole model: built once on its target projections, filled per adapter.

Targets are found by module name (model.layers.{i}.self_attn.qkv_proj, ...o_proj,
...mlp.gate_up_proj, ...down_proj); a merged projection's shards map back to the checkpoint
names PEFT uses (q_proj, k_proj, v_proj; gate_proj, up_proj) through the model's
`packed_modules`. Each target's weight method is wrapped in a LoRAMethod holding its slots
(layers/lora.py), once, when the runner is built; `mapping` gives each step's token -> slot
map, which the runner puts in the forward's context.

On a Mixture-of-Experts model the attention projections (and the MLP of a dense layer among
sparse ones) take adapters; the experts, shared experts and routers do not (FusedMoE has no
LoRA method), and an adapter that targets them is refused when it is registered (`check`,
through RunnerInfo) naming the module.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from stoker.core.step import SeqStep
from stoker.layers.linear import Linear
from stoker.layers.lora import LoRAMapping, LoRAMethod, LoRASlots, segments_of
from stoker.layers.moe import FusedMoE
from stoker.lora.adapter import LoRAAdapter, check_served

_TARGET = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")


class ModelLoRASlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        # Mixture-of-Experts layers: their attention projections (and a dense layer's MLP) get
        # slots; a sparse layer's experts and router get none, and an adapter with weights for
        # them is refused by name (`check`), never loaded with those dropped.
        self.moe_layers = frozenset(int(m.group(1)) for name, module in model.named_modules()
                                    if isinstance(module, FusedMoE) and (m := re.search(r"layers\.(\d+)\.", name)))
        self.targets: set[tuple[int, str]] = set()  # (layer, PEFT projection name) with a slot
        shard_names = {(merged, shard): name for name, (merged, shard) in getattr(model, "packed_modules", {}).items()}
        self.layers: list[LoRASlots] = []
        for name, module in model.named_modules():
            m = _TARGET.search(name)
            if m is None or not isinstance(module, Linear):
                continue
            layer_idx, kind = int(m.group(1)), m.group(2)
            # Under tensor parallelism each rank holds its rows of B (column-parallel: qkv, gate_up)
            # or its columns of A (row-parallel: o, down; the partial updates are summed by the
            # layer's all-reduce, as its base output is), cut as the base weight is.
            if module.shard_offsets:
                shards = [(shard_names[(kind, shard)], first, rows, module.checkpoint_rows(shard))
                          for shard, (first, rows) in module.shard_offsets.items()]
            else:
                shards = [(kind, 0, module.out_features, module.checkpoint_rows(None))]
            # a fused [gate; up] CPU kernel writes its pre-activation in panel order: the update follows it
            out_rows = module.method.output_rows(module) if module.method.fuse_silu_and_mul else None
            slots = LoRASlots(layer_idx, shards, module.in_features, module.out_features, max_loras, max_rank,
                              dtype, device, out_rows, in_cols=module.checkpoint_cols())
            module.wrap_method(LoRAMethod(module.method, slots))
            self.layers.append(slots)
            self.targets.update((layer_idx, shard[0]) for shard in shards)
        if not self.layers:
            raise ValueError("this model has no projections LoRA can target")

    def check(self, adapter: LoRAAdapter) -> None:
        """LoRAError naming the first projection of `adapter` that has no slot here."""
        check_served(adapter, frozenset(self.targets), self.moe_layers)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.check(adapter)  # the engine checked at registration (RunnerInfo.lora_targets); again here, before a slot changes
        for layer in self.layers:
            layer.load(slot, adapter)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear(slot)

    def mapping(self, seqs: list[SeqStep], cu_seqlens: list[int]) -> LoRAMapping | None:
        """The step's token -> slot map (runs of tokens per adapter; on GPU also a (T,) slot per
        token); None when no sequence has an adapter."""
        slots = [s.lora_slot for s in seqs]
        segments = segments_of(slots, cu_seqlens)
        if not segments:
            return None
        slot_ids = None
        if self.device.type == "cuda":
            per_token = torch.tensor(slots, dtype=torch.int32).repeat_interleave(torch.tensor(seqs_lengths(cu_seqlens)))
            slot_ids = per_token.to(self.device, non_blocking=True)
        return LoRAMapping(segments, slot_ids)


def seqs_lengths(cu_seqlens: list[int]) -> list[int]:
    return [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
