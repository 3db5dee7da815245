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
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from stoker.roofline.costmodel import decode_tokens_per_s
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.measured import load_measured

_GRIDS: dict[str, list[float]] = {
    "memory": [0.30 + 0.01 * i for i in range(71)],
    "gemm_compute": [0.30 + 0.02 * i for i in range(36)],
    "layer_overhead_s": [1e-6 * i for i in range(0, 101, 2)],
}


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

    best = start or Efficiencies()
    best_loss = loss(best)
    for _ in range(rounds):
        for name, grid in _GRIDS.items():
            for value in grid:
                cand = best.replace(**{name: value})
                cand_loss = loss(cand)
                if cand_loss < best_loss - 1e-12:
                    best, best_loss = cand, cand_loss
    return best
