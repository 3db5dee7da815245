"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stoker.layers.linear import Linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        return F.embedding(input_ids, self.weight)


class LMHead(Linear):
    """(num_sampled, hidden) -> (num_sampled, vocab). Never quantized (vLLM and the FP8/INT8
    checkpoints keep it in the model dtype); tied to the embedding when the config says so,
    which its method (TiedMethod) honours."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        # Kept out of the module tree (a plain attribute, not a submodule): the embedding's
        # weight must not appear twice among the parameters the loader fills.
        self.__dict__["tied_embedding"] = None

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.__dict__["tied_embedding"] = embedding
