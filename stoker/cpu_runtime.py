"""OpenMP's wait policy for CPU inference, decided once, before torch is imported.

torch's CPU ops and Stoker's C kernels (kernels/cpu/) run their parallel regions on one
OpenMP thread pool (the kernels' libgomp.so.1 resolves to the copy torch loaded first). By
default a libgomp worker that finishes a region spins for a while (GOMP_SPINCOUNT, 300k
iterations) waiting for the next one. On a machine with spare cores that saves a wake-up per region; on a
small machine shared with anything else (the HTTP event loop, a load generator, another job)
the spinning workers take the cores the busy ones need, and every region waits for the
slowest thread: with one competing busy process on a 2-core VM, a 64-token request went from
0.3 s to 1.0-1.5 s (issue 12; docs/benchmarks.md, "CPU serving under contention").
`OMP_WAIT_POLICY=PASSIVE` makes idle workers sleep at once: the same request then took the
same time with or without the competitor, at a small cost on an idle machine (measured there).

So the `stoker` command sets OMP_WAIT_POLICY=PASSIVE unless the user set OMP_WAIT_POLICY or
GOMP_SPINCOUNT. libgomp reads both when it loads, which is why this must run before torch is
imported (stoker/cli.py does it first thing); a process that imported torch already keeps
what it had, and the offline `LLM` API leaves the choice to its caller. The thread count stays
OpenMP's own knob, OMP_NUM_THREADS (default: every CPU this process may run on); the C
kernels use torch's count. Pure Python: no torch here.
"""

from __future__ import annotations

import os
import sys

# Environment variables through which the user has already chosen a wait behaviour.
_USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_set_by_stoker = False


def configure_openmp() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE for this process unless the user chose; call before torch loads."""
    global _set_by_stoker
    if "torch" in sys.modules or any(os.environ.get(name) for name in _USER_CHOICES):
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _set_by_stoker = True


def describe() -> str:
    """One line for the start-up log: the thread count and where the wait policy came from."""
    import torch

    policy = os.environ.get("OMP_WAIT_POLICY")
    spin = os.environ.get("GOMP_SPINCOUNT")
    if policy:
        source = "set by stoker" if _set_by_stoker else "from the environment"
        wait = f"OMP_WAIT_POLICY={policy} ({source})"
    elif spin:
        wait = f"GOMP_SPINCOUNT={spin} (from the environment)"
    else:
        wait = "OpenMP's default wait policy (workers spin before sleeping)"
    threads = os.environ.get("OMP_NUM_THREADS")
    n = torch.get_num_threads()
    count = f"{n} thread{'' if n == 1 else 's'}" + (" (OMP_NUM_THREADS)" if threads else "")
    return f"CPU: {count}, {wait}"
