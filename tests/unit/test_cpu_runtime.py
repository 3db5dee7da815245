"""The OpenMP wait policy the `stoker` command sets before torch loads (stoker/cpu_runtime.py).

Each case runs in a fresh interpreter: libgomp reads the policy when it loads, and this test
process imported torch long ago."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import os, sys
from stoker.cpu_runtime import configure_openmp
if sys.argv[1] == "torch-first":
    import torch
configure_openmp()
print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


def _probe(mode: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_passive_unless_the_user_chose() -> None:
    assert _probe("plain") == "PASSIVE False", "and the module itself must not import torch"
    assert _probe("plain", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE False"
    assert _probe("plain", GOMP_SPINCOUNT="1000") == "None False"


def test_too_late_once_torch_is_loaded() -> None:
    """libgomp has read its settings by then: changing the variable would only mislead the log."""
    assert _probe("torch-first") == "None True"


@pytest.mark.parametrize("env, expected", [
    ({}, "OMP_WAIT_POLICY=PASSIVE (set by stoker)"),
    ({"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "1"}, "1 thread (OMP_NUM_THREADS), OMP_WAIT_POLICY=active (from the environment)"),
    ({"GOMP_SPINCOUNT": "1000"}, "GOMP_SPINCOUNT=1000 (from the environment)"),
])
def test_the_cli_logs_what_it_runs_with(env: dict[str, str], expected: str) -> None:
    # --version exits inside argparse after configure_openmp has run; describe() then says why.
    code = ("from stoker.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "from stoker.cpu_runtime import describe; print(describe())")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout.splitlines()[-1]
