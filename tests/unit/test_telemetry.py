"""Exporter and `stoker top` from a recorded NVML sample (a fake pynvml), no GPU needed."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stoker.cli import main
from stoker.telemetry.exporter import METRICS, register_gpu_collector
from stoker.telemetry.nvml import sample
from stoker.telemetry.top import render_table

MiB = 1024**2


class NVMLError(Exception):
    pass


class FakeNvml:
    """Replays one recorded reading: GPU 0 an H100 in MIG mode with two instances, GPU 1 whole."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU, NVML_FI_DEV_MEMORY_TEMP = 1, 2, 0, 82
    NVMLError = NVMLError
    GPUS = [
        dict(uuid="GPU-aaaa", bus="00000000:18:00.0", name="NVIDIA H100 80GB HBM3", mig=True,
             sm=1980, mem=2619, temp=41, mtemp=39, power_mw=121345, energy=987654321, util=(0, 0),
             free=81000 * MiB, used=559 * MiB),
        dict(uuid="GPU-bbbb", bus="00000000:2A:00.0", name="NVIDIA H100 80GB HBM3", mig=False,
             sm=1755, mem=2619, temp=55, mtemp=48, power_mw=402000, energy=123456789, util=(97, 63),
             free=2000 * MiB, used=79559 * MiB),
    ]
    MIGS = [("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 1, 40000 * MiB, 500 * MiB),
            ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 9, 9000 * MiB, 800 * MiB)]

    def nvmlInit(self): pass
    def nvmlDeviceGetCount(self): return len(self.GPUS)
    def nvmlDeviceGetHandleByIndex(self, i): return ("gpu", i)
    def _g(self, h): return self.GPUS[h[1]]
    def nvmlDeviceGetUUID(self, h): return self._g(h)["uuid"]
    def nvmlDeviceGetPciInfo(self, h): return SimpleNamespace(busId=self._g(h)["bus"].encode())
    def nvmlDeviceGetName(self, h): return self.MIGS[h[2]][0] if h[0] == "mig" else self._g(h)["name"]
    def nvmlDeviceGetClockInfo(self, h, kind): return self._g(h)["sm" if kind == 1 else "mem"]
    def nvmlDeviceGetTemperature(self, h, kind): return self._g(h)["temp"]
    def nvmlDeviceGetFieldValues(self, h, ids):
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=self._g(h)["mtemp"]))]
    def nvmlDeviceGetPowerUsage(self, h): return self._g(h)["power_mw"]
    def nvmlDeviceGetTotalEnergyConsumption(self, h): return self._g(h)["energy"]
    def nvmlDeviceGetUtilizationRates(self, h):
        g, m = self._g(h)["util"]
        return SimpleNamespace(gpu=g, memory=m)
    def nvmlDeviceGetMemoryInfo(self, h):
        if h[0] == "mig":
            _, _, free, used = self.MIGS[h[2]]
            return SimpleNamespace(free=free, used=used, total=free + used)
        g = self._g(h)
        return SimpleNamespace(free=g["free"], used=g["used"], total=g["free"] + g["used"])
    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if h == ("gpu", 1):
            return [SimpleNamespace(pid=999999, usedGpuMemory=79000 * MiB)]
        raise NVMLError("Not Supported")
    def nvmlDeviceGetMigMode(self, h): return (1, 1) if self._g(h)["mig"] else (0, 0)
    def nvmlDeviceGetMaxMigDeviceCount(self, h): return 7
    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, k):
        if k >= len(self.MIGS):
            raise NVMLError("Not Found")
        return ("mig", h[1], k)
    def nvmlDeviceGetGpuInstanceId(self, h): return self.MIGS[h[2]][1]


def test_sample_units():
    samples = sample(FakeNvml())
    assert len(samples) == 4  # two GPUs and two MIG instances
    whole = samples[-1]
    assert whole.power_w == 402.0 and whole.fb_used_mib == 79559 and whole.gpu_util_pct == 97
    mig = [s for s in samples if s.gpu_instance_profile]
    assert [(s.gpu_instance_profile, s.gpu_instance_id) for s in mig] == [("3g.40gb", 1), ("1g.10gb", 9)]
    assert mig[0].gpu_util_pct is None  # NVML gives no per-instance utilization; not invented


def test_exporter_output_parses_with_dcgm_names_and_labels():
    registry = CollectorRegistry()
    assert register_gpu_collector(registry, nvml=FakeNvml()) is True
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {name for name, *_ in METRICS}
    base = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"}
    for f in families.values():
        for s in f.samples:
            assert base <= set(s.labels)
    assert families["DCGM_FI_DEV_GPU_TEMP"].type == "gauge"
    power = {s.labels["gpu"]: s.value for s in families["DCGM_FI_DEV_POWER_USAGE"].samples}
    assert power == {"0": 121.345, "1": 402.0}
    fb = [s for s in families["DCGM_FI_DEV_FB_USED"].samples if "GPU_I_PROFILE" in s.labels]
    assert {(s.labels["GPU_I_PROFILE"], s.labels["GPU_I_ID"], s.value) for s in fb} == {
        ("3g.40gb", "1", 500.0), ("1g.10gb", "9", 800.0)}
    assert all(s.labels["UUID"] == "GPU-aaaa" and s.labels["device"] == "nvidia0" for s in fb)
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text  # exact name, no _total suffix


def test_register_without_gpu_registers_nothing():
    class NoGpu:
        def nvmlInit(self):
            raise NVMLError("NVML Shared Library Not Found")

    registry = CollectorRegistry()
    assert register_gpu_collector(registry, nvml=NoGpu()) is False
    assert generate_latest(registry) == b""


def test_top_table_renders():
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(render_table(sample(FakeNvml())))
    out = console.export_text()
    assert "3g.40gb (GI 1)" in out and "402.0 W" in out and "79559 / 81559 MiB" in out


def test_cli_without_gpu_exits_cleanly(capsys, monkeypatch):
    import stoker.telemetry.nvml as nvml_mod
    from stoker.telemetry.nvml import NvmlUnavailable

    def no_gpu(module=None):
        raise NvmlUnavailable("NVML Shared Library Not Found")

    monkeypatch.setattr(nvml_mod, "load_nvml", no_gpu)
    assert main(["top", "--once"]) == 0
    assert "no NVIDIA GPU" in capsys.readouterr().err
    import stoker.telemetry.exporter as exp
    monkeypatch.setattr(exp, "load_nvml", no_gpu)
    assert main(["telemetry", "--port", "0"]) == 0
    assert "no NVIDIA GPU" in capsys.readouterr().err
