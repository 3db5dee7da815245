"""All-reduce bus bandwidth through torch.distributed, one process per device.

nccl-tests' definitions (facts.md): algbw = S / t, busbw = algbw x 2(n-1)/n for all-reduce,
where S is the buffer size in bytes and t the time of one all-reduce. On CPU the backend is
gloo between `world_size` local processes; on GPUs NCCL across all local GPUs.
"""

from __future__ import annotations

import socket
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, num_bytes: int, iters: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        x = torch.full((num_bytes // 4,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up, and the correctness check: sum of 1..world
        expected = world * (world + 1) / 2
        correct = bool(torch.all(x == expected).item())
        dist.barrier()
        if backend == "nccl":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if backend == "nccl":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        queue.put((rank, dt, correct))
    finally:
        dist.destroy_process_group()


def allreduce_busbw(world_size: int, num_bytes: int, iters: int, backend: str, timeout_s: float = 120.0
                    ) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, num_bytes, iters, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(queue.get(timeout=timeout_s))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    dt = max(r[1] for r in results)  # the collective ends when the slowest rank does
    size = (num_bytes // 4) * 4
    algbw = size / dt
    busbw = algbw * 2 * (world_size - 1) / world_size
    return {"backend": backend, "world_size": world_size, "bytes": size, "iters": iters,
            "seconds_per_allreduce": dt, "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": busbw,
            "correct": all(r[2] for r in results)}
