"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stoker.layers.linear import PackableProjection, project


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        return F.embedding(input_ids, self.weight)


class LMHead(PackableProjection, nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features = hidden_size, vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.bias = None
        self.fused_silu_and_mul = False  # see layers/linear.py: pack_cpu_weights

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (num_sampled, hidden) -> (num_sampled, vocab)
        return project(self, hidden)
