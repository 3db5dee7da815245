"""Which experts a rank holds under expert parallelism (vLLM's `--enable-expert-parallel`). [no torch]

Expert parallelism here uses the tensor-parallel group itself (EP = TP): attention and the
dense layers stay cut as under tensor parallelism, and each MoE layer's experts are dealt out
whole (not cut along I) over the same ranks. Rank r holds a contiguous run of experts; when
the ranks do not divide E, the first E % N ranks hold one more (vLLM's "linear" placement),
so E = 60 over 8 ranks gives four ranks 8 experts and four ranks 7.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPartition:
    """Rank `index` of `num_parts`' experts: [start, stop) of `num_experts` in all."""

    num_experts: int
    num_parts: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_parts:
            raise ValueError(f"part {self.index} of {self.num_parts} does not exist")
        if self.num_parts > self.num_experts:
            # A rank without experts would hold nothing yet still join every all-reduce;
            # refused rather than silently wasting the rank.
            raise ValueError(f"expert parallelism over {self.num_parts} ranks needs at least as many experts; "
                             f"the model has {self.num_experts} (--enable-expert-parallel with --tensor-parallel-size "
                             f"{self.num_parts})")

    @property
    def is_whole(self) -> bool:
        return self.num_parts == 1

    @property
    def start(self) -> int:
        base, extra = divmod(self.num_experts, self.num_parts)
        return self.index * base + min(self.index, extra)

    @property
    def size(self) -> int:
        base, extra = divmod(self.num_experts, self.num_parts)
        return base + (1 if self.index < extra else 0)

    @property
    def stop(self) -> int:
        return self.start + self.size

    def holds(self, expert: int) -> bool:
        return self.start <= expert < self.stop

    def local(self, expert: int) -> int:
        """The index of global expert `expert` in this rank's stacked weights."""
        if not self.holds(expert):
            raise ValueError(f"expert {expert} is not held by rank {self.index} (it holds [{self.start}, {self.stop}))")
        return expert - self.start


def whole_experts(num_experts: int) -> ExpertPartition:
    """Every expert on this rank (no expert parallelism)."""
    return ExpertPartition(num_experts)
