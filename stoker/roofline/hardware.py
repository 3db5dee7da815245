"""Accelerator spec table: peak FLOP/s, memory, HBM bandwidth and links, each with its source.

Figures are *dense* datasheet numbers (datasheets print the 2:4-sparse ones at 2x), copied from
`shared/reference/facts.md`, which cites NVIDIA's datasheets (H100, H200, A100, L40S, L4, B200),
NVIDIA aiconfigurator system files and AMD's MI300X data sheet.

Entry points:
    get_gpu("h100-sxm") / get_gpu("H100:3g.40gb")  -> GPUSpec   (case-insensitive, aliases, MIG)
    list_gpus()                                     -> list[str]
    load_gpu_yaml("my_devices.yaml")               -> list[GPUSpec] (registered for get_gpu)
    get_gpu("this")                                 -> this machine, from the device file `stoker doctor
                                                       --write-device-file` wrote (roofline/device_file.py)
    get_link("nvlink4")                             -> Interconnect

Memory sizes: the datasheet "80 GB" of an H100 is 80 GiB of HBM (nvidia-smi reports 81559 MiB), so
`memory_bytes` counts `memory_gb` in GiB; weights and KV are also reported in GiB by `memory.py`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from stoker.roofline.gpu_spec import _FACTS, LINKS, GiB, GPUSpec, Interconnect, get_link  # noqa: F401 (the table's types)

_DS = "NVIDIA datasheet via " + _FACTS
_GPUS: dict[str, GPUSpec] = {}
_ALIASES: dict[str, str] = {}


def register_gpu(spec: GPUSpec, aliases: tuple[str, ...] = ()) -> GPUSpec:
    _GPUS[spec.name.lower()] = spec
    for alias in (spec.name, *aliases):
        _ALIASES[_norm(alias)] = spec.name.lower()
    return spec


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.strip().lower())


for _spec, _aliases in (
    (GPUSpec("H100-SXM", 989, 1979, 1979, 80, 3350, LINKS["nvlink4"], _DS, 7), ("h100", "h100-80gb", "h100-sxm5")),
    (GPUSpec("H100-PCIe", 756, 1513, 1513, 80, 2000, LINKS["nvlink-bridge"], _DS, 7), ()),
    (GPUSpec("H200", 989, 1979, 1979, 141, 4800, LINKS["nvlink4"], _DS, 7), ("h200-sxm", "h200-141gb")),
    (GPUSpec("A100-40GB", 312, None, 624, 40, 1555, LINKS["nvlink3"], _DS, 7), ("a100-40gb-sxm",)),
    (GPUSpec("A100-80GB", 312, None, 624, 80, 2039, LINKS["nvlink3"], _DS, 7), ("a100", "a100-80gb-sxm")),
    (GPUSpec("L40S", 362, 733, 733, 48, 864, LINKS["pcie4"], _DS), ()),
    (GPUSpec("L4", 121, 242, 242, 24, 300, LINKS["pcie4"], _DS), ()),
    (GPUSpec("RTX-4090", 165, 330, 661, 24, 1008, LINKS["pcie4"], "NVIDIA Ada whitepaper via " + _FACTS), ("4090",)),
    # B200 HBM is 7.7-8.0 TB/s depending on SKU; take the lower figure so ceilings stay honest.
    (GPUSpec("B200", 2250, 4500, 4500, 180, 7700, LINKS["nvlink5"], _DS + " (1 kW SKU)", 7), ()),
    (GPUSpec("MI300X", 1307, 2615, 2615, 192, 5300, LINKS["infinity-fabric"], "AMD MI300X data sheet via " + _FACTS), ()),
):
    register_gpu(_spec, _aliases)

# MIG geometry shared by A100/H100/H200 (NVIDIA MIG user guide via facts.md): 7 SM slices and
# 8 memory slices; (SM slices, memory slices) pairs that exist as profiles.
_MIG_SHAPES = {(1, 1), (1, 2), (2, 2), (3, 4), (4, 4), (7, 8)}
_MIG_RE = re.compile(r"^(\d)g\.(\d+)gb(\+me)?$")


def _mig_slice(parent: GPUSpec, profile: str) -> GPUSpec:
    """A MIG instance as a smaller device: SM share of FLOP/s, memory-slice share of HBM and BW."""
    match = _MIG_RE.match(profile.strip().lower())
    if parent.mig_max == 0:
        mig_gpus = sorted(s.name for s in _GPUS.values() if s.mig_max and s.parent is None)
        raise ValueError(f"{parent.name} has no MIG; MIG devices are: {', '.join(mig_gpus)}")
    slice_gb = parent.memory_gb / 8
    valid = sorted(f"{sm}g.{round(mem * slice_gb)}gb" for sm, mem in _MIG_SHAPES)
    if match is None:
        raise ValueError(f"bad MIG profile {profile!r} for {parent.name}; valid: {', '.join(valid)}")
    sm_slices, gb = int(match.group(1)), int(match.group(2))
    mem_slices = max(1, round(gb / slice_gb))
    if (sm_slices, mem_slices) not in _MIG_SHAPES or abs(gb - mem_slices * slice_gb) > 0.15 * slice_gb * mem_slices + 1:
        raise ValueError(f"no MIG profile {profile!r} on {parent.name}; valid: {', '.join(valid)}")
    sm_share, mem_share = sm_slices / 7, mem_slices / 8
    scale = lambda x: None if x is None else x * sm_share  # noqa: E731
    return dataclasses.replace(
        parent,
        name=f"{parent.name}:{profile.lower()}",
        bf16_tflops=parent.bf16_tflops * sm_share,
        fp8_tflops=scale(parent.fp8_tflops),
        int8_tops=scale(parent.int8_tops),
        memory_gb=gb,
        hbm_gb_per_s=parent.hbm_gb_per_s * mem_share,
        link=LINKS["none"],  # MIG instances get no NVLink peer access
        source=f"{parent.source}; MIG share {sm_slices}/7 SMs, {mem_slices}/8 memory slices",
        mig_max=0,
        parent=parent.name,
    )


def get_gpu(name: str) -> GPUSpec:
    """Look up a device by case-insensitive name or alias; "H100:3g.40gb" gives a MIG slice."""
    base, _, profile = name.partition(":")
    key = _ALIASES.get(_norm(base))
    if key is None and _norm(base) == "this":
        key = _ALIASES.get(_norm(load_this_device().name))
    if key is None:
        raise ValueError(f"unknown GPU {name!r}; choose one of: {', '.join(list_gpus())} "
                         "(or a MIG slice like H100:3g.40gb, or add one with a YAML device file)")
    spec = _GPUS[key]
    return _mig_slice(spec, profile) if profile else spec


def list_gpus() -> list[str]:
    return sorted(spec.name for spec in _GPUS.values())


def load_gpu_yaml(path: str | Path) -> list[GPUSpec]:
    """Register devices from a YAML file (format in docs/roofline.md); returns what it added."""
    import yaml  # local: keep `stoker --help` light

    data = yaml.safe_load(Path(path).read_text())
    entries = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a top-level 'devices:' list")
    required = ("name", "bf16_tflops", "memory_gb", "hbm_gb_per_s", "source")
    added = []
    for i, entry in enumerate(entries):
        missing = [k for k in required if k not in entry]
        if missing:
            raise ValueError(f"{path}: device #{i} is missing {', '.join(missing)}")
        link = entry.get("link", "none")
        if isinstance(link, dict):
            link = Interconnect(link["name"], float(link["gb_per_s"]), link.get("kind", "nvlink"), link.get("source", entry["source"]))
        else:
            link = get_link(str(link))
        spec = GPUSpec(
            name=str(entry["name"]),
            bf16_tflops=float(entry["bf16_tflops"]),
            fp8_tflops=_opt_float(entry.get("fp8_tflops")),
            int8_tops=_opt_float(entry.get("int8_tops")),
            memory_gb=float(entry["memory_gb"]),
            hbm_gb_per_s=float(entry["hbm_gb_per_s"]),
            link=link,
            source=str(entry["source"]),
            mig_max=int(entry.get("mig_max", 0)),
            fp32_tflops=_opt_float(entry.get("fp32_tflops")),
        )
        added.append(register_gpu(spec, tuple(entry.get("aliases", ()))))
    return added


def _opt_float(value: object) -> float | None:
    return None if value in (None, "", "-") else float(value)  # type: ignore[arg-type]


def gpu_from_device_name(device_name: str) -> GPUSpec | None:
    """The table's entry for a name as torch or NVML print it ("NVIDIA H100 80GB HBM3" -> H100),
    trying the longest run of leading words first; None when the table has no such device."""
    # "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090": vendor, brand and form-factor words dropped.
    drop = {"nvidia", "geforce", "sxm", "sxm4", "sxm5"}
    words = [w for w in device_name.replace("-", " ").split() if w.lower() not in drop]
    for k in range(len(words), 0, -1):
        try:
            return get_gpu("-".join(words[:k]))
        except ValueError:
            continue
    return None


def load_this_device(path: str | Path | None = None) -> GPUSpec:
    """Register the device file's entry (what `stoker doctor --write-device-file` measured) with
    the table, as `load_gpu_yaml` does, and return its spec; `get_gpu("this")` calls this when
    "this" is not yet registered."""
    from stoker.roofline.device_file import default_path, read_device_file

    src = Path(path) if path else default_path()
    read_device_file(src)  # the clear error when absent or not the doctor's
    return load_gpu_yaml(src)[0]
