"""Fleet plan: specs in, a placement per replica and a layout per GPU out.

`plan_fleet` sizes every deployment on every GPU model of the fleet (`sizing.need_for`),
lists the ways each replica can be hosted, runs the solvers of `placement`, and returns a
`FleetPlan` that `manifests` and `report` turn into files.
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.fleet import mig
from stoker.fleet.gpus import GiB
from stoker.fleet.placement import (
    FleetGpu,
    Replica,
    SearchLimitExceeded,
    SliceOption,
    fragmentation,
    slice_options,
    solve_exact,
    solve_heuristic,
)
from stoker.fleet.sizing import need_for
from stoker.fleet.spec import DeploymentSpec, FleetSpec

EXACT_MAX_REPLICAS = 14  # beyond this "auto" goes straight to the heuristic


@dataclass(frozen=True)
class SlicePlan:
    replica: str  # "deployment/index"
    profile: str
    start: int


@dataclass(frozen=True)
class GpuPlan:
    node: str
    index: int
    gpu_model: str
    hourly_price: float
    mig_enabled: bool
    slices: tuple[SlicePlan, ...]  # MIG instances, by start slot
    whole_replica: str | None  # replica owning the whole GPU (MIG disabled)
    creation_order: tuple[int, ...]  # profile IDs for `nvidia-smi mig -cgi`
    idle_share: float  # SM slices not allocated / 7
    fragmentation: float


@dataclass(frozen=True)
class ReplicaPlan:
    deployment: str
    index: int
    node: str
    gpu_model: str
    gpu_indices: tuple[int, ...]  # device indices, node by node
    profile: str | None  # None: whole GPUs
    nodes: tuple[str, ...] = ()  # a replica over several nodes (tensor parallel): all of them, leader first

    @property
    def resource_name(self) -> str:
        if self.profile is None:
            return "nvidia.com/gpu"
        return mig.get_profile(self.gpu_model, self.profile).resource_name

    @property
    def resource_count(self) -> int:
        """Per pod: GPUs (or one slice) on each node the replica spans."""
        return len(self.gpu_indices) // max(1, len(self.nodes)) if self.profile is None else 1

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.gpu_indices) if self.profile is None else 1


@dataclass(frozen=True)
class Unplaced:
    deployment: str
    index: int
    reason: str


@dataclass(frozen=True)
class FleetPlan:
    fleet: FleetSpec
    deployments: tuple[DeploymentSpec, ...]
    gpus: tuple[GpuPlan, ...]  # GPUs in use
    replicas: tuple[ReplicaPlan, ...]
    unplaced: tuple[Unplaced, ...]
    method: str  # "exact" | "heuristic"
    gpus_before: int  # GPUs the same replicas take without MIG (one or more whole GPUs each)
    hourly_cost_before: float

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    @property
    def hourly_cost(self) -> float:
        return sum(g.hourly_price for g in self.gpus)

    @property
    def total_gpus(self) -> int:
        return sum(n.num_gpus for n in self.fleet.nodes)


def _fleet_gpus(fleet: FleetSpec) -> list[FleetGpu]:
    return [FleetGpu(n.name, i, n.gpu_model, fleet.price(n.gpu_model))
            for n in fleet.nodes for i in range(n.num_gpus)]


def build_replicas(fleet: FleetSpec, deployments: tuple[DeploymentSpec, ...]) -> list[Replica]:
    models = sorted({n.gpu_model for n in fleet.nodes})
    max_per_node = {m: max(n.num_gpus for n in fleet.nodes if n.gpu_model == m) for m in models}
    full_nodes = {m: sum(1 for n in fleet.nodes if n.gpu_model == m and n.num_gpus == max_per_node[m]) for m in models}
    out: list[Replica] = []
    for dep in deployments:
        options: list[SliceOption] = []
        needs = []
        for m in models:
            need = need_for(dep, m)
            needs.append(f"{m}: {need.memory_bytes / GiB:.1f} GiB, {need.compute_share:.2f} of a GPU")
            options.extend(slice_options(m, need, max_per_node[m], full_nodes[m]))
        reason = "" if options else (
            "no GPU model in the fleet can host it (" + "; ".join(needs) + "); "
            "lower max_model_len/max_num_seqs or the throughput target, use a smaller dtype, "
            "or add bigger nodes")
        # Disaggregated: indices from dep.replicas on are the prefill servers (disagg.role_of).
        out.extend(Replica(dep.name, i, tuple(options), reason) for i in range(dep.replicas + dep.prefill_replicas))
    return out


def _solve(replicas: list[Replica], gpus: list[FleetGpu], method: str) -> tuple[dict, str]:
    if method not in ("auto", "exact", "heuristic"):
        raise ValueError(f"method must be auto, exact or heuristic, not {method!r}")
    if method == "heuristic" or (method == "auto" and len(replicas) > EXACT_MAX_REPLICAS):
        return solve_heuristic(replicas, gpus), "heuristic"
    try:
        return solve_exact(replicas, gpus), "exact"
    except SearchLimitExceeded:
        if method == "exact":
            raise ValueError("exact search too large for this fleet; use --method heuristic") from None
        return solve_heuristic(replicas, gpus), "heuristic"


def plan_fleet(fleet: FleetSpec, deployments: tuple[DeploymentSpec, ...], method: str = "auto") -> FleetPlan:
    gpus = _fleet_gpus(fleet)
    replicas = build_replicas(fleet, deployments)
    assign, used_method = _solve(replicas, gpus, method)

    replica_plans: list[ReplicaPlan] = []
    per_gpu: dict[int, list[tuple[str, SliceOption]]] = {}
    unplaced: list[Unplaced] = []
    for r in replicas:
        if r.key not in assign:
            why = r.reason or "the fleet has no free GPU or slice left for it; add GPUs or lower replicas"
            unplaced.append(Unplaced(r.deployment, r.index, why))
            continue
        opt, idx = assign[r.key]
        g0 = gpus[idx[0]]
        nodes = tuple(dict.fromkeys(gpus[i].node for i in idx)) if opt.num_nodes > 1 else ()
        replica_plans.append(ReplicaPlan(r.deployment, r.index, g0.node, g0.gpu_model,
                                         tuple(gpus[i].index for i in idx), opt.profile, nodes))
        for i in idx:
            per_gpu.setdefault(i, []).append((r.key, opt))

    gpu_plans = [_gpu_plan(gpus[i], per_gpu[i]) for i in sorted(per_gpu)]
    before, cost_before = _whole_gpu_baseline(replicas, gpus)
    return FleetPlan(fleet, deployments, tuple(gpu_plans), tuple(replica_plans), tuple(unplaced),
                     used_method, before, cost_before)


def _gpu_plan(gpu: FleetGpu, owners: list[tuple[str, SliceOption]]) -> GpuPlan:
    if owners[0][1].profile is None:
        return GpuPlan(gpu.node, gpu.index, gpu.gpu_model, gpu.hourly_price, False, (), owners[0][0], (), 0.0, 0.0)
    names = [opt.profile for _, opt in owners]
    layout = mig.layout_for(gpu.gpu_model, names)
    assert layout is not None and mig.is_valid_layout(gpu.gpu_model, layout), (gpu, names)
    pending = list(owners)
    slices: list[SlicePlan] = []
    for pl in layout:  # hand each placement to a replica that asked for that profile
        k = next(j for j, (_, o) in enumerate(pending) if o.profile == pl.profile)
        slices.append(SlicePlan(pending.pop(k)[0], pl.profile, pl.start))
    used_sm = sum(mig.get_profile(gpu.gpu_model, n).sm_slices for n in names)
    return GpuPlan(gpu.node, gpu.index, gpu.gpu_model, gpu.hourly_price, True, tuple(slices), None,
                   mig.creation_order(gpu.gpu_model, names), 1 - used_sm / mig.NUM_SM_SLICES,
                   fragmentation(gpu.gpu_model, names))


def _whole_gpu_baseline(replicas: list[Replica], gpus: list[FleetGpu]) -> tuple[int, float]:
    """GPUs (and $/h) the same replicas would take with MIG off: the 'before' of the report."""
    whole = [Replica(r.deployment, r.index, tuple(o for o in r.options if o.profile is None))
             for r in replicas]
    assign = solve_heuristic(whole, gpus)
    count = sum(len(idx) for _, idx in assign.values())
    cost = sum(gpus[i].hourly_price for _, idx in assign.values() for i in idx)
    for r in whole:  # the fleet cannot even hold it whole: count what it would take
        if r.key not in assign and r.options:
            cheapest = min(r.options, key=lambda o: o.num_gpus)
            count += cheapest.num_gpus
    return count, cost
