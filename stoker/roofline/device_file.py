"""The device file for "this" machine: what `stoker doctor` measured, in `load_gpu_yaml`'s format.

A CPU is hardware too. `stoker doctor --write-device-file` measures this machine's matmul rate
per dtype the engine uses and its streaming-read bandwidth, and writes one YAML device entry:

    devices:
    - name: this
      bf16_tflops: 0.21        # measured torch bf16 matmul rate (the table's key field)
      fp32_tflops: 0.155       # measured float32 matmul rate: what Stoker's CPU engine runs
      memory_gb: 22.5          # physical memory, GiB
      hbm_gb_per_s: 12.3       # measured streaming read, GB/s (read bytes only, like a GEMV's weights)
      link: none
      source: "stoker doctor 2026-..., Intel(R) Xeon(R) Processor (avx512), 2 threads"
      cpu_model: ...           # the rest is read back by `load_device_file`; load_gpu_yaml ignores it
      isa: avx512
      threads: 2
      measurements: {...}      # every microbenchmark figure behind the numbers above

`get_gpu("this")` (so `stoker roofline --gpu this`) loads it from `default_path()`;
`--device-file PATH --gpu this` names another. Pure Python (no torch): roofline/ must not need it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stoker.roofline.gpu_spec import GPUSpec

THIS = "this"
ENV_VAR = "STOKER_DEVICE_FILE"  # overrides default_path(), e.g. in CI


def default_path() -> Path:
    """$STOKER_DEVICE_FILE, else $XDG_CACHE_HOME/stoker/this-device.yaml (~/.cache/... by default)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "stoker" / "this-device.yaml"


@dataclass(frozen=True)
class DeviceFile:
    """What the doctor measured on this machine. Rates are measured, never datasheet figures."""

    fp32_tflops: float  # dense float32 matmul, the best of the shapes measured
    bf16_tflops: float  # dense bf16 matmul (torch); equal to fp32 where bf16 was not measured
    read_gb_per_s: float  # streaming read of a buffer larger than the caches: the memory roof
    memory_gb: float  # physical memory, GiB
    cpu_model: str
    isa: str
    threads: int
    measured_at: str  # ISO date-time
    name: str = THIS
    measurements: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in ("fp32_tflops", "bf16_tflops", "read_gb_per_s", "memory_gb"):
            if not getattr(self, f) > 0:
                raise ValueError(f"device file: {f} must be > 0, got {getattr(self, f)!r}")
        if self.threads < 1:
            raise ValueError(f"device file: threads must be >= 1, got {self.threads}")

    @property
    def source(self) -> str:
        return f"stoker doctor {self.measured_at}: {self.cpu_model} ({self.isa}), {self.threads} threads, measured"

    def to_yaml_dict(self) -> dict[str, Any]:
        entry = {
            "name": self.name, "bf16_tflops": self.bf16_tflops, "fp32_tflops": self.fp32_tflops,
            "memory_gb": self.memory_gb, "hbm_gb_per_s": self.read_gb_per_s, "link": "none",
            "source": self.source, "cpu_model": self.cpu_model, "isa": self.isa, "threads": self.threads,
            "measured_at": self.measured_at, "measurements": self.measurements,
        }
        return {"devices": [entry]}

    @classmethod
    def from_yaml_dict(cls, data: dict[str, Any], where: str = "device file") -> DeviceFile:
        entries = data.get("devices") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{where}: expected a top-level 'devices:' list with one entry")
        e = entries[0]
        missing = [k for k in ("fp32_tflops", "hbm_gb_per_s", "memory_gb", "cpu_model", "threads") if k not in e]
        if missing:
            raise ValueError(f"{where}: not written by `stoker doctor --write-device-file` (missing {', '.join(missing)})")
        return cls(fp32_tflops=float(e["fp32_tflops"]), bf16_tflops=float(e.get("bf16_tflops", e["fp32_tflops"])),
                   read_gb_per_s=float(e["hbm_gb_per_s"]), memory_gb=float(e["memory_gb"]),
                   cpu_model=str(e["cpu_model"]), isa=str(e.get("isa", "other")), threads=int(e["threads"]),
                   measured_at=str(e.get("measured_at", "")), name=str(e.get("name", THIS)),
                   measurements=dict(e.get("measurements") or {}))


def write_device_file(device: DeviceFile, path: str | Path | None = None) -> Path:
    import yaml  # local: keep `stoker --help` light

    out = Path(path) if path else default_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(device.to_yaml_dict(), sort_keys=False))
    os.replace(tmp, out)  # atomic: a reader never sees half a file
    return out


def read_device_file(path: str | Path | None = None) -> DeviceFile:
    import yaml

    src = Path(path) if path else default_path()
    if not src.exists():
        raise ValueError(f"no device file at {src}: run `stoker doctor --device cpu --write-device-file` "
                         f"on this machine first (or set ${ENV_VAR})")
    return DeviceFile.from_yaml_dict(yaml.safe_load(src.read_text()), str(src))


def to_spec(device: DeviceFile) -> GPUSpec:
    """The device as the cost model's spec, without touching the hardware table."""
    from stoker.roofline.gpu_spec import LINKS, GPUSpec

    return GPUSpec(device.name, device.bf16_tflops, None, None, device.memory_gb, device.read_gb_per_s,
                   LINKS["none"], device.source, fp32_tflops=device.fp32_tflops)
