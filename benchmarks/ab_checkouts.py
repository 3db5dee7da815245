"""Before and after: one benchmark script run alternately against two checkouts, medians side by side.

A refactor is measured this way: check the old commit out beside the new one
(`git worktree add /tmp/before <commit>`), then

    .venv/bin/python benchmarks/ab_checkouts.py --a /tmp/before --b . --rounds 3 \\
        --metric output_tokens_per_s_median.stoker -- benchmarks/throughput_vs_hf.py --repeats 1 --threads 2

Each round runs the script once per checkout, A then B in odd rounds and B then A in even
ones, so drift on a shared machine hits both alike. Every run gets `PYTHONPATH=<checkout>` and
the checkout as its working directory, and `--json <file>`, from which each `--metric` is read
(a dotted path; integers index lists: `results.0.median_ms.step`). The script is the
checkout's own copy (it may insert its own repository root into sys.path, as most here do);
`--script-from b` runs B's copy against both checkouts, for scripts that import stoker only
through PYTHONPATH and gained their --json after A (server_overhead.py, whose server
subprocess inherits PYTHONPATH too); `--script-from here` runs this checkout's copy (a script
newer than both, such as generate_throughput.py).

Prints every run and, per metric, the median of each side and B / A; `--json OUT` keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def read_metric(data: Any, path: str) -> float:
    for key in path.split("."):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return float(data)


def run_once(checkout: Path, script: Path, script_args: list[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, str(script), *script_args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (in {checkout}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, type=Path, help="the checkout before (e.g. a git worktree)")
    ap.add_argument("--b", required=True, type=Path, help="the checkout after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--metric", action="append", required=True, help="dotted path into the script's --json output")
    ap.add_argument("--script-from", choices=["own", "b", "here"], default="own")
    ap.add_argument("--json", default=None, help="write every run's metrics and the medians here")
    ap.add_argument("script", help="the benchmark script, relative to a checkout's root")
    ap.add_argument("script_args", nargs=argparse.REMAINDER, help="after --: the script's own flags")
    args = ap.parse_args()
    script_args = [a for a in args.script_args if a != "--"]
    sides = {"A": args.a.resolve(), "B": args.b.resolve()}
    runs: dict[str, dict[str, list[float]]] = {s: {m: [] for m in args.metric} for s in sides}
    with tempfile.TemporaryDirectory(prefix="stoker-ab-") as tmp:
        for r in range(args.rounds):
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                checkout = sides[side]
                script = {"b": sides["B"], "here": Path(__file__).resolve().parents[1]}.get(args.script_from, checkout) / args.script
                data = run_once(checkout, script, script_args, Path(tmp) / f"{side}{r}.json")
                values = {m: read_metric(data, m) for m in args.metric}
                for m, v in values.items():
                    runs[side][m].append(v)
                print(f"round {r + 1} {side}: " + ", ".join(f"{m} = {v:.4g}" for m, v in values.items()), flush=True)
    print(f"\nA = {sides['A']}\nB = {sides['B']}\n{args.script} {' '.join(script_args)}\n")
    print("| metric | A median | B median | B / A | A runs | B runs |")
    print("|---|---:|---:|---:|---|---|")
    summary = {}
    for m in args.metric:
        a, b = statistics.median(runs["A"][m]), statistics.median(runs["B"][m])
        summary[m] = {"a_median": a, "b_median": b, "b_over_a": b / a, "a_runs": runs["A"][m], "b_runs": runs["B"][m]}
        print(f"| {m} | {a:.4g} | {b:.4g} | {b / a:.3f} | {', '.join(f'{x:.4g}' for x in runs['A'][m])} | "
              f"{', '.join(f'{x:.4g}' for x in runs['B'][m])} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"a": str(sides["A"]), "b": str(sides["B"]), "script": args.script,
                                               "script_args": script_args, "metrics": summary}, indent=2))


if __name__ == "__main__":
    main()
