"""Compiled-Triton GPU tests inside an interpreter-mode pytest run.

tests/conftest.py sets TRITON_INTERPRET=1 for the whole process (the CPU suite needs it), and
Triton fixes interpreted-or-compiled when a kernel module is imported. So a GPU test file
marks its tests `compiled_only` and adds one test that re-runs the file with
TRITON_INTERPRET=0 in a subprocess (`rerun_compiled`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from stoker.kernels._common import interpreting

COMPILED = not interpreting()
compiled_only = pytest.mark.skipif(
    torch.cuda.is_available() and not COMPILED, reason="runs in the TRITON_INTERPRET=0 subprocess"
)


def rerun_compiled(test_file: str, timeout_s: int) -> None:
    """Run `test_file`'s gpu-marked tests with compiled Triton; fail with their output."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", test_file]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
