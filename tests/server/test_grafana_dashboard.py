"""examples/grafana/stoker.json: the script's output, and every metric it queries is one the
server exports, with samples once it has served (so no panel of it stays empty)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import httpx

from stoker.roofline.device_file import ENV_VAR, write_device_file
from tests.server.conftest import MODEL
from tests.server.test_wall_metrics import DEVICE

ROOT = Path(__file__).resolve().parents[2] / "examples" / "grafana"


def _script():
    spec = importlib.util.spec_from_file_location("make_dashboard", ROOT / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _queried_names(dashboard: dict) -> set[str]:
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names |= set(re.findall(r"\b((?:vllm|stoker):[A-Za-z0-9_:]+)", target["expr"]))
    return names


def test_the_json_is_the_scripts_output() -> None:
    assert (ROOT / "stoker.json").read_text() == _script().render(), "run python examples/grafana/make_dashboard.py"


def test_every_queried_metric_is_exported_with_samples(server_factory, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(write_device_file(DEVICE, tmp_path / "this.yaml")))
    live = server_factory()
    for prompt, n in (("The quick brown fox jumps over the lazy dog. " * 4, 8), ("Hi", 12)):
        r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                           "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
    exported = {line.split("{")[0].split(" ")[0] for line in httpx.get(live.url + "/metrics").text.splitlines()
                if line and not line.startswith("#")}
    names = _queried_names(json.loads((ROOT / "stoker.json").read_text()))
    assert len(names) >= 20
    missing = sorted(names - exported)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
