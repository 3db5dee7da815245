"""MIG geometry: profiles, placements, layout validation, enumeration and creation order.

A100, H100 and H200 share one geometry (NVIDIA MIG user guide, "Supported MIG Profiles";
table reproduced in shared/reference/facts.md): a GPU has 8 memory slices and 7 SM slices,
and holds at most 7 GPU instances. A GPU instance of a profile occupies `mem_slices`
consecutive memory slices starting at one of the profile's valid start slots; instances
may not overlap in memory and their SM slices sum to at most 7. At most one `+me` (media
extensions) instance exists per GPU.

Profile IDs are the ones `nvidia-smi mig -lgip` prints (the same on A100-40GB, A100-80GB,
H100-80GB and H200-141GB): 19 = 1g, 20 = 1g+me, 15 = 1g with double memory, 14 = 2g,
9 = 3g, 5 = 4g, 0 = 7g.

Pure Python: never imports torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache

NUM_MEM_SLICES = 8
NUM_SM_SLICES = 7
MAX_INSTANCES = 7


@dataclass(frozen=True)
class ProfileClass:
    """One row of the geometry table, independent of the GPU's memory size."""

    key: str  # "1g", "1g+me", "1g.2x", "2g", "3g", "4g", "7g"
    profile_id: int  # GPU instance profile ID, as `nvidia-smi mig -lgip` lists it
    sm_slices: int
    mem_slices: int
    starts: tuple[int, ...]  # valid first memory slice
    is_me: bool = False


# (key, profile id, SM slices, memory slices, valid starts, +me)
_CLASSES: tuple[ProfileClass, ...] = (
    ProfileClass("1g", 19, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    ProfileClass("1g+me", 20, 1, 1, (0, 1, 2, 3, 4, 5, 6), is_me=True),
    ProfileClass("1g.2x", 15, 1, 2, (0, 2, 4, 6)),
    ProfileClass("2g", 14, 2, 2, (0, 2, 4)),
    ProfileClass("3g", 9, 3, 4, (0, 4)),
    ProfileClass("4g", 5, 4, 4, (0,)),
    ProfileClass("7g", 0, 7, 8, (0,)),
)

# Profile names per GPU memory size: the "Xgb" suffix is the memory the instance gets.
_NAMES: dict[str, dict[str, str]] = {
    "A100-40GB": {"1g": "1g.5gb", "1g+me": "1g.5gb+me", "1g.2x": "1g.10gb", "2g": "2g.10gb",
                  "3g": "3g.20gb", "4g": "4g.20gb", "7g": "7g.40gb"},
    "A100-80GB": {"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1g.2x": "1g.20gb", "2g": "2g.20gb",
                  "3g": "3g.40gb", "4g": "4g.40gb", "7g": "7g.80gb"},
    "H100-80GB": {"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1g.2x": "1g.20gb", "2g": "2g.20gb",
                  "3g": "3g.40gb", "4g": "4g.40gb", "7g": "7g.80gb"},
    "H200-141GB": {"1g": "1g.18gb", "1g+me": "1g.18gb+me", "1g.2x": "1g.35gb", "2g": "2g.35gb",
                   "3g": "3g.71gb", "4g": "4g.71gb", "7g": "7g.141gb"},
}

MIG_GPU_MODELS: tuple[str, ...] = tuple(_NAMES)


@dataclass(frozen=True)
class MigProfile:
    """A MIG profile on one GPU model, e.g. `3g.40gb` on H100-80GB."""

    gpu_model: str
    name: str  # "3g.40gb"
    klass: ProfileClass

    @property
    def profile_id(self) -> int:
        return self.klass.profile_id

    @property
    def sm_slices(self) -> int:
        return self.klass.sm_slices

    @property
    def mem_slices(self) -> int:
        return self.klass.mem_slices

    @property
    def starts(self) -> tuple[int, ...]:
        return self.klass.starts

    @property
    def is_me(self) -> bool:
        return self.klass.is_me

    @property
    def resource_name(self) -> str:
        """Kubernetes extended resource under the device plugin's `mixed` strategy.

        A `+me` suffix becomes `.me` (resource names may not contain `+`).
        """
        return "nvidia.com/mig-" + self.name.replace("+me", ".me")


@dataclass(frozen=True, order=True)
class Placement:
    """One GPU instance: a profile at a start memory slice."""

    start: int
    profile: str  # profile name on the layout's GPU model

    def slots(self, gpu_model: str) -> range:
        p = get_profile(gpu_model, self.profile)
        return range(self.start, self.start + p.mem_slices)


def check_gpu_model(gpu_model: str) -> None:
    if gpu_model not in _NAMES:
        raise ValueError(
            f"GPU model {gpu_model!r} has no MIG geometry; use one of {', '.join(MIG_GPU_MODELS)}"
        )


@cache
def profiles(gpu_model: str) -> tuple[MigProfile, ...]:
    """All MIG profiles of a GPU model, smallest first."""
    check_gpu_model(gpu_model)
    names = _NAMES[gpu_model]
    return tuple(MigProfile(gpu_model, names[c.key], c) for c in _CLASSES)


def get_profile(gpu_model: str, name: str) -> MigProfile:
    for p in profiles(gpu_model):
        if p.name == name:
            return p
    valid = ", ".join(p.name for p in profiles(gpu_model))
    raise ValueError(f"unknown MIG profile {name!r} for {gpu_model}; valid profiles: {valid}")


def profile_by_id(gpu_model: str, profile_id: int) -> MigProfile:
    for p in profiles(gpu_model):
        if p.profile_id == profile_id:
            return p
    raise ValueError(f"unknown MIG profile ID {profile_id} for {gpu_model}")


def layout_errors(gpu_model: str, layout: tuple[Placement, ...] | list[Placement]) -> list[str]:
    """Every reason `layout` is not a valid MIG layout on `gpu_model` (empty list: valid)."""
    errors: list[str] = []
    owner: dict[int, Placement] = {}
    sm_total = 0
    num_me = 0
    for pl in layout:
        try:
            p = get_profile(gpu_model, pl.profile)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if pl.start not in p.starts:
            errors.append(
                f"{p.name} cannot start at memory slice {pl.start}; valid starts are {list(p.starts)}"
            )
            continue
        for s in range(pl.start, pl.start + p.mem_slices):
            if s in owner:
                errors.append(
                    f"{p.name}@{pl.start} overlaps {owner[s].profile}@{owner[s].start} on memory slice {s}"
                )
                break
            owner[s] = pl
        sm_total += p.sm_slices
        num_me += p.is_me
    if sm_total > NUM_SM_SLICES:
        errors.append(f"SM slices sum to {sm_total} > {NUM_SM_SLICES}")
    if num_me > 1:
        errors.append(f"{num_me} media-extension (+me) instances; at most one per GPU")
    if len(layout) > MAX_INSTANCES:
        errors.append(f"{len(layout)} instances > {MAX_INSTANCES} per GPU")
    return errors


def is_valid_layout(gpu_model: str, layout: tuple[Placement, ...] | list[Placement]) -> bool:
    return not layout_errors(gpu_model, layout)


@cache
def enumerate_layouts(gpu_model: str) -> tuple[tuple[Placement, ...], ...]:
    """Every valid layout (including partial ones and the empty one), placements sorted by start."""
    profs = profiles(gpu_model)
    out: list[tuple[Placement, ...]] = []

    def grow(slot: int, used_sm: int, has_me: bool, acc: tuple[Placement, ...]) -> None:
        if slot >= NUM_MEM_SLICES:
            out.append(acc)
            return
        grow(slot + 1, used_sm, has_me, acc)  # leave this memory slice free
        if len(acc) >= MAX_INSTANCES:
            return
        for p in profs:
            if slot in p.starts and used_sm + p.sm_slices <= NUM_SM_SLICES and not (p.is_me and has_me):
                grow(slot + p.mem_slices, used_sm + p.sm_slices, has_me or p.is_me,
                     acc + (Placement(slot, p.name),))

    grow(0, 0, False, ())
    return tuple(out)


def multiset_key(profile_names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(profile_names))


@cache
def feasible_multisets(gpu_model: str) -> dict[tuple[str, ...], tuple[Placement, ...]]:
    """Map each multiset of profiles (sorted names) that fits one GPU to one layout realizing it."""
    table: dict[tuple[str, ...], tuple[Placement, ...]] = {}
    for layout in enumerate_layouts(gpu_model):
        table.setdefault(multiset_key([pl.profile for pl in layout]), layout)
    return table


def layout_for(gpu_model: str, profile_names: list[str] | tuple[str, ...]) -> tuple[Placement, ...] | None:
    """A valid layout holding exactly these profiles, or None when they do not fit one GPU."""
    for n in profile_names:
        get_profile(gpu_model, n)
    return feasible_multisets(gpu_model).get(multiset_key(profile_names))


# --- creation order -------------------------------------------------------------------------
# `nvidia-smi mig -cgi A,B,C` creates instances one at a time and the driver, not the user,
# picks each start slot. The MIG user guide's example: on an A100-40GB `-cgi 19,19,14,9`
# fails (no room left for the 3g.20gb) while `-cgi 9,19,14,19` succeeds. The driver taking
# the highest free valid start slot reproduces both outcomes (and matches the guide's
# listings, where the first 3g.20gb lands at 4:4), so that is the model simulated here.


def simulate_creation(gpu_model: str, profile_ids: list[int] | tuple[int, ...]) -> tuple[Placement, ...]:
    """Create instances in order as the driver would; raise ValueError on the first that fails."""
    occupied: set[int] = set()
    used_sm = 0
    has_me = False
    made: list[Placement] = []
    for pid in profile_ids:
        p = profile_by_id(gpu_model, pid)
        start = next(
            (s for s in sorted(p.starts, reverse=True)
             if not occupied.intersection(range(s, s + p.mem_slices))),
            None,
        )
        if (start is None or used_sm + p.sm_slices > NUM_SM_SLICES or (p.is_me and has_me)
                or len(made) >= MAX_INSTANCES):
            raise ValueError(
                f"creating profile {pid} ({p.name}) after {[pl.profile for pl in made]} fails: "
                "insufficient resources"
            )
        occupied.update(range(start, start + p.mem_slices))
        used_sm += p.sm_slices
        has_me = has_me or p.is_me
        made.append(Placement(start, p.name))
    return tuple(made)


def creation_order(gpu_model: str, profile_names: list[str] | tuple[str, ...]) -> tuple[int, ...]:
    """Profile IDs in an order that `nvidia-smi mig -cgi` completes (largest first, else search)."""
    if layout_for(gpu_model, profile_names) is None:
        raise ValueError(f"profiles {sorted(profile_names)} do not fit one {gpu_model}")
    profs = sorted((get_profile(gpu_model, n) for n in profile_names),
                   key=lambda p: (-p.mem_slices, -p.sm_slices, p.profile_id))
    first = tuple(p.profile_id for p in profs)
    candidates = itertools.chain([first], itertools.permutations(first))
    for order in candidates:
        try:
            simulate_creation(gpu_model, order)
            return tuple(order)
        except ValueError:
            continue
    raise ValueError(f"no creation order for {sorted(profile_names)} on {gpu_model}")  # pragma: no cover
