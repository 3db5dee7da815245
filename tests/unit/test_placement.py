"""Placement: exact solver vs brute force, heuristic gap, infeasible reporting."""

from __future__ import annotations

import itertools
import random
import statistics

from stoker.fleet import mig
from stoker.fleet.gpus import GiB
from stoker.fleet.placement import (
    DeploymentNeed,
    FleetGpu,
    Replica,
    slice_options,
    solve_exact,
    solve_heuristic,
)

PRICES = {"H100-80GB": 2.5, "A100-40GB": 1.3}


MEMORY_GIB = (3, 4, 8, 9, 15, 18, 30, 38, 60, 100)


def _instance(rng: random.Random, num_replicas: int, num_gpus: int, memory_gib: tuple[int, ...] = MEMORY_GIB
              ) -> tuple[list[Replica], list[FleetGpu]]:
    gpus: list[FleetGpu] = []
    node = 0
    while len(gpus) < num_gpus:
        model = rng.choice(list(PRICES))
        n = min(rng.randint(1, 3), num_gpus - len(gpus))
        gpus += [FleetGpu(f"n{node}", i, model, PRICES[model]) for i in range(n)]
        node += 1
    replicas = []
    for r in range(num_replicas):
        mem = rng.choice(memory_gib) * GiB
        share = rng.choice([0.0, 0.0, 0.1, 0.3, 0.45])
        opts = tuple(o for m in sorted({g.gpu_model for g in gpus})
                     for o in slice_options(m, DeploymentNeed(mem, share), 2))
        replicas.append(Replica(f"d{r}", 0, opts))
    return replicas, gpus


def _check_and_score(replicas, gpus, assign) -> tuple[int, int, float]:
    """Validate an assignment by the geometry rules and return (unplaced, GPUs, $/h)."""
    slices: dict[int, list[str]] = {}
    whole: dict[int, str] = {}
    for r in replicas:
        if r.key not in assign:
            continue
        opt, idx = assign[r.key]
        assert opt in r.options
        assert len({gpus[i].node for i in idx}) == 1 and all(gpus[i].gpu_model == opt.gpu_model for i in idx)
        for i in idx:
            if opt.profile is None:
                assert i not in whole and i not in slices
                whole[i] = r.key
            else:
                assert i not in whole
                slices.setdefault(i, []).append(opt.profile)
    for i, names in slices.items():
        layout = mig.layout_for(gpus[i].gpu_model, names)
        assert layout is not None and mig.layout_errors(gpus[i].gpu_model, layout) == []
    used = set(slices) | set(whole)
    return (len(replicas) - len(assign), len(used), round(sum(gpus[i].hourly_price for i in used), 9))


def _brute_force(replicas, gpus) -> tuple[int, int, float]:
    choices = []
    for r in replicas:
        cs = [None]
        for opt in r.options:
            if opt.profile is not None:
                cs += [(opt, (i,)) for i, g in enumerate(gpus) if g.gpu_model == opt.gpu_model]
            else:
                cs += [(opt, combo) for combo in itertools.combinations(range(len(gpus)), opt.num_gpus)
                       if all(gpus[i].gpu_model == opt.gpu_model for i in combo)
                       and len({gpus[i].node for i in combo}) == 1]
        choices.append(cs)
    best = None
    for pick in itertools.product(*choices):
        assign = {r.key: c for r, c in zip(replicas, pick) if c is not None}
        try:
            score = _check_and_score(replicas, gpus, assign)
        except AssertionError:
            continue
        best = score if best is None or score < best else best
    return best


def test_exact_matches_brute_force_on_small_random_instances():
    rng = random.Random(5)
    for _ in range(25):
        replicas, gpus = _instance(rng, rng.randint(2, 4), rng.randint(1, 3))
        exact = _check_and_score(replicas, gpus, solve_exact(replicas, gpus))
        assert exact == _brute_force(replicas, gpus), (replicas, gpus)


def test_heuristic_gap_on_larger_instances():
    rng = random.Random(11)
    gaps = []
    for _ in range(12):
        # Enough capacity that everything fits: the gap is then in GPUs alone.
        replicas, gpus = _instance(rng, 10, 8, memory_gib=(3, 4, 8, 9, 15, 18, 30, 60))
        exact = _check_and_score(replicas, gpus, solve_exact(replicas, gpus))
        heur = _check_and_score(replicas, gpus, solve_heuristic(replicas, gpus))
        assert heur >= exact  # the exact answer is a true optimum
        assert heur[0] == exact[0]  # the heuristic places everything the optimum places here
        gaps.append(heur[1] - exact[1])
    # Measured (seed 11, 12 instances of 10 replicas on 8 GPUs): see docs/fleet.md.
    print(f"heuristic GPU gap: mean {statistics.mean(gaps):.2f}, max {max(gaps)}")
    assert statistics.mean(gaps) <= 0.5 and max(gaps) <= 1


def test_heuristic_scales_to_a_big_fleet():
    rng = random.Random(3)
    replicas, gpus = _instance(rng, 200, 120)
    _check_and_score(replicas, gpus, solve_heuristic(replicas, gpus))


def test_infeasible_replica_is_left_unplaced():
    gpus = [FleetGpu("a", 0, "A100-40GB", 1.0)]
    big = Replica("huge", 0, slice_options("A100-40GB", DeploymentNeed(500 * GiB), 1))
    assert big.options == ()
    fits = Replica("small", 0, slice_options("A100-40GB", DeploymentNeed(4 * GiB), 1))
    assign = solve_exact([big, fits], gpus)
    assert set(assign) == {"small/0"}
    # Capacity: two whole-GPU replicas on one GPU; one is placed, one is not.
    two = [Replica("w", i, slice_options("A100-40GB", DeploymentNeed(30 * GiB, 0.9), 1)) for i in range(2)]
    assert len(solve_exact(two, gpus)) == 1 and len(solve_heuristic(two, gpus)) == 1


def test_small_replicas_share_one_gpu():
    gpus = [FleetGpu("a", i, "H100-80GB", 2.0) for i in range(4)]
    reps = [Replica("s", i, slice_options("H100-80GB", DeploymentNeed(8 * GiB), 4)) for i in range(7)]
    assign = solve_exact(reps, gpus)
    assert _check_and_score(reps, gpus, assign) == (0, 1, 2.0)
