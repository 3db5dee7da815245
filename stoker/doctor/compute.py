"""Single-device checks: GEMM throughput, device-memory bandwidth, and a bit-exact soak.

torch is imported inside each function so `stoker --help` stays instant.
"""

from __future__ import annotations

import time
from typing import Any


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def gemm_flops(device: str, n: int, iters: int, dtype_name: str) -> dict[str, Any]:
    """Dense n x n x n matmul: FLOP/s = 2 n^3 / time per matmul."""
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    for _ in range(2):  # warm up (kernel selection, caches)
        torch.matmul(a, b)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    _sync(device)
    dt = (time.perf_counter() - t0) / iters
    return {"n": n, "dtype": dtype_name, "iters": iters, "seconds_per_matmul": dt, "flops": 2 * n**3 / dt}


def copy_bandwidth(device: str, num_bytes: int, iters: int) -> dict[str, Any]:
    """Device-to-device copy; bytes moved = read + write = 2 x size (as facts.md counts it)."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    dt = (time.perf_counter() - t0) / iters
    return {"bytes": src.numel() * 4, "iters": iters, "seconds_per_copy": dt,
            "bytes_per_s": 2 * src.numel() * 4 / dt}


def soak(device: str, n: int, seconds: float, dtype_name: str) -> dict[str, Any]:
    """Repeat one fixed computation for `seconds` and compare every result bit for bit with the
    first: the same inputs on the same device must give the same bits, so a mismatch is silent
    data corruption (or a non-deterministic kernel, which this fixed matmul chain does not use)."""
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    a = (torch.randn(n, n, generator=gen) / n**0.5).to(device=device, dtype=dtype)

    def step() -> Any:
        x = a
        for _ in range(4):
            x = torch.tanh(x @ a)
        return x

    reference = step()
    _sync(device)
    iterations = mismatches = 0
    first_bad: int | None = None
    deadline = time.perf_counter() + seconds
    while iterations == 0 or time.perf_counter() < deadline:
        out = step()
        iterations += 1
        if not torch.equal(out, reference):
            mismatches += 1
            first_bad = iterations if first_bad is None else first_bad
    _sync(device)
    return {"n": n, "dtype": dtype_name, "seconds": seconds, "iterations": iterations,
            "mismatches": mismatches, "first_mismatch_iteration": first_bad}
