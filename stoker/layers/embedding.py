"""Token embedding and the LM head (which may share the embedding's weight), vocabulary-parallel.

With tensor parallelism each rank holds ceil(vocab / tp) rows of the vocabulary (the last
rank's tail padded with zero rows). The embedding looks up the ids in its rows, writes zeros
for the others and all-reduces: every rank ends with the full (T, hidden). The LM head
computes its rows' logits and gathers them on rank 0 (the rank that samples), which drops
the padding: (S, vocab) there, None on the other ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import Partition
from stoker.layers.linear import Linear


def vocab_partition(tp: TensorParallelGroup) -> Partition:
    return Partition(tp.world_size, tp.rank, padded=True)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallelGroup.single()
        self.vocab_size = vocab_size
        self.part = vocab_partition(self.tp)
        self.start, self.stop = self.part.range(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.part.size(vocab_size), hidden_size))

    def checkpoint_slice(self, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """This rank's vocabulary rows of the checkpoint's (vocab, hidden) embedding; None: all."""
        if tuple(shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"shape mismatch: checkpoint {tuple(shape)}, expected {(self.vocab_size, self.weight.shape[1])}")
        return None if self.tp.world_size == 1 else (slice(self.start, self.stop),)

    def load(self, tensor: torch.Tensor) -> None:
        """This rank's (<= rows, hidden) slice of the checkpoint's embedding; padding rows zeroed."""
        expected = (self.stop - self.start, self.weight.shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shape mismatch: checkpoint rows [{self.start}, {self.stop}) give {tuple(tensor.shape)}, expected {expected}")
        with torch.no_grad():
            self.weight[: expected[0]].copy_(tensor)
            self.weight[expected[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(hidden)


class LMHead(Linear):
    """(num_sampled, hidden) -> (num_sampled, vocab). Not quantized (vLLM and the FP8/INT8
    checkpoints keep it in the model dtype) except from a GGUF file, whose output tensor is; tied to the embedding when the config says so,
    which its method (TiedMethod) honours: both hold the same vocabulary rows on each rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup | None = None) -> None:
        tp = tp or TensorParallelGroup.single()
        super().__init__(hidden_size, vocab_size, bias=False, out_split=vocab_partition(tp))
        self.vocab_size = vocab_size
        self.tp = tp
        # Kept out of the module tree (a plain attribute, not a submodule): the embedding's
        # weight must not appear twice among the parameters the loader fills.
        self.__dict__["tied_embedding"] = None

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.__dict__["tied_embedding"] = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0; None on the other ranks."""
        logits = self.tp.gather_to_first(super().forward(x))  # (S, tp * rows)
        return None if logits is None else logits[..., : self.vocab_size]
