"""The two input files of `stoker fleet plan`: the fleet and the deployments (YAML).

Formats are documented in docs/fleet.md. Unknown keys are errors, so a typo never silently
falls back to a default. All errors are ValueError naming the file, the entry and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stoker.fleet.gpus import get_gpu_model

# Kubernetes object names: RFC 1123 DNS labels.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
HOURS_PER_MONTH = 730.0  # 8760 h / 12, the figure cloud price sheets use


@dataclass(frozen=True)
class Node:
    name: str
    gpu_model: str  # canonical name from stoker.fleet.gpus
    num_gpus: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetSpec:
    nodes: tuple[Node, ...]
    prices: dict[str, float]  # USD per GPU-hour, by canonical GPU model
    hours_per_month: float = HOURS_PER_MONTH

    def price(self, gpu_model: str) -> float:
        return self.prices.get(gpu_model, 0.0)


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    model: str  # what `stoker serve` loads (HF id or path)
    preset: str  # roofline model spec (preset name or config.json path)
    replicas: int = 1
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 16
    gpu_memory_utilization: float = 0.9
    target_tokens_per_s: float | None = None  # decode tokens/s per replica
    memory_gib: float | None = None  # explicit need: skips the roofline memory model
    compute_share: float | None = None  # explicit share of one GPU (0-1]
    image: str = "ghcr.io/stoker-project/stoker:latest"
    port: int = 8000
    extra_args: tuple[str, ...] = ()
    # > 0: disaggregated serving (stoker/fleet/disagg.py): `replicas` decode servers, this many
    # prefill servers, and a `stoker router` in front of both.
    prefill_replicas: int = 0


def _load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"{p}: not valid YAML{where} ({problem}); fix the syntax") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping at the top level")
    return data


def _check_keys(where: str, entry: dict[str, Any], allowed: set[str], required: set[str]) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = set(entry) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(entry)
    if missing:
        raise ValueError(f"{where}: missing key(s) {sorted(missing)}")


def _check_name(where: str, name: object) -> str:
    if not isinstance(name, str) or not _DNS_LABEL.match(name):
        raise ValueError(f"{where}: name {name!r} must be a DNS label (lower case, digits, '-')")
    return name


def parse_fleet(data: dict[str, Any], source: str = "fleet") -> FleetSpec:
    _check_keys(source, data, {"nodes", "prices", "hours_per_month"}, {"nodes"})
    if not isinstance(data["nodes"], list) or not data["nodes"]:
        raise ValueError(f"{source}: 'nodes' must be a non-empty list")
    nodes: list[Node] = []
    for i, raw in enumerate(data["nodes"]):
        where = f"{source}: nodes[{i}]"
        _check_keys(where, raw, {"name", "gpu", "count", "labels"}, {"name", "gpu", "count"})
        count = raw["count"]
        if not isinstance(count, int) or not 1 <= count <= 16:
            raise ValueError(f"{where}: count must be an integer from 1 to 16, got {count!r}")
        try:
            model = get_gpu_model(str(raw["gpu"])).name
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        labels = {str(k): str(v) for k, v in (raw.get("labels") or {}).items()}
        nodes.append(Node(_check_name(where, raw["name"]), model, count, labels))
    if len({n.name for n in nodes}) != len(nodes):
        raise ValueError(f"{source}: node names must be unique")
    prices: dict[str, float] = {}
    for k, v in (data.get("prices") or {}).items():
        try:
            prices[get_gpu_model(str(k)).name] = float(v)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: prices[{k!r}]: {exc}") from None
    return FleetSpec(tuple(nodes), prices, float(data.get("hours_per_month", HOURS_PER_MONTH)))


_DEPLOYMENT_KEYS = {f for f in DeploymentSpec.__dataclass_fields__} - {"extra_args"} | {"args"}


def parse_deployments(data: dict[str, Any], source: str = "deployments") -> tuple[DeploymentSpec, ...]:
    _check_keys(source, data, {"deployments", "defaults"}, {"deployments"})
    defaults = data.get("defaults") or {}
    _check_keys(f"{source}: defaults", defaults, _DEPLOYMENT_KEYS - {"name", "model", "preset"}, set())
    if not isinstance(data["deployments"], list) or not data["deployments"]:
        raise ValueError(f"{source}: 'deployments' must be a non-empty list")
    out: list[DeploymentSpec] = []
    for i, raw in enumerate(data["deployments"]):
        where = f"{source}: deployments[{i}]"
        _check_keys(where, raw, _DEPLOYMENT_KEYS, {"name", "model"})
        merged = {**defaults, **raw}
        merged.setdefault("preset", merged["model"])
        merged["extra_args"] = tuple(str(a) for a in merged.pop("args", ()) or ())
        _check_name(where, merged["name"])
        try:
            spec = DeploymentSpec(**merged)
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not isinstance(spec.replicas, int) or spec.replicas < 1:
            raise ValueError(f"{where}: replicas must be a positive integer")
        if not isinstance(spec.prefill_replicas, int) or spec.prefill_replicas < 0:
            raise ValueError(f"{where}: prefill_replicas must be an integer >= 0 (0: not disaggregated)")
        if spec.compute_share is not None and not 0 < spec.compute_share <= 64:
            raise ValueError(f"{where}: compute_share must be in (0, 64] (GPUs' worth of compute)")
        if not 0 < spec.gpu_memory_utilization <= 1:
            raise ValueError(f"{where}: gpu_memory_utilization must be in (0, 1]")
        out.append(spec)
    if len({d.name for d in out}) != len(out):
        raise ValueError(f"{source}: deployment names must be unique")
    return tuple(out)


def load_fleet(path: str | Path) -> FleetSpec:
    return parse_fleet(_load_yaml(path), str(path))


def load_deployments(path: str | Path) -> tuple[DeploymentSpec, ...]:
    return parse_deployments(_load_yaml(path), str(path))
