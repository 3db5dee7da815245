"""What machine a benchmark ran on, for docs/benchmarks.md: the CPU model and its widest x86 ISA
(the same reading `stoker doctor` writes into the device file)."""

from __future__ import annotations

from stoker.doctor.device import cpu_model, isa

__all__ = ["cpu_model", "isa"]
