"""Prometheus exporter with dcgm-exporter's metric names, units and labels (facts.md).

Exported from NVML: DCGM_FI_DEV_SM_CLOCK, DCGM_FI_DEV_MEM_CLOCK (MHz), DCGM_FI_DEV_GPU_TEMP,
DCGM_FI_DEV_MEMORY_TEMP (C), DCGM_FI_DEV_POWER_USAGE (W), DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION
(mJ, monotonic), DCGM_FI_DEV_GPU_UTIL, DCGM_FI_DEV_MEM_COPY_UTIL (%), DCGM_FI_DEV_FB_FREE,
DCGM_FI_DEV_FB_USED (MiB). Labels: gpu, UUID, pci_bus_id, device, modelName, Hostname, plus
GPU_I_PROFILE and GPU_I_ID on MIG instances.

Not exported: DCGM_FI_PROF_* (GR engine, DRAM, tensor pipe activity) need DCGM's profiling
module, and DCGM_FI_DEV_XID_ERRORS needs an NVML event loop; run dcgm-exporter for those.

`register_gpu_collector(registry)` is what `stoker serve` calls to add these gauges to its own
/metrics; `serve_exporter(port)` is `stoker telemetry`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from stoker.telemetry.nvml import DeviceSample, NvmlUnavailable, load_nvml, sample

# (name, sample attribute, type, help) in dcgm-exporter's default-counters.csv order.
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "sm_clock_mhz", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "mem_clock_mhz", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "memory_temp_c", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gpu_temp_c", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "power_w", "gauge", "Power draw (in W)."),
    # dcgm-exporter types this a counter; prometheus_client renames counters' TYPE lines to
    # `<name>_total`, so it goes out as a gauge to keep the exact name (rate() works on both).
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_mj", "gauge",
     "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_GPU_UTIL", "gpu_util_pct", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "mem_copy_util_pct", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_FREE", "fb_free_mib", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "fb_used_mib", "gauge", "Framebuffer memory used (in MiB)."),
)


def labels_for(s: DeviceSample) -> dict[str, str]:
    labels = {"gpu": str(s.gpu), "UUID": s.uuid, "pci_bus_id": s.pci_bus_id, "device": s.device,
              "modelName": s.model_name, "Hostname": s.hostname}
    if s.gpu_instance_profile is not None:
        labels["GPU_I_PROFILE"] = s.gpu_instance_profile
        labels["GPU_I_ID"] = str(s.gpu_instance_id)
    return labels


class GpuCollector:
    """A prometheus_client collector that reads NVML on every scrape."""

    def __init__(self, nvml: Any):
        self._nvml = nvml

    def describe(self) -> list[Metric]:
        return []  # no NVML reads at registration time

    def collect(self) -> Iterator[Metric]:
        samples = sample(self._nvml)
        for name, attr, kind, doc in METRICS:
            family = Metric(name, doc, kind)
            for s in samples:
                value = getattr(s, attr)
                if value is not None:
                    family.add_sample(name, labels_for(s), float(value))
            if family.samples:
                yield family


def register_gpu_collector(registry: Any, nvml: Any | None = None) -> bool:
    """Add GPU gauges to `registry`. Returns False (registering nothing) without NVML or a GPU."""
    try:
        module = load_nvml(nvml)
    except NvmlUnavailable:
        return False
    registry.register(GpuCollector(module))
    return True


def serve_exporter(port: int = 9400, host: str = "0.0.0.0", nvml: Any | None = None) -> Any:
    """Start the HTTP exporter in a background thread; raises NvmlUnavailable without a GPU."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(GpuCollector(load_nvml(nvml)))
    return start_http_server(port, addr=host, registry=registry)
