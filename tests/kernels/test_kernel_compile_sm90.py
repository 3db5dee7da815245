"""Every kernel compiles for sm_90 (H100/H200) at the launchers' tile configs, without spills.

The interpreter tests check the numbers but never run Triton's GPU compiler, and this task
has no GPU: compiling ahead of time for a GPUTarget needs only the triton wheel's bundled
ptxas. Runs in a subprocess since Triton must be imported with TRITON_INTERPRET=0 for this.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_all_kernels_compile_for_sm90_without_spills() -> None:
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = Path(__file__).with_name("aot_sm90.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
