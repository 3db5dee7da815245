"""What machine a benchmark ran on, for docs/benchmarks.md: the CPU model and its widest x86 ISA."""

from __future__ import annotations

import platform
from pathlib import Path


def _cpuinfo_line(prefix: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo_line("model name") or platform.processor() or platform.machine()


def isa() -> str:
    """avx512 / avx2 / other, from the CPU's flags (what the C kernels' native build can use)."""
    flags = set((_cpuinfo_line("flags") or "").split())
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
