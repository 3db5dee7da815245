"""A device's spec and its links, as the roofline reads them: the types of the hardware table
(hardware.py) and of a measured device file (device_file.py), which both build them. [no torch]"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class Interconnect:
    """A GPU-to-GPU link. `gb_per_s` is per GPU, per direction (what nccl-tests busbw approaches)."""

    name: str
    gb_per_s: float
    kind: str  # "nvlink" | "pcie" | "network" | "none": selects NCCL's per-hop latency class
    source: str
    rdma: bool = False  # a network link that moves bytes NIC to GPU memory without the host's TCP stack

    def __post_init__(self) -> None:
        if self.kind not in ("nvlink", "pcie", "network", "none"):
            raise ValueError(f"link kind must be nvlink, pcie, network or none, not {self.kind!r}")


_FACTS = "shared/reference/facts.md"
LINKS: dict[str, Interconnect] = {
    l.name: l
    for l in (
        Interconnect("nvlink3", 300.0, "nvlink", f"A100 NVLink3 600 GB/s bidirectional ({_FACTS})"),
        Interconnect("nvlink4", 450.0, "nvlink", f"H100/H200 NVLink4 900 GB/s, 450/dir ({_FACTS})"),
        Interconnect("nvlink5", 900.0, "nvlink", f"B200 NVLink5 1800 GB/s, 900/dir ({_FACTS})"),
        Interconnect("nvlink-bridge", 300.0, "nvlink", f"H100 PCIe NVLink bridge 600 GB/s ({_FACTS})"),
        Interconnect("pcie4", 32.0, "pcie", f"PCIe Gen4 x16 ~32 GB/s/dir ({_FACTS})"),
        Interconnect("pcie5", 64.0, "pcie", f"PCIe Gen5 x16 ~64 GB/s/dir ({_FACTS})"),
        Interconnect("ib-ndr", 47.0, "network", f"InfiniBand NDR 400 Gb/s, ~46-48 GB/s measured ({_FACTS})", rdma=True),
        # RoCE at the same 400 Gb/s line rate as NDR: taken at NDR's measured rate.
        Interconnect("roce-400g", 47.0, "network", f"RoCE 400 Gb/s NIC, taken at InfiniBand NDR's ~46-48 GB/s "
                     f"measured at the same line rate ({_FACTS})", rdma=True),
        # TCP over the same NICs: Mooncake's Transfer Engine README ("Performance") moves 190 GB/s over 8 x 400 Gbps
        # RoCE, "about 4.6x faster than the TCP protocol": ~41 GB/s for 8 NICs, ~5.2 GB/s per GPU's NIC.
        Interconnect("tcp", 5.2, "network", "TCP over a 400 Gb/s NIC per GPU: 190 GB/s / 4.6 / 8 NICs, "
                     "github.com/kvcache-ai/Mooncake README, Transfer Engine performance"),
        # Two engines on one host, KV in host memory (NIXL over UCX on the loopback device: Stoker's CPU pair).
        # No published figure fits a shared VM: the rate is this project's measured in-process memory copy (the
        # ceiling of any loopback transport) of 64 MiB, beyond the 32 MiB L3 as a prompt's KV read from a cold
        # cache is: one thread, best of 21, on the 2-vCPU AMD EPYC (Zen 4) VM, 2026-11-26
        # (benchmarks/kv_transfer_cpu.py; docs/benchmarks.md, "KV transfer").
        Interconnect("loopback", 6.5, "network", "host memory copy on one machine, measured: 6.5 GB/s, torch copy of "
                     "64 MiB on one thread of a 2-vCPU AMD EPYC Zen 4 VM (benchmarks/kv_transfer_cpu.py, "
                     "docs/benchmarks.md KV transfer)"),
        Interconnect("infinity-fabric", 448.0, "nvlink", f"MI300X Infinity Fabric 896 GB/s ({_FACTS})"),
        Interconnect("none", 0.0, "none", "no GPU-GPU link (MIG slice or single device)"),
    )
}


def get_link(name: str) -> Interconnect:
    key = name.strip().lower()
    if key not in LINKS:
        raise ValueError(f"unknown interconnect {name!r}; choose one of: {', '.join(sorted(LINKS))}")
    return LINKS[key]


@dataclass(frozen=True)
class GPUSpec:
    """One device (or a MIG slice of one). TFLOP/s are dense; `fp8_tflops` is None without FP8 cores."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    int8_tops: float | None
    memory_gb: float  # GiB, see module docstring
    hbm_gb_per_s: float
    link: Interconnect
    source: str
    mig_max: int = 0  # MIG instances the device supports (0: none)
    parent: str | None = None  # set on MIG slices
    # Dense float32 matmul rate where it is known and not the bf16 one's: a CPU's measured
    # figure (`stoker doctor`), whose float32 engine runs no bf16 math. None: float32 matmuls
    # are priced at the bf16 rate, as before (GPUs' table entries; no engine runs fp32 there).
    fp32_tflops: float | None = None

    def __post_init__(self) -> None:
        for field in ("bf16_tflops", "memory_gb", "hbm_gb_per_s"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{self.name}: {field} must be > 0")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GiB

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gb_per_s * 1e9

    def peak_flops(self, compute_dtype: str = "bf16") -> float:
        """Peak dense FLOP/s for matmuls whose inputs are `compute_dtype` (bf16, fp8, int8 or fp32)."""
        if compute_dtype == "fp32" and self.fp32_tflops:
            return self.fp32_tflops * 1e12
        if compute_dtype == "fp8" and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        if compute_dtype == "int8" and self.int8_tops:
            return self.int8_tops * 1e12
        return self.bf16_tflops * 1e12

    def ridge_point(self, compute_dtype: str = "bf16") -> float:
        """FLOP per byte where the roofline turns flat: peak FLOP/s / peak HBM B/s."""
        return self.peak_flops(compute_dtype) / self.hbm_bytes_per_s
