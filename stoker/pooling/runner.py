"""Run a batch of whole sequences through a pooling model and pool each one.

The batch is packed: token ids of all sequences concatenated (T = the sum of their lengths),
positions restarting at each sequence, so every projection computes exactly the real tokens;
attention keeps sequences apart (pooling/attention.py). Called on the model's worker thread,
never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stoker.pooling.attention import VarlenBatch, varlen_batch
from stoker.pooling.config import PoolingConfig, read_pooling_config
from stoker.pooling.loader import load_pooling_model
from stoker.runner.device import resolve_device, resolve_dtype


@dataclass(frozen=True)
class PoolInput:
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # a cross-encoder's pair: 0 for the query, 1 for the document


class PoolingRunner:
    def __init__(self, model: nn.Module, config: PoolingConfig, device: torch.device) -> None:
        self.model, self.config, self.device = model, config, device

    @classmethod
    def from_folder(cls, model_dir: str | Path, dtype: str = "auto", device: str = "auto",
                    max_model_len: int | None = None) -> PoolingRunner:
        config = read_pooling_config(model_dir, max_model_len)
        dev = resolve_device(device)
        return cls(load_pooling_model(model_dir, config, resolve_dtype(dtype, dev), dev), config, dev)

    def run(self, batch: list[PoolInput]) -> np.ndarray:
        """embed: (B, hidden) float32 vectors (normalized when the model says so);
        classify: (B,) relevance scores, sigmoid of the logit (vLLM's and CrossEncoder's default)."""
        if not batch:
            raise ValueError("an empty batch")
        lengths = [len(x.token_ids) for x in batch]
        if min(lengths) < 1 or max(lengths) > self.config.max_model_len:
            raise ValueError(f"sequence lengths must be in [1, {self.config.max_model_len}], got {min(lengths)}..{max(lengths)}")
        dev = self.device
        ids = torch.tensor([t for x in batch for t in x.token_ids], dtype=torch.long, device=dev)  # (T,)
        types = torch.tensor([t for x in batch for t in (x.token_type_ids or [0] * len(x.token_ids))], dtype=torch.long,
                             device=dev)  # (T,)
        varlen = VarlenBatch.build(lengths, dev)
        positions = varlen.positions + self.config.position_offset  # (T,)
        with torch.inference_mode(), varlen_batch(varlen):
            hidden = self.model(ids, positions, types)  # (T, hidden)
            pooled = self._pool(hidden, varlen.cu_seqlens, lengths)  # (B, hidden)
            if self.config.kind == "classify":
                return torch.sigmoid(self.model.classify(pooled).float()).cpu().numpy()
            pooled = pooled.float()
            if self.config.normalize:
                pooled = F.normalize(pooled, p=2, dim=-1)
            return pooled.cpu().numpy()

    def run_rows(self, batch: list[PoolInput]) -> list[np.ndarray]:
        """`run`, one result per input (the batcher's contract): a (hidden,) vector or a () score."""
        return list(self.run(batch))

    def _pool(self, hidden: torch.Tensor, cu_seqlens: list[int], lengths: list[int]) -> torch.Tensor:
        if self.config.pooling == "cls":
            return hidden[cu_seqlens[:-1]]
        if self.config.pooling == "last":
            return hidden[[c - 1 for c in cu_seqlens[1:]]]
        # mean over each sequence's tokens: a segment sum (index_add) divided by the length, in float32
        seg = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device),
                                      torch.tensor(lengths, device=hidden.device))
        sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seg, hidden.float())
        return sums / torch.tensor(lengths, dtype=torch.float32, device=hidden.device)[:, None]
