"""Driver/CUDA versions against the installed torch, and NVML error counters (ECC, XID)."""

from __future__ import annotations

from typing import Any

from stoker.doctor.checks import CheckResult


def versions(nvml: Any | None) -> CheckResult:
    """The driver must support the CUDA version torch was built for (driver CUDA >= torch CUDA)."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if nvml is None:
        return CheckResult("versions", None, info, "no NVIDIA driver; CPU run")
    info["driver"] = _text(nvml.nvmlSystemGetDriverVersion())
    v = nvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040 for 12.4
    info["driver_cuda"] = f"{v // 1000}.{(v % 1000) // 10}"
    if torch.version.cuda is None:
        return CheckResult("versions", False, info, "torch is a CPU build on a GPU machine; install a CUDA build")
    want = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
    have = (v // 1000, (v % 1000) // 10)
    ok = have >= want and torch.cuda.is_available()
    msg = (f"driver {info['driver']} supports CUDA {info['driver_cuda']}, torch built for {torch.version.cuda}"
           + ("" if ok else "; upgrade the driver or install a torch built for an older CUDA"))
    return CheckResult("versions", ok, info, msg)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def error_counters(nvml: Any) -> dict[str, dict[str, int | None]]:
    """Per GPU: volatile uncorrected/corrected ECC counts (None where ECC is off or unsupported)."""
    out: dict[str, dict[str, int | None]] = {}
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        row: dict[str, int | None] = {}
        for key, kind in (("ecc_uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                          ("ecc_corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)):
            try:
                row[key] = int(nvml.nvmlDeviceGetTotalEccErrors(h, kind, nvml.NVML_VOLATILE_ECC))
            except Exception:
                row[key] = None
        out[str(i)] = row
    return out


def compare_counters(before: dict[str, dict[str, int | None]], after: dict[str, dict[str, int | None]]) -> CheckResult:
    """Any uncorrected ECC error appearing during the run fails. XIDs are driver events NVML only
    reports through an event loop; check `dmesg | grep -i xid` (or dcgm-exporter) for them."""
    new = {gpu: {k: (after[gpu][k] or 0) - (v or 0) for k, v in row.items() if v is not None}
           for gpu, row in before.items()}
    bad = any(d.get("ecc_uncorrected", 0) > 0 for d in new.values())
    return CheckResult("error_counters", not bad, {"before": before, "after": after, "new": new},
                       "new uncorrected ECC errors during the run" if bad else "no new uncorrected ECC errors")
