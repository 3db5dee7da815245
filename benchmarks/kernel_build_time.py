"""How long the CPU C kernels take to build (first use on a machine), per ISA build, against
the sources of another commit in the same run.

    python benchmarks/kernel_build_time.py [--peer-rev 2b3cf29] [--repeats 3]

Each build goes to an empty cache folder (nothing reused); builds alternate between this
tree's sources and the peer revision's (read with `git show`), medians reported.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stoker.kernels.cpu import build  # noqa: E402

CPU_DIR = "stoker/kernels/cpu"


def peer_sources(rev: str, dest: Path) -> tuple[Path, ...]:
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CPU_DIR}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        if name.endswith((".c", ".h")):
            text = subprocess.run(["git", "show", f"{rev}:{CPU_DIR}/{name}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
            (dest / name).write_text(text)
    return tuple(dest / n for n in names if n.endswith(".c"))


def timed_build(sources: tuple[Path, ...], isa: str) -> float:
    with tempfile.TemporaryDirectory() as cache:
        build.cache_dir = lambda: Path(cache)  # an empty cache: a real build
        t = time.perf_counter()
        build.build(sources, isa=isa)
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-rev", default="2b3cf29")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        old = peer_sources(args.peer_rev, Path(d))
        print(f"| ISA build | this tree (s) | {args.peer_rev} (s) |\n|---|---:|---:|")
        for isa in build.supported_isas():
            mine, theirs = [], []
            for _ in range(args.repeats):
                mine.append(timed_build(build._SOURCES, isa))
                theirs.append(timed_build(old, isa))
            print(f"| {isa} | {statistics.median(mine):.2f} | {statistics.median(theirs):.2f} |")


if __name__ == "__main__":
    main()
