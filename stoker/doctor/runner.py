"""Run every `stoker doctor` check and build the JSON report."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.doctor.checks import CheckResult, against_spec


@dataclass(frozen=True)
class DoctorConfig:
    device: str = "auto"  # auto | cpu | cuda
    gemm_size: int = 4096
    gemm_iters: int = 10
    bandwidth_mib: int = 1024
    bandwidth_iters: int = 10
    allreduce_mib: int = 64
    allreduce_iters: int = 10
    world_size: int = 0  # 0: all local GPUs, or 2 processes on CPU
    soak_seconds: float = 60.0
    soak_size: int = 1024


def _gpu_spec(torch_name: str) -> Any:
    """The hardware table's entry for this device ("NVIDIA H200" -> H200), or None."""
    from stoker.roofline.hardware import gpu_from_device_name

    return gpu_from_device_name(torch_name)


def _nvml() -> Any | None:
    from stoker.telemetry.nvml import NvmlUnavailable, load_nvml

    try:
        return load_nvml()
    except NvmlUnavailable:
        return None


def run_doctor(cfg: DoctorConfig) -> dict[str, Any]:
    import torch

    from stoker.doctor import collectives, compute, health

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_gpu = device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    nvml = _nvml() if on_gpu else None
    spec = _gpu_spec(torch.cuda.get_device_name(0)) if on_gpu else None
    dtype = "bfloat16" if on_gpu else "float32"
    checks: list[CheckResult] = [health.versions(nvml)]
    counters_before = health.error_counters(nvml) if nvml else None
    started = time.time()

    g = compute.gemm_flops(device, cfg.gemm_size, cfg.gemm_iters, dtype)
    checks.append(against_spec("gemm", g["flops"] / 1e12 if on_gpu else g["flops"] / 1e9,
                               "TFLOP/s" if on_gpu else "GFLOP/s",
                               spec.bf16_tflops if spec else None, g))
    b = compute.copy_bandwidth(device, cfg.bandwidth_mib * 2**20, cfg.bandwidth_iters)
    checks.append(against_spec("memory_bandwidth", b["bytes_per_s"] / 1e9, "GB/s",
                               spec.hbm_gb_per_s if spec else None, b))

    world = cfg.world_size or (torch.cuda.device_count() if on_gpu else 2)
    if world >= 2:
        a = collectives.allreduce_busbw(world, cfg.allreduce_mib * 2**20, cfg.allreduce_iters,
                                        "nccl" if on_gpu else "gloo")
        link = spec.link.gb_per_s if spec and spec.link.kind != "none" else None
        res = against_spec("allreduce", a["busbw_bytes_per_s"] / 1e9, "busbw GB/s", link, a)
        if not a["correct"]:
            res = CheckResult("allreduce", False, res.measured, "all-reduce returned a wrong sum")
        checks.append(res)
    else:
        checks.append(CheckResult("allreduce", None, {"world_size": world}, "one device: nothing to all-reduce"))

    s = compute.soak(device, cfg.soak_size, cfg.soak_seconds, dtype)
    checks.append(CheckResult("soak", s["mismatches"] == 0, s,
                              f"{s['iterations']} iterations, {s['mismatches']} bit mismatches"))
    if nvml is not None and counters_before is not None:
        checks.append(health.compare_counters(counters_before, health.error_counters(nvml)))

    return {
        "device": torch.cuda.get_device_name(0) if on_gpu else f"cpu ({platform.processor() or platform.machine()})",
        "hardware_spec": spec.name if spec else None,
        "started_unix": started,
        "duration_s": round(time.time() - started, 3),
        "config": cfg.__dict__,
        "passed": all(c.passed is not False for c in checks),
        "checks": [c.to_dict() for c in checks],
    }


def write_report(report: dict[str, Any], path: str | Path) -> None:
    from stoker.fleet.manifests import write_atomic

    write_atomic(Path(path), json.dumps(report, indent=2, default=str) + "\n")
