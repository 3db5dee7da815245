"""This process's place in a tensor-parallel group, and the collectives the model calls.

Two torch.distributed groups over the same ranks:
  * the device group carries the model's tensors: NCCL on CUDA, gloo on CPU (one all-reduce
    after each row-parallel projection, one after the vocab-parallel embedding, one gather
    of the LM head's logits to rank 0);
  * the CPU group (always gloo) carries the driver's step messages and small control values,
    so a message never waits behind a tensor collective or costs a device copy.

`TensorParallelGroup.single()` is the TP=1 group: every collective is the identity, so the
model code is the same at any TP. A model holds its group and calls it; nothing here is
process-global, so one process can build a TP=1 model after a TP=2 engine is shut down.

Collective timing (issue 14, "measure the collective"): every all-reduce on CPU is timed
(gloo calls block, so the wall time is the collective's, skew between ranks included); on
CUDA only when STOKER_TIME_COLLECTIVES=1, since timing needs a synchronize around each call.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CollectiveLog:
    """All-reduces since the last `take()`: how many, their sizes and the seconds spent."""

    sizes: list[int] = field(default_factory=list)  # bytes of each call
    seconds: float = 0.0

    def take(self) -> CollectiveLog:
        taken = CollectiveLog(self.sizes, self.seconds)
        self.sizes, self.seconds = [], 0.0
        return taken


class TensorParallelGroup:
    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        device_group: Any = None,
        cpu_group: Any = None,
        time_collectives: bool = False,
    ) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device_group, self.cpu_group = device_group, cpu_group
        self.time_collectives = time_collectives
        self.is_cuda = device_group is not None and dist.get_backend(device_group) == "nccl"
        self.log = CollectiveLog()
        # broadcast_object's tensors: the size (int64) and the last payload (bytes)
        self._size = torch.zeros(1, dtype=torch.int64)
        self._payload = torch.zeros(0, dtype=torch.uint8)
        # --enable-expert-parallel: the MoE layers deal their experts out over these same ranks
        # (EP = TP) instead of cutting each expert's I; set by the runner from the engine config
        # before the model is built, read by the MoE blocks (models/moe_block.moe_partitions).
        self.expert_parallel = False

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls()

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that samples and talks to the scheduler."""
        return self.rank == 0

    # ---------------------------------------------------------------- model collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (the partial sums of a row-parallel projection)."""
        if self.world_size == 1:
            return x
        if not self.time_collectives:
            dist.all_reduce(x, group=self.device_group)
            return x
        if self.is_cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        dist.all_reduce(x, group=self.device_group)
        if self.is_cuda:
            torch.cuda.synchronize(x.device)
        self.log.seconds += time.perf_counter() - start
        self.log.sizes.append(x.numel() * x.element_size())
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """(..., n) on every rank -> (..., world_size * n) on rank 0, ranks in order; None elsewhere."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    # ---------------------------------------------------------------- control (CPU group)
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank: one size, one payload broadcast over the gloo group.

        The two tensors are the group's own (`_size`, `_payload`), not temporaries as in
        torch's broadcast_object_list, so `drain` can tell when gloo's worker threads have let
        go of them: a worker drops its reference after the caller's wait returns, and dropping it
        takes the GIL, which at interpreter exit aborts the process ("terminate called without
        an active exception" in ~AsyncWork)."""
        if self.world_size == 1:
            return obj
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            self._size[0] = len(data)
            dist.broadcast(self._size, src=0, group=self.cpu_group)
            self._payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.broadcast(self._payload, src=0, group=self.cpu_group)
            return obj
        dist.broadcast(self._size, src=0, group=self.cpu_group)
        self._payload = torch.empty(int(self._size[0]), dtype=torch.uint8)
        dist.broadcast(self._payload, src=0, group=self.cpu_group)
        return pickle.loads(self._payload.numpy().tobytes())

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait (GIL released) until gloo's worker threads hold no reference to the last message's
        tensors; True if they let go within `timeout_s`. Called before the process may exit."""
        deadline = time.monotonic() + timeout_s
        while any(t._use_count() > 1 for t in (self._size, self._payload)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0, ranks in order; None elsewhere (the CPU group: small
        control values, such as each rank's finished KV transfers)."""
        if self.world_size == 1:
            return [obj]
        parts: list[Any] | None = [None] * self.world_size if self.is_first else None
        dist.gather_object(obj, parts, dst=0, group=self.cpu_group)
        return parts

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV blocks all ranks can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())
