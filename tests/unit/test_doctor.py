"""`stoker doctor` on CPU end to end (tiny sizes), and the pass rule."""

from __future__ import annotations

import json

from stoker.cli import main
from stoker.doctor.checks import against_spec


def test_pass_rule_is_three_quarters_of_spec():
    assert against_spec("gemm", 750, "TFLOP/s", 1000, {}).passed is True
    assert against_spec("gemm", 749, "TFLOP/s", 1000, {}).passed is False
    assert against_spec("gemm", 5, "GFLOP/s", None, {}).passed is None


def test_doctor_cpu_end_to_end(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    rc = main(["doctor", "--device", "cpu", "--soak-minutes", "0.01", "--gemm-size", "128",
               "--bandwidth-mib", "8", "--allreduce-mib", "1", "--iters", "2", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"versions", "gemm", "memory_bandwidth", "allreduce", "soak"}
    assert report["passed"] is True
    assert checks["gemm"]["passed"] is None and checks["gemm"]["measured"]["GFLOP/s"] > 0
    assert checks["memory_bandwidth"]["measured"]["GB/s"] > 0
    ar = checks["allreduce"]["measured"]
    assert ar["backend"] == "gloo" and ar["world_size"] == 2 and ar["correct"] is True
    assert abs(ar["busbw_bytes_per_s"] - ar["algbw_bytes_per_s"]) < 1e-6 * ar["algbw_bytes_per_s"]  # 2(n-1)/n = 1
    assert checks["soak"]["passed"] is True and checks["soak"]["measured"]["iterations"] >= 1
    assert "report written" in capsys.readouterr().out
