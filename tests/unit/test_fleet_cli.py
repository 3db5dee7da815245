"""`stoker fleet plan` end to end, bad input, and the no-torch rule for stoker.fleet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stoker.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet"


def test_fleet_never_imports_torch():
    code = ("import sys, stoker.fleet.cli, stoker.fleet.plan, stoker.fleet.manifests, stoker.fleet.report; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plan_cli_json(tmp_path, capsys):
    rc = main(["fleet", "plan", "--fleet", str(EXAMPLE / "fleet.yaml"),
               "--deployments", str(EXAMPLE / "deployments.yaml"), "--out", str(tmp_path), "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus_after"] < data["gpus_before"] and data["unplaced"] == []
    assert (tmp_path / "mig-parted.yaml").is_file() and (tmp_path / "report.md").is_file()
    assert len(list((tmp_path / "k8s").glob("*.yaml"))) == 7


def _write(tmp_path: Path, name: str, data) -> str:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


@pytest.mark.parametrize("fleet, message", [
    ("nodes: [\n", "not valid YAML"),
    ({"nodes": [{"name": "a", "gpu": "T4000", "count": 1}]}, "unknown GPU model"),
    ({"nodes": [{"name": "a", "gpu": "H100", "count": 1, "colour": "red"}]}, "unknown key"),
    ({"nodes": [{"name": "A_b", "gpu": "H100", "count": 1}]}, "DNS label"),
])
def test_bad_fleet_is_one_line_exit_2(tmp_path, capsys, fleet, message):
    deps = _write(tmp_path, "d.yaml", {"deployments": [{"name": "x", "model": "m", "memory_gib": 4}]})
    rc = main(["fleet", "plan", "--fleet", _write(tmp_path, "f.yaml", fleet), "--deployments", deps,
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing written on bad input


def test_unknown_model_preset_is_a_value_error(tmp_path, capsys):
    fleet = _write(tmp_path, "f.yaml", {"nodes": [{"name": "a", "gpu": "H100", "count": 1}]})
    deps = _write(tmp_path, "d.yaml", {"deployments": [{"name": "x", "model": "no-such-model-9b"}]})
    rc = main(["fleet", "plan", "--fleet", fleet, "--deployments", deps, "--out", str(tmp_path / "o")])
    assert rc == 2 and "preset" in capsys.readouterr().err


def test_infeasible_is_reported(tmp_path, capsys):
    fleet = _write(tmp_path, "f.yaml", {"nodes": [{"name": "a", "gpu": "A100-40GB", "count": 1}]})
    deps = _write(tmp_path, "d.yaml", {"deployments": [
        {"name": "big", "model": "m", "memory_gib": 300},
        {"name": "small", "model": "m", "memory_gib": 3, "replicas": 2}]})
    rc = main(["fleet", "plan", "--fleet", fleet, "--deployments", deps, "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 1 and "not placed: big/0" in out
    report = (tmp_path / "o" / "report.md").read_text()
    assert "big/0" in report and "no GPU model in the fleet can host it" in report
    assert not (tmp_path / "o" / "k8s" / "big.yaml").exists()
