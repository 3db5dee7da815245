"""Fit the efficiency parameters to measured decode runs: one function over a benchmark JSON.

    eff = calibrate("decode_sweep.json")      # or a dict / list already loaded
    step_cost(..., eff=eff)

Accepted shapes:
  {"model": M, "gpu": G, "tp": 1, "weight_dtype": "bf16", "kv_dtype": "bf16",
   "points": [{"batch": 1, "context_len": 1024, "output_tokens_per_s": 150.0}, ...]}
  or a list of `stoker bench serve` / offline results (each read by `measured.load_measured`,
  model from `model_id`/`model`, GPU from `hardware`), or {"results": [...]} of those.

The fit minimises the squared log error of predicted vs measured tokens/s over the memory share
(what batch-1..64 decode mostly measures), the GEMM compute share (batch 256 and up) and the
per-layer launch gap, by coordinate descent on grids: no numpy, deterministic, ~100 ms.

`fit_points(points)` fits the same way to public measurements of any kind (published.py: decode,
static batch, first-token latency) over the knobs of PROFILE_GRIDS, with an absolute log error by
default (a median-like fit: a few points no cost model describes do not drag the rest), until a
pass of the descent changes nothing, then walks on with `pattern_search` (one grid step of one knob
or of two knobs at once, until no such move lowers the loss): that is how the "engine" profile in
profiles.py was made. The second stage is there because memory share, per-layer gap and all-reduce
latency trade against each other on the batch-1 rows: the minimum lies along a diagonal valley that
one-knob moves cannot follow (the descent alone stopped at a fitted loss of 2.18, the pair moves
reach 1.82 from the same start, and the same point from other starts).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

from stoker.roofline.costmodel import decode_tokens_per_s
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.measured import load_measured
from stoker.roofline.published import PublicPoint, speed_ratio

_GRIDS: dict[str, list[float]] = {
    "memory": [0.30 + 0.01 * i for i in range(71)],
    "gemm_compute": [0.30 + 0.02 * i for i in range(36)],
    "layer_overhead_s": [1e-6 * i for i in range(0, 101, 2)],
}


# Grids for fitting the engine profile to public end-to-end points (fit_points). Values are rounded
# so a fitted profile reads as the decimals written in profiles.py. Seven knobs are fitted (23 points
# in published.fit_points()): the GEMM share of peak, separately for 8-bit (FP8/INT8) tensor cores (see
# Efficiencies.gemm_compute_8bit for the public evidence that FP8 GEMMs reach a lower share), the
# HBM share, the three overheads every step pays and the per-layer context setup of a step holding
# prefill tokens (Efficiencies.prefill_layer_overhead_s; only the ttft and static points see it).
# attention_compute and comm stay at their kernel defaults, which have their own sources
# (FlashAttention-2's paper; nccl-tests): left free, the fit used them
# as spare knobs to absorb misses it cannot explain (in the six-knob fit comm fell to 0.25 of NVLink
# to slow down the 70B TP rows whose real cause is the 2023 GQA decode kernel, published.py notes
# those rows; with the seventh knob both rise to 1.0 instead).
PROFILE_GRIDS: dict[str, list[float]] = {
    "memory": [round(0.30 + 0.02 * i, 2) for i in range(36)],
    "gemm_compute": [round(0.30 + 0.02 * i, 2) for i in range(36)],
    "gemm_compute_8bit": [round(0.30 + 0.02 * i, 2) for i in range(36)],
    "comm_latency_s": [round(1e-6 * i, 9) for i in range(0, 61, 2)],
    "layer_overhead_s": [round(1e-6 * i, 9) for i in range(0, 61, 2)],
    "step_overhead_s": [round(1e-4 * i, 6) for i in range(41)],
    # Per layer, once per step holding prefill tokens (Efficiencies.prefill_layer_overhead_s):
    # 0-300 us in 5 us steps. Last, so the descent visits the six older knobs in their old order.
    "prefill_layer_overhead_s": [round(5e-6 * i, 9) for i in range(61)],
}


def coordinate_descent(loss: Callable[[Efficiencies], float], start: Efficiencies,
                       grids: dict[str, list[float]], rounds: int = 3) -> Efficiencies:
    """Minimise `loss` one knob at a time over its grid, at most `rounds` passes (it stops after a
    pass that changes nothing: every later pass would repeat it); deterministic."""
    best, best_loss = start, loss(start)
    for _ in range(rounds):
        before = best
        for name, grid in grids.items():
            for value in grid:
                cand = best.replace(**{name: value})
                cand_loss = loss(cand)
                if cand_loss < best_loss - 1e-12:
                    best, best_loss = cand, cand_loss
        if best == before:
            break
    return best


def pattern_search(loss: Callable[[Efficiencies], float], start: Efficiencies, grids: dict[str, list[float]],
                   max_sweeps: int = 200) -> Efficiencies:
    """From `start`, take every move of one grid step on one knob or on two knobs together (each
    sign) that lowers `loss`, sweep after sweep, until a sweep changes nothing (a local minimum on
    the grid for one- and two-knob moves); deterministic. A knob off its grid moves from the
    nearest grid value."""
    def index(name: str, value: float) -> int:
        grid = grids[name]
        return min(range(len(grid)), key=lambda i: abs(grid[i] - value))

    moves = [((n, s),) for n in grids for s in (-1, 1)]
    moves += [((a, sa), (b, sb)) for a, b in itertools.combinations(grids, 2) for sa in (-1, 1) for sb in (-1, 1)]
    best, best_loss = start, loss(start)
    for _ in range(max_sweeps):
        improved = False
        for move in moves:
            changes = {}
            for name, step in move:
                i = index(name, getattr(best, name)) + step
                if not 0 <= i < len(grids[name]):
                    break
                changes[name] = grids[name][i]
            else:
                cand = best.replace(**changes)
                cand_loss = loss(cand)
                if cand_loss < best_loss - 1e-12:
                    best, best_loss, improved = cand, cand_loss, True
        if not improved:
            break
    return best


def points_loss(points: Sequence[PublicPoint], eff: Efficiencies, norm: str = "l1") -> float:
    """Sum over points of |log(predicted / measured speed)| ("l1") or its square ("l2")."""
    logs = [math.log(speed_ratio(p, eff)) for p in points]
    return sum(abs(x) for x in logs) if norm == "l1" else sum(x * x for x in logs)


def fit_points(points: Sequence[PublicPoint], *, start: Efficiencies | None = None,
               grids: dict[str, list[float]] | None = None, norm: str = "l1", rounds: int = 10) -> Efficiencies:
    """Efficiencies that best reproduce public measurements (published.PublicPoint) of any kind:
    coordinate descent over the whole grids until a pass changes nothing (at most `rounds` passes),
    then `pattern_search` (one- and two-knob steps) from there until no step helps."""
    if not points:
        raise ValueError("fit_points needs at least one point")
    grids = grids or PROFILE_GRIDS
    start = start or Efficiencies()
    if "gemm_compute_8bit" in grids and start.gemm_compute_8bit == 0:
        # Start FP8 where "same as gemm_compute" put it: from the 0 sentinel, moving gemm_compute
        # would drag FP8 along and no single step could split them (a plateau for the descent).
        start = start.replace(gemm_compute_8bit=start.gemm_compute)
    def loss(e: Efficiencies) -> float:
        return points_loss(points, e, norm)

    return pattern_search(loss, coordinate_descent(loss, start, grids, rounds), grids)


def _points(data: Any) -> tuple[dict[str, Any], list[tuple[int, int, float]]]:
    if isinstance(data, dict) and "points" in data:
        pts = [(int(p["batch"]), int(p["context_len"]), float(p["output_tokens_per_s"])) for p in data["points"]]
        return data, pts
    runs = data.get("results") if isinstance(data, dict) and "results" in data else data
    if isinstance(runs, dict):
        runs = [runs]
    if not isinstance(runs, list) or not runs:
        raise ValueError("calibration input needs 'points' or a list of bench results")
    meta: dict[str, Any] = {}
    pts = []
    for r in runs:
        run = load_measured(r)
        meta.setdefault("model", run.model)
        meta.setdefault("gpu", run.gpu)
        meta.setdefault("tp", r.get("tp") or r.get("tensor_parallel_size") or 1)
        pts.append((max(1, round(run.batch)), max(1, round(run.context_len)), run.output_tokens_per_s))
    return meta, pts


def calibrate(benchmark_json_path_or_dict: str | Path | dict[str, Any] | list[Any], *,
              start: Efficiencies | None = None, rounds: int = 3) -> Efficiencies:
    """Efficiencies that best reproduce the measured decode tokens/s of the benchmark."""
    data: Any = benchmark_json_path_or_dict
    if isinstance(data, (str, Path)):
        data = json.loads(Path(data).read_text())
    meta, pts = _points(data)
    model, gpu = meta.get("model"), meta.get("gpu")
    if not model or not gpu:
        raise ValueError("calibration input must name the model and gpu (keys 'model' and 'gpu'/'hardware')")
    tp, wd, kvd = int(meta.get("tp") or 1), meta.get("weight_dtype") or "bf16", meta.get("kv_dtype")

    def loss(eff: Efficiencies) -> float:
        return sum(math.log(decode_tokens_per_s(model, gpu, batch=b, context_len=c, tp=tp, weight_dtype=wd,
                                                kv_dtype=kvd, eff=eff) / tps) ** 2 for b, c, tps in pts)

    return coordinate_descent(loss, start or Efficiencies(), _GRIDS, rounds)


def calibrate_files(paths: Sequence[str | Path], *, model: str | None = None, gpu: str | None = None,
                    tp: int | None = None, weight_dtype: str | None = None, kv_dtype: str | None = None,
                    start: Efficiencies | None = None) -> tuple[Efficiencies, dict[str, Any]]:
    """`stoker roofline calibrate`: fit to one or more result files (each a `stoker bench` result,
    a list of them, {"results": [...]} or {"points": [...]}); flags fill in or override what the
    files say. Returns the efficiencies and what was fitted to (model, gpu, tp, dtypes, points)."""
    if not paths:
        raise ValueError("calibrate needs at least one result file")
    meta: dict[str, Any] = {}
    pts: list[tuple[int, int, float]] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no result file at {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not valid JSON ({exc})") from None
        file_meta, file_pts = _points(data)
        for key in ("model", "gpu", "tp", "weight_dtype", "kv_dtype"):
            if file_meta.get(key) is not None:
                meta.setdefault(key, file_meta[key])
        pts += file_pts
    for key, value in (("model", model), ("gpu", gpu), ("tp", tp), ("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype)):
        if value is not None:
            meta[key] = value
    points = [{"batch": b, "context_len": c, "output_tokens_per_s": tps} for b, c, tps in pts]
    eff = calibrate({**meta, "points": points}, start=start)
    return eff, {**meta, "points": points}
