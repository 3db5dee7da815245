"""GPU models a fleet can hold: memory size, MIG capability, and the roofline table's name.

Memory sizes are the datasheet figures in shared/reference/facts.md, counted in GiB as
stoker.roofline.hardware does (nvidia-smi reports 81559 MiB for an "80 GB" H100). A MIG
instance's capacity is counted as mem_slices / 8 of that; the usable figure `nvidia-smi
mig -lgip` prints is a little lower (9.75 GiB for 1g.10gb), which sizing covers through
its `gpu_memory_utilization` headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.fleet import mig

GiB = 1024**3


@dataclass(frozen=True)
class GpuModel:
    name: str  # canonical fleet name, e.g. "H100-80GB"
    memory_bytes: int
    is_mig_capable: bool
    roofline_name: str  # key for stoker.roofline.hardware.get_gpu

    def profiles(self) -> tuple[mig.MigProfile, ...]:
        return mig.profiles(self.name) if self.is_mig_capable else ()

    def profile_memory_bytes(self, profile: mig.MigProfile) -> int:
        return self.memory_bytes * profile.mem_slices // mig.NUM_MEM_SLICES


GPU_MODELS: dict[str, GpuModel] = {
    m.name: m
    for m in (
        GpuModel("A100-40GB", 40 * GiB, True, "A100-40GB"),
        GpuModel("A100-80GB", 80 * GiB, True, "A100-80GB"),
        GpuModel("H100-80GB", 80 * GiB, True, "H100-SXM"),
        GpuModel("H200-141GB", 141 * GiB, True, "H200"),
        GpuModel("L40S", 48 * GiB, False, "L40S"),
        GpuModel("L4", 24 * GiB, False, "L4"),
    )
}

# Names people write in fleet files, normalized (upper case, no spaces/underscores).
_ALIASES: dict[str, str] = {
    "A100": "A100-80GB", "A10040GB": "A100-40GB", "A100SXM440GB": "A100-40GB",
    "A10080GB": "A100-80GB", "A100SXM480GB": "A100-80GB",
    "H100": "H100-80GB", "H10080GB": "H100-80GB", "H100SXM": "H100-80GB", "H100SXM580GB": "H100-80GB",
    "H200": "H200-141GB", "H200141GB": "H200-141GB", "H200SXM": "H200-141GB",
    "L40S": "L40S", "L4": "L4",
}


def get_gpu_model(name: str) -> GpuModel:
    """Look a fleet GPU model up by canonical name or a common alias ("H100", "A100-40GB")."""
    if name in GPU_MODELS:
        return GPU_MODELS[name]
    key = "".join(ch for ch in name.upper() if ch.isalnum())
    if key in _ALIASES:
        return GPU_MODELS[_ALIASES[key]]
    raise ValueError(f"unknown GPU model {name!r}; use one of {', '.join(GPU_MODELS)}")
