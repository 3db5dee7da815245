"""Read GPU and MIG-instance state through NVML (`nvidia-ml-py`, imported as `pynvml`).

One `sample()` call returns a `DeviceSample` per GPU, and per MIG instance when MIG is on,
in the units dcgm-exporter publishes (facts.md): clocks MHz, temperatures C, power W,
energy mJ, utilization %, framebuffer MiB. NVML itself gives power in mW and memory in
bytes, converted here. A reading NVML refuses (e.g. utilization of a MIG instance, which
NVML does not report) is None and simply not exported.

`pynvml` is imported lazily and any module with its API can be passed in, which is how the
tests replay a recorded sample without a GPU.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

MiB = 1024**2


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    used_mib: float | None
    command: str

    @property
    def is_stoker(self) -> bool:
        return "stoker" in self.command


@dataclass(frozen=True)
class DeviceSample:
    gpu: int  # index of the physical GPU
    uuid: str
    pci_bus_id: str
    device: str  # "nvidia0", as dcgm-exporter labels it
    model_name: str
    hostname: str
    gpu_instance_profile: str | None = None  # "3g.40gb" on a MIG instance
    gpu_instance_id: int | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    gpu_temp_c: float | None = None
    memory_temp_c: float | None = None
    power_w: float | None = None
    energy_mj: float | None = None
    gpu_util_pct: float | None = None
    mem_copy_util_pct: float | None = None
    fb_free_mib: float | None = None
    fb_used_mib: float | None = None
    processes: tuple[ProcessSample, ...] = ()


class NvmlUnavailable(RuntimeError):
    """No NVML library or no NVIDIA GPU on this machine."""


def load_nvml(module: ModuleType | Any | None = None) -> Any:
    """Initialized NVML module; raises NvmlUnavailable with the reason when there is none."""
    if module is None:
        try:
            import pynvml as module  # nvidia-ml-py
        except ImportError as exc:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
    try:
        module.nvmlInit()
        count = module.nvmlDeviceGetCount()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NvmlUnavailable(f"NVML could not start: {exc}") from None
    if count == 0:
        raise NvmlUnavailable("NVML found no GPU")
    return module


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # NVMLError_NotSupported and friends: that reading is absent
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _processes(nvml: Any, handle: Any) -> tuple[ProcessSample, ...]:
    procs = _try(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle)) or []
    out = []
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        out.append(ProcessSample(int(p.pid), used / MiB if isinstance(used, int) else None, _command(int(p.pid))))
    return tuple(out)


def _memory(nvml: Any, handle: Any) -> tuple[float | None, float | None]:
    mem = _try(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    return (mem.free / MiB, mem.used / MiB) if mem is not None else (None, None)


def _memory_temp(nvml: Any, handle: Any) -> float | None:
    def read() -> float | None:
        (v,) = nvml.nvmlDeviceGetFieldValues(handle, [nvml.NVML_FI_DEV_MEMORY_TEMP])
        return float(v.value.uiVal) if v.nvmlReturn == 0 else None

    return _try(read)


def sample(nvml: Any) -> list[DeviceSample]:
    """One reading of every GPU (and MIG instance) NVML sees."""
    host = socket.gethostname()
    out: list[DeviceSample] = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = _text(nvml.nvmlDeviceGetUUID(h))
        bus = _text(nvml.nvmlDeviceGetPciInfo(h).busId)
        name = _text(nvml.nvmlDeviceGetName(h))
        util = _try(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        power_mw = _try(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        free, used = _memory(nvml, h)
        base = dict(gpu=i, uuid=uuid, pci_bus_id=bus, device=f"nvidia{i}", model_name=name, hostname=host)
        out.append(DeviceSample(
            **base,
            sm_clock_mhz=_try(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
            mem_clock_mhz=_try(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM)),
            gpu_temp_c=_try(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            memory_temp_c=_memory_temp(nvml, h),
            power_w=power_mw / 1000 if power_mw is not None else None,
            energy_mj=_try(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h)),
            gpu_util_pct=util.gpu if util is not None else None,
            mem_copy_util_pct=util.memory if util is not None else None,
            fb_free_mib=free, fb_used_mib=used,
            processes=_processes(nvml, h),
        ))
        out.extend(_mig_samples(nvml, h, base))
    return out


def _mig_samples(nvml: Any, handle: Any, base: dict[str, Any]) -> list[DeviceSample]:
    mode = _try(lambda: nvml.nvmlDeviceGetMigMode(handle))
    if not mode or mode[0] != 1:
        return []
    out = []
    for k in range(_try(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0):
        mh = _try(lambda: nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, k))
        if mh is None:
            continue
        # MIG device names end in the profile: "NVIDIA H100 80GB HBM3 MIG 3g.40gb".
        match = re.search(r"MIG (\S+)", _text(_try(lambda: nvml.nvmlDeviceGetName(mh)) or ""))
        free, used = _memory(nvml, mh)
        out.append(DeviceSample(
            **base,  # dcgm-exporter labels a MIG instance with its parent GPU's gpu/UUID/device
            gpu_instance_profile=match.group(1) if match else None,
            gpu_instance_id=_try(lambda: nvml.nvmlDeviceGetGpuInstanceId(mh)),
            fb_free_mib=free, fb_used_mib=used,
            processes=_processes(nvml, mh),
        ))
    return out
