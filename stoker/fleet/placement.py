"""Place model replicas onto whole GPUs or MIG slices using as few GPUs (then dollars) as possible.

The problem is a bin packing where each bin (a GPU) has MIG geometry: a set of slices fits
one GPU iff some valid layout holds it (`mig.feasible_multisets`). Each replica lists the
ways it can be hosted (`SliceOption`s: a MIG profile on a GPU model, or n whole GPUs of a
model on one node for tensor parallelism). Two solvers share the state and the result type:

- `solve_exact`: depth-first branch and bound over replicas (largest first), with symmetry
  breaking (GPUs in the same state, and nodes with the same free GPUs, are tried once) and
  a lower bound from SM and memory slices still needed. Optimal on small fleets.
- `solve_heuristic`: best-fit decreasing; each replica goes to the open GPU it leaves the
  least free memory (then least fragmented) on, else it opens the cheapest new GPU.

Objective, lexicographic: fewest unplaced replicas, then fewest GPUs, then lowest hourly cost.
Pure Python: never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from stoker.fleet import mig
from stoker.fleet.gpus import get_gpu_model

WHOLE = None  # SliceOption.profile for whole GPUs (MIG disabled)


@dataclass(frozen=True)
class DeploymentNeed:
    """What one replica needs from one GPU model: memory and a share of the GPU's compute.

    `compute_share` is the fraction of one whole GPU (SMs and memory bandwidth both scale
    with a slice: SM slices / 7 and memory slices / 8) the replica needs to meet its target.
    """

    memory_bytes: int
    compute_share: float = 0.0


@dataclass(frozen=True)
class SliceOption:
    gpu_model: str
    profile: str | None  # MIG profile name, or None for whole GPUs
    num_gpus: int = 1  # in all, over num_nodes nodes (num_gpus / num_nodes on each)
    num_nodes: int = 1  # > 1: a tensor-parallel replica spanning whole nodes (a LeaderWorkerSet)

    @property
    def label(self) -> str:
        if self.profile:
            return f"{self.gpu_model}:{self.profile}"
        nodes = f" over {self.num_nodes} nodes" if self.num_nodes > 1 else ""
        return f"{self.gpu_model}:{self.num_gpus}xGPU{nodes}"


@dataclass(frozen=True)
class Replica:
    deployment: str
    index: int
    options: tuple[SliceOption, ...]
    reason: str = ""  # why `options` is empty, when it is

    @property
    def key(self) -> str:
        return f"{self.deployment}/{self.index}"


@dataclass(frozen=True)
class FleetGpu:
    node: str
    index: int  # device index on the node
    gpu_model: str
    hourly_price: float = 0.0


def slice_options(
    gpu_model: str, need: DeploymentNeed, max_gpus_per_node: int, num_full_nodes: int = 1
) -> tuple[SliceOption, ...]:
    """Ways to host a replica with `need` on `gpu_model`: MIG profiles that fit, else whole GPUs
    on one node, else whole nodes (2, 4, ... of the `num_full_nodes` nodes that have
    `max_gpus_per_node` GPUs): tensor parallelism across nodes.

    `+me` and 7g profiles are left out: an LLM server needs no media engines, and a 7g slice
    is a whole GPU, which the whole-GPU option covers without MIG mode.
    """
    model = get_gpu_model(gpu_model)
    out: list[SliceOption] = []
    for p in model.profiles():
        if p.is_me or p.sm_slices == mig.NUM_SM_SLICES:
            continue
        share = min(p.sm_slices / mig.NUM_SM_SLICES, p.mem_slices / mig.NUM_MEM_SLICES)
        if model.profile_memory_bytes(p) >= need.memory_bytes and share >= need.compute_share:
            out.append(SliceOption(model.name, p.name))
    n = 1  # tensor-parallel sizes are powers of two (head counts divide by them)
    while n <= max_gpus_per_node:
        if n * model.memory_bytes >= need.memory_bytes and n >= need.compute_share:
            out.append(SliceOption(model.name, WHOLE, n))
            return tuple(out)
        n *= 2
    nodes = 2
    while nodes <= num_full_nodes:
        n = nodes * max_gpus_per_node
        if n * model.memory_bytes >= need.memory_bytes and n >= need.compute_share:
            out.append(SliceOption(model.name, WHOLE, n, nodes))
            break
        nodes *= 2
    return tuple(out)


@dataclass
class _GpuState:
    gpu: FleetGpu
    profiles: list[str] = field(default_factory=list)  # MIG slices, as profile names
    owners: list[str] = field(default_factory=list)  # replica key per slice (or the whole GPU)
    whole: bool = False

    @property
    def is_open(self) -> bool:
        return self.whole or bool(self.profiles)

    def can_add(self, profile: str) -> bool:
        if self.whole or not get_gpu_model(self.gpu.gpu_model).is_mig_capable:
            return False
        return mig.multiset_key(self.profiles + [profile]) in mig.feasible_multisets(self.gpu.gpu_model)

    def free_slices(self) -> tuple[int, int]:
        """(free SM slices, free memory slices); a whole or untouched GPU counts as 7, 8."""
        if self.whole:
            return 0, 0
        sm = sum(mig.get_profile(self.gpu.gpu_model, n).sm_slices for n in self.profiles)
        mem = sum(mig.get_profile(self.gpu.gpu_model, n).mem_slices for n in self.profiles)
        return mig.NUM_SM_SLICES - sm, mig.NUM_MEM_SLICES - mem


def _size(opt: SliceOption) -> tuple[int, int]:
    """(SM slices, memory slices) an option takes; whole GPUs count 7 and 8 each."""
    if opt.profile is None:
        return mig.NUM_SM_SLICES * opt.num_gpus, mig.NUM_MEM_SLICES * opt.num_gpus
    p = mig.get_profile(opt.gpu_model, opt.profile)
    return p.sm_slices, p.mem_slices


def _replica_order(replicas: list[Replica]) -> list[Replica]:
    # Largest first (by the smallest way to host it): the classic decreasing order.
    def key(r: Replica) -> tuple[int, int, str, int]:
        sm, mem = min((_size(o) for o in r.options), default=(0, 0), key=lambda s: (s[1], s[0]))
        return (-mem, -sm, r.deployment, r.index)

    return sorted(replicas, key=key)


class _Search:
    """Shared state for both solvers: GPUs, assignments, and moves on them."""

    def __init__(self, gpus: list[FleetGpu]):
        self.states = [_GpuState(g) for g in gpus]
        self.assign: dict[str, tuple[SliceOption, tuple[int, ...]]] = {}

    def cost(self) -> tuple[int, float]:
        used = [s for s in self.states if s.is_open]
        return len(used), round(sum(s.gpu.hourly_price for s in used), 9)

    def moves(self, r: Replica, dedupe: bool) -> list[tuple[SliceOption, tuple[int, ...]]]:
        """Every distinct way to place `r` now: into an open GPU, or onto fresh GPUs."""
        out: list[tuple[SliceOption, tuple[int, ...]]] = []
        seen: set[object] = set()
        free_on_node: dict[tuple[str, str], int] = {}
        for s in self.states:
            k = (s.gpu.node, s.gpu.gpu_model)
            free_on_node[k] = free_on_node.get(k, 0) + (not s.is_open)
        for opt in r.options:
            if opt.profile is not None:
                for i, s in enumerate(self.states):
                    if s.gpu.gpu_model != opt.gpu_model or not s.can_add(opt.profile):
                        continue
                    # A fresh GPU also changes its node's free count, which tensor-parallel
                    # replicas care about; open GPUs in the same state are interchangeable.
                    node_free = None if s.is_open else free_on_node[(s.gpu.node, s.gpu.gpu_model)]
                    sig = (opt, s.gpu.hourly_price, tuple(sorted(s.profiles)), node_free)
                    if dedupe and sig in seen:
                        continue
                    seen.add(sig)
                    out.append((opt, (i,)))
            else:
                by_node: dict[str, list[int]] = {}
                for i, s in enumerate(self.states):
                    if s.gpu.gpu_model == opt.gpu_model and not s.is_open:
                        by_node.setdefault(s.gpu.node, []).append(i)
                per_node = opt.num_gpus // opt.num_nodes
                fits = [free for free in by_node.values() if len(free) >= per_node]
                if opt.num_nodes > 1:  # the first whole nodes free enough, leader first
                    if len(fits) >= opt.num_nodes:
                        out.append((opt, tuple(i for free in fits[: opt.num_nodes] for i in free[:per_node])))
                    continue
                for free in fits:
                    sig = (opt, len(free), self.states[free[0]].gpu.hourly_price)
                    if dedupe and sig in seen:
                        continue
                    seen.add(sig)
                    out.append((opt, tuple(free[: opt.num_gpus])))
        return out

    def apply(self, r: Replica, opt: SliceOption, idx: tuple[int, ...]) -> None:
        for i in idx:
            s = self.states[i]
            if opt.profile is None:
                s.whole = True
            else:
                s.profiles.append(opt.profile)
            s.owners.append(r.key)
        self.assign[r.key] = (opt, idx)

    def undo(self, r: Replica) -> None:
        opt, idx = self.assign.pop(r.key)
        for i in idx:
            s = self.states[i]
            if opt.profile is None:
                s.whole = False
            else:
                s.profiles.remove(opt.profile)
            s.owners.remove(r.key)


def _lower_bound_gpus(search: _Search, remaining: list[Replica]) -> int:
    """GPUs in use plus the fewest more GPUs the remaining replicas could possibly need."""
    used, _ = search.cost()
    need_sm = need_mem = 0
    for r in remaining:
        if r.options:
            sm, mem = min((_size(o) for o in r.options), key=lambda s: (s[1], s[0]))
            need_sm, need_mem = need_sm + sm, need_mem + mem
    free_sm = sum(s.free_slices()[0] for s in search.states if s.is_open)
    free_mem = sum(s.free_slices()[1] for s in search.states if s.is_open)
    extra = max(math.ceil(max(0, need_sm - free_sm) / mig.NUM_SM_SLICES),
                math.ceil(max(0, need_mem - free_mem) / mig.NUM_MEM_SLICES))
    return used + extra


class SearchLimitExceeded(RuntimeError):
    pass


def solve_exact(replicas: list[Replica], gpus: list[FleetGpu], max_nodes: int = 200_000
                ) -> dict[str, tuple[SliceOption, tuple[int, ...]]]:
    """Optimal assignment {replica key: (option, GPU indices)}; unplaceable replicas are absent.

    Raises SearchLimitExceeded after `max_nodes` search nodes (use the heuristic then).
    """
    order = _replica_order([r for r in replicas if r.options])  # the rest cannot be placed at all
    search = _Search(gpus)
    # Start from the heuristic's answer: a tight upper bound prunes most of the tree.
    start = solve_heuristic(replicas, gpus)
    best: list[object] = [_score(start, len(order), gpus), start]
    visited = [0]

    def dfs(k: int, unplaced: int) -> None:
        visited[0] += 1
        if visited[0] > max_nodes:
            raise SearchLimitExceeded(f"exact search passed {max_nodes} nodes")
        n_used, price = search.cost()
        if k == len(order):
            if (unplaced, n_used, price) < best[0]:  # type: ignore[operator]
                best[0], best[1] = (unplaced, n_used, price), dict(search.assign)
            return
        bound = (unplaced, _lower_bound_gpus(search, order[k:]), price)
        if bound >= best[0]:  # type: ignore[operator]
            return
        r = order[k]
        # Cheapest-looking moves first: filling an open GPU before opening a new one.
        moves = sorted(search.moves(r, dedupe=True),
                       key=lambda m: (any(not search.states[i].is_open for i in m[1]), _size(m[0])[1]))
        for opt, idx in moves:
            search.apply(r, opt, idx)
            dfs(k + 1, unplaced)
            search.undo(r)
        dfs(k + 1, unplaced + 1)  # leave it unplaced (reported, never preferred)

    dfs(0, 0)
    return best[1]  # type: ignore[return-value]


def _score(assign: dict[str, tuple[SliceOption, tuple[int, ...]]], num_replicas: int,
           gpus: list[FleetGpu]) -> tuple[int, int, float]:
    used = {i for _, idx in assign.values() for i in idx}
    return num_replicas - len(assign), len(used), round(sum(gpus[i].hourly_price for i in used), 9)


def fragmentation(gpu_model: str, profile_names: list[str] | tuple[str, ...]) -> float:
    """Share of a MIG GPU's memory slices that are free but not usable by the largest slice that
    could still be created: 0 = the free space is one usable block, higher = stranded slivers."""
    used_mem = sum(mig.get_profile(gpu_model, n).mem_slices for n in profile_names)
    free = mig.NUM_MEM_SLICES - used_mem
    if free <= 0 or not profile_names:
        return 0.0
    table = mig.feasible_multisets(gpu_model)
    largest = max((p.mem_slices for p in mig.profiles(gpu_model)
                   if mig.multiset_key(list(profile_names) + [p.name]) in table), default=0)
    return (free - largest) / mig.NUM_MEM_SLICES


def solve_heuristic(replicas: list[Replica], gpus: list[FleetGpu]
                    ) -> dict[str, tuple[SliceOption, tuple[int, ...]]]:
    """Best-fit decreasing with a fragmentation tie-break; fast on any fleet size.

    Replicas go largest first. Each takes the smallest slice that hosts it, preferring a GPU
    already open (best fit: the one left with the least free memory, then the least
    fragmented) over opening a new one (the cheapest). Two passes, the second preferring
    whole GPUs' cheapest model first, and the better plan wins.
    """
    best: dict[str, tuple[SliceOption, tuple[int, ...]]] = {}
    best_score: tuple[int, int, float] | None = None
    for variant in ("slice-first", "price-first"):
        assign = _best_fit_decreasing(replicas, gpus, variant)
        score = _score(assign, len(replicas), gpus)
        if best_score is None or score < best_score:
            best, best_score = assign, score
    return best


def _best_fit_decreasing(replicas: list[Replica], gpus: list[FleetGpu], variant: str
                         ) -> dict[str, tuple[SliceOption, tuple[int, ...]]]:
    search = _Search(gpus)
    for r in _replica_order(replicas):
        moves = search.moves(r, dedupe=False)
        if not moves:
            continue

        def score(m: tuple[SliceOption, tuple[int, ...]]) -> tuple[object, ...]:
            opt, idx = m
            opens = sum(not search.states[i].is_open for i in idx)
            price = sum(search.states[i].gpu.hourly_price for i in idx if not search.states[i].is_open)
            sm, mem = _size(opt)
            if opt.profile is None:
                left, frag = 0.0, 0.0
            else:
                after = search.states[idx[0]].profiles + [opt.profile]
                left = 1 - sum(mig.get_profile(opt.gpu_model, n).mem_slices for n in after) / mig.NUM_MEM_SLICES
                frag = fragmentation(opt.gpu_model, after)
            size = (mem, sm)
            if variant == "price-first":
                return (opens, price, size, left, frag, idx)
            return (opens, size, price, left, frag, idx)

        opt, idx = min(moves, key=score)
        search.apply(r, opt, idx)
    return dict(search.assign)
