"""benchmarks/server_streams_cpu.py and benchmarks/stream_fanout_cpu.py: their --smoke runs (a tiny
server with 8 streamed requests; the in-process fan-out over 8 streams) end with a table and
figures that add up."""

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


def test_server_streams_smoke(tmp_path: Path) -> None:
    result = run_smoke("server_streams_cpu.py", tmp_path / "streams.json")
    assert result["server_median"] > 0 and result["offline_median"] > 0
    cpu = result["server_cpu_us_per_token"]
    assert cpu["event loop user"][0] + cpu["event loop system"][0] > 0  # read from /proc for the server's main thread


def test_stream_fanout_smoke(tmp_path: Path) -> None:
    result = run_smoke("stream_fanout_cpu.py", tmp_path / "fanout.json")
    assert result["streams"] == 8 and result["tokens"] == 8
    assert all(len(v) == 1 and v[0] > 0 for v in result["rounds"].values())
