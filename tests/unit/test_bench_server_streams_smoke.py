"""benchmarks/stream_fanout_cpu.py: its --smoke run (the in-process fan-out over 8 streams) ends with a
table and figures that add up. (benchmarks/server_streams_cpu.py --smoke, a whole server in a
subprocess, took a minute of the suite under load and is run by hand.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(script: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| " in proc.stdout  # the table
    return json.loads(out.read_text())


def test_stream_fanout_smoke(tmp_path: Path) -> None:
    result = run_smoke("stream_fanout_cpu.py", tmp_path / "fanout.json")
    assert result["streams"] == 8 and result["tokens"] == 8
    assert all(len(v) == 1 and v[0] > 0 for v in result["rounds"].values())
