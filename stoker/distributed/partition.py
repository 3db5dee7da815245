"""How a dimension is cut between tensor-parallel ranks (Megatron-LM's sharding). [no torch]

A `Partition` is one rank's part of a dimension of `total` elements cut into `num_parts`
equal parts. Heads and MLP columns must divide evenly (the model refuses otherwise, naming
the config field); a vocabulary need not: `padded` parts are ceil(total / num_parts) long and
the last rank's tail is zero rows (its logits are dropped after the gather).

KV heads are replicated when there are fewer of them than ranks: then the k/v projections
are cut into num_kv_heads parts and rank r holds part r * num_kv_heads // tp (vLLM's rule).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    num_parts: int = 1
    index: int = 0
    padded: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_parts:
            raise ValueError(f"part {self.index} of {self.num_parts} does not exist")

    @property
    def is_whole(self) -> bool:
        return self.num_parts == 1

    def size(self, total: int) -> int:
        """Elements this rank holds (padding included)."""
        if self.padded:
            return -(-total // self.num_parts)
        if total % self.num_parts:
            raise ValueError(f"{total} does not split into {self.num_parts} equal parts")
        return total // self.num_parts

    def range(self, total: int) -> tuple[int, int]:
        """[start, stop) of this rank's elements in the whole dimension (stop clipped to total)."""
        size = self.size(total)
        start = min(self.index * size, total)
        return start, min(start + size, total)


WHOLE = Partition()


def kv_head_partition(num_kv_heads: int, tp_size: int, rank: int) -> Partition:
    """The k/v projections' part for `rank`: split when tp <= num_kv_heads, else replicated."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads {num_kv_heads} is not divisible by tensor_parallel_size {tp_size}")
        return Partition(tp_size, rank)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} is not a multiple of num_key_value_heads {num_kv_heads} "
            "(KV heads are replicated across ranks only in equal groups)"
        )
    return Partition(num_kv_heads, rank * num_kv_heads // tp_size)
