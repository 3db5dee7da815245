"""Tokens routed to each expert of one MoE layer, counted on the layer's device.

`FusedMoE.forward` records every step's (token, choice) pairs here. The count stays on the
device (an `index_add_` of ones: no host sync, unlike `torch.bincount` on CUDA, which reads
its input's maximum back to size the result); the engine copies it to the host only when
asked (the periodic log line, a /metrics scrape), never per step.

The router is replicated on every rank, so every rank counts the same pairs, expert
parallelism or not: rank 0's counts are the whole model's.
"""

from __future__ import annotations

import torch


class ExpertTokenCounter:
    def __init__(self, num_experts: int, device: torch.device | None = None) -> None:
        self.num_experts = num_experts
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=device)  # (E,) since start (or reset)

    def record(self, topk_ids: torch.Tensor) -> None:  # (T, k) global expert ids
        flat = topk_ids.reshape(-1)
        if flat.numel():
            self.counts.index_add_(0, flat.to(self.counts.device), torch.ones_like(flat, dtype=torch.int64))

    def read(self) -> list[int]:
        """The counts on the host (one device-to-host copy)."""
        return self.counts.tolist()

    def reset(self) -> None:
        """Forget what was counted (after the memory profile's dummy forward)."""
        self.counts.zero_()
