"""Measure "this" machine for the roofline: `stoker doctor --write-device-file`.

The figures a device file holds (roofline/device_file.py): the best dense matmul rate per dtype
the CPU engine runs (float32: torch's matmul and the engine's own packed-panel kernel, the
faster counts as the peak; bf16 through torch, informational: the CPU engine does not use it),
the streaming-read bandwidth of a buffer larger than the caches (torch's sum and the engine's
GEMV kernel over one large weight: the faster is the roof), memory size, CPU model, ISA
and threads. Each figure is a median over repetitions; the runs behind it are kept.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

from stoker.doctor import microbench
from stoker.roofline.device_file import DeviceFile

# Read buffers of READ_MIB / 4 and READ_MIB: past the private caches and past any L3 these VMs
# see (260 MiB, shared, on the Xeon); the faster is the roof (a bound for any large stream).
READ_MIB = 1024


def _cpuinfo(prefix: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def isa() -> str:
    """avx512 / avx2 / other, from the CPU's flags (what the C kernels' native build can use)."""
    flags = set((_cpuinfo("flags") or "").split())
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"


def memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _kernel_gemm_flops(n: int, iters: int) -> float | None:
    """The engine's float32 linear kernel at M = N = K = n (None without the C kernels)."""
    import torch

    from stoker.kernels.cpu import build
    from stoker.kernels.cpu import linear as cpu_linear

    if not build.available():
        return None
    gen = torch.Generator().manual_seed(0)
    w = cpu_linear.pack_linear_weight(torch.randn(n, n, generator=gen))
    x = torch.randn(n, n, generator=gen)
    return 2 * n**3 / microbench.median_s(lambda: cpu_linear.linear(x, w, n), iters)


def measure_device(read_mib: int = READ_MIB, gemm_sizes: tuple[int, ...] = (512, 1024), iters: int = 10,
                   read_sizes_mib: tuple[int, ...] | None = None) -> DeviceFile:
    """`read_sizes_mib`: the read buffers (default: read_mib / 4 and read_mib)."""
    import torch

    m: dict[str, Any] = {"threads": torch.get_num_threads()}
    for n in gemm_sizes:
        m[f"torch_matmul_fp32_n{n}_gflops"] = microbench.matmul_flops(n, "float32", iters) / 1e9
        m[f"torch_matmul_bf16_n{n}_gflops"] = microbench.matmul_flops(n, "bfloat16", iters) / 1e9
        k = _kernel_gemm_flops(n, iters)
        if k is not None:
            m[f"stoker_linear_fp32_n{n}_gflops"] = k / 1e9
    for mib in read_sizes_mib or (read_mib // 4, read_mib):
        m[f"read_sum_{mib}mib_gb_per_s"] = microbench.stream_read_bytes_per_s(mib * 2**20, iters) / 1e9
        gemv = microbench.gemv_read_bytes_per_s(mib * 2**20, iters)
        if gemv is not None:
            m[f"read_gemv_{mib}mib_gb_per_s"] = gemv / 1e9
    fp32 = max(v for k, v in m.items() if "fp32" in k)
    bf16 = max(v for k, v in m.items() if "bf16" in k)
    m = {k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()}
    return DeviceFile(fp32_tflops=round(fp32 / 1e3, 6), bf16_tflops=round(bf16 / 1e3, 6),
                      read_gb_per_s=max(v for k, v in m.items() if k.startswith("read_")), memory_gb=round(memory_gib(), 2),
                      cpu_model=cpu_model(), isa=isa(), threads=torch.get_num_threads(),
                      measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), measurements=m)


def quick_cpu_device() -> DeviceFile:
    """A start-up estimate of this CPU's two roofs, for a default that needs only their ratio
    (the batcher's preferred batch, pooling/batch_defaults.py): n = 512 matmuls (torch's and the
    engine's kernel) and one 256 MiB read (not the doctor's quarter-size buffer too, which stays
    partly in these VMs' shared L3 and reads faster than memory). 20 repetitions: with 5, the
    first GEMMs of a fresh process put the peak at 201-291 GFLOP/s in three server starts on a
    2-core Xeon VM, with 20 at 285-294 in 0.7-0.8 s, where the doctor measured 320
    (docs/benchmarks.md, "The batcher's preferred batch on a CPU"). `stoker doctor --write-device-file` measures
    more shapes and larger buffers."""
    return measure_device(gemm_sizes=(512,), iters=20, read_sizes_mib=(256,))
