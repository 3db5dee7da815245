"""The model's per-layer expert token counters (`FusedMoE.expert_tokens`), read as one
`ExpertLoad` when the engine asks (its log interval, a /metrics scrape): one device-to-host
copy then, none per step."""

from __future__ import annotations

import re

import torch
from torch import nn

from stoker.core.expert_load import ExpertLoad
from stoker.layers.moe import FusedMoE
from stoker.layers.moe_load import ExpertTokenCounter

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertLoadReader:
    def __init__(self, model: nn.Module) -> None:
        self.counters: dict[int, ExpertTokenCounter] = {}
        for name, module in model.named_modules():
            if isinstance(module, FusedMoE):
                match = _LAYER_INDEX.search(name)
                # a FusedMoE outside a decoder layer (none today) is numbered after the others
                layer = int(match.group(1)) if match else len(self.counters) + 10_000
                self.counters[layer] = module.expert_tokens

    @property
    def is_moe(self) -> bool:
        return bool(self.counters)

    def read(self) -> ExpertLoad | None:
        """None for a dense model."""
        if not self.counters:
            return None
        layers = sorted(self.counters)
        flat = torch.cat([self.counters[layer].counts for layer in layers]).tolist()  # one device-to-host copy
        out, first = {}, 0
        for layer in layers:  # layers may differ in E
            size = self.counters[layer].num_experts
            out[layer] = tuple(flat[first:first + size])
            first += size
        return ExpertLoad(out)

    def reset(self) -> None:
        for c in self.counters.values():
            c.reset()
