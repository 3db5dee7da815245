"""Starting the ranks of a tensor-parallel group and joining them: env:// rendezvous.

Who starts the processes:
  * `stoker serve --tensor-parallel-size N` (or `LLM(..., tensor_parallel_size=N)`): this
    process is rank 0 (the driver: scheduler, server, rank 0's shard) and spawns the other
    ranks of its node (`spawn_workers`);
  * `--nnodes M --node-rank K --headless` on each other node: runs that node's ranks only;
  * `torchrun` or Kubernetes: every rank is started from outside with RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment (`Rendezvous.from_env`); rank 0
    serves, the others run the worker loop.
Whoever started them, every rank joins the same way: a TCPStore at MASTER_ADDR:MASTER_PORT
(hosted by rank 0, or by torchrun's agent), then `init_process_group` on it. While rank 0
waits for the others it watches the workers it spawned, so a worker that dies while loading
fails the start at once instead of after the timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger(__name__)

_JOINED_KEY = "stoker/joined"
# A worker waits for the driver's next step for as long as the driver is idle (an offline
# LLM between generate calls, a server without traffic): that wait must not time out. A
# driver that exits or crashes closes its sockets, which ends the wait at once.
_IDLE_WAIT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    local_rank: int

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """torchrun's / Kubernetes' variables, when all are set."""
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if not all(os.environ.get(n) for n in names):
            return None
        rank = int(os.environ["RANK"])
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), rank,
                   int(os.environ.get("LOCAL_RANK", rank)))

    def for_rank(self, rank: int, local_rank: int) -> Rendezvous:
        return replace(self, rank=rank, local_rank=local_rank)


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def device_backend(device: str) -> str:
    """The device group's backend: NCCL between GPUs, gloo on CPU."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "gloo"
    return "nccl"


def init_group(
    rdzv: Rendezvous, device: str, timeout_s: float, waiting: Callable[[], None] | None = None
) -> Any:
    """Join the group; returns this rank's TensorParallelGroup. `waiting` is called while rank 0
    waits for the others (it raises to give up, e.g. when a spawned worker died)."""
    import torch
    import torch.distributed as dist

    from stoker.distributed.parallel_state import TensorParallelGroup

    timeout = datetime.timedelta(seconds=timeout_s)
    backend = device_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(rdzv.local_rank)
    # torchrun's agent hosts the store itself (TORCHELASTIC_USE_AGENT_STORE), else rank 0 does.
    hosts = rdzv.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(rdzv.master_addr, rdzv.master_port, rdzv.world_size, is_master=hosts, timeout=timeout,
                          wait_for_workers=False)
    if rdzv.rank == 0:
        _wait_for_ranks(store, rdzv, timeout_s, waiting)
    else:
        store.add(_JOINED_KEY, 1)
    dist.init_process_group(backend, store=dist.PrefixStore("stoker/pg", store), rank=rdzv.rank,
                            world_size=rdzv.world_size, timeout=timeout)
    # The control group: rank 0's timeout bounds a hung worker; a worker may wait while idle.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout if rdzv.rank == 0 else _IDLE_WAIT)
    time_collectives = backend == "gloo" or os.environ.get("STOKER_TIME_COLLECTIVES") == "1"
    return TensorParallelGroup(rdzv.rank, rdzv.world_size, rdzv.local_rank, dist.group.WORLD, cpu_group, time_collectives)


def _wait_for_ranks(store: Any, rdzv: Rendezvous, timeout_s: float, waiting: Callable[[], None] | None) -> None:
    deadline = time.monotonic() + timeout_s
    next_log = time.monotonic() + 10.0
    while (joined := store.add(_JOINED_KEY, 0)) < rdzv.world_size - 1:
        if waiting is not None:
            waiting()
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(
                f"{rdzv.world_size - 1 - joined} of {rdzv.world_size - 1} tensor-parallel ranks did not join "
                f"{rdzv.master_addr}:{rdzv.master_port} within {timeout_s:.0f} s; start the other nodes with "
                "--headless and the same --master-addr / --master-port"
            )
        if now > next_log:
            logger.info("waiting for %d more tensor-parallel rank(s) at %s:%d", rdzv.world_size - 1 - joined,
                        rdzv.master_addr, rdzv.master_port)
            next_log = now + 10.0
        time.sleep(0.02)


def threads_per_rank(num_local_ranks: int) -> int:
    """CPU threads for each rank of this node: its cores shared out, at least one."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // num_local_ranks)


def spawn_workers(
    rdzv: Rendezvous, ranks: list[int], first_local_rank: int, device: str, timeout_s: float, num_threads: int,
    model_dir: str | None = None,
) -> list[subprocess.Popen]:
    """Start one worker process per rank: `python -m stoker.executor.worker`, a fresh
    interpreter (no `fork` of a process holding threads or a CUDA context, and unlike
    multiprocessing's spawn, no re-import of the caller's script, which may have no
    `if __name__ == "__main__"` guard). Each dies with its parent (PR_SET_PDEATHSIG)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(num_threads)}
    if not os.environ.get("OMP_WAIT_POLICY") and not os.environ.get("GOMP_SPINCOUNT"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"  # as the `stoker` command sets it (stoker/cpu_runtime.py)
    procs = []
    for i, rank in enumerate(ranks):
        r = rdzv.for_rank(rank, first_local_rank + i)
        argv = [sys.executable, "-m", "stoker.executor.worker", "--master-addr", r.master_addr, "--master-port",
                str(r.master_port), "--world-size", str(r.world_size), "--rank", str(r.rank), "--local-rank",
                str(r.local_rank), "--device", device, "--timeout", str(timeout_s), "--parent-pid", str(os.getpid())]
        if model_dir is not None:
            argv += ["--model", model_dir]
        procs.append(subprocess.Popen(argv, env=env))
    return procs
