"""End to end: `stoker bench serve` against a real `stoker serve` on a tiny random checkpoint.

Counts add up, TTFT <= E2EL for every request, and with --ignore-eos every output is
exactly the asked number of tokens (from the server's usage.completion_tokens).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("stoker.server.app")
tiny = pytest.importorskip("stoker.testing.tiny_checkpoint")

from stoker.cli import main  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    ckpt = tiny.make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", arch="llama")
    # A device file for the server's wall verdict (the counters bench serve differences).
    from tests.server.test_wall_metrics import DEVICE
    from stoker.roofline.device_file import ENV_VAR, write_device_file

    device_file = write_device_file(DEVICE, tmp_path_factory.mktemp("dev") / "this.yaml")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "stoker", "serve", str(ckpt), "--host", "127.0.0.1",
                             "--port", str(port), "--max-model-len", "512"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, ENV_VAR: str(device_file)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"stoker serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/health/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("stoker serve not ready within 120 s")
            time.sleep(0.5)
        yield url, ckpt
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_against_stoker_serve(server: tuple[str, Path], endpoint: str, tmp_path: Path) -> None:
    url, ckpt = server
    out = tmp_path / "run.json"
    rc = main(["bench", "serve", "--base-url", url, "--endpoint", endpoint, "--num-prompts", "8",
               "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos",
               "--tokenizer", str(ckpt), "--max-concurrency", "4", "--request-timeout", "60",
               "--disable-tqdm", "--save-result", str(out)])
    d = json.loads(out.read_text())
    assert rc == 0, d["errors"]
    assert d["completed"] + d["failed"] == d["num_prompts"] == 8
    assert d["failed"] == 0, d["failures"]
    assert d["output_tokens_source"] == "usage"
    assert d["output_lens"] == [8] * 8 and d["total_output_tokens"] == 64
    assert all(0 < t <= e for t, e in zip(d["ttfts"], d["e2els"]))
    assert d["max_concurrent_requests"] <= 4
    assert d["models"]["data"], "the /v1/models answer is saved"
    # the server's own verdict over exactly this run's steps: 8 requests x 8 tokens
    wall = d["server_wall"]
    assert wall["available"] and wall["device"] == "this" and wall["profile"] == "measured"
    steps = sum(k["steps"] for k in wall["kinds"].values())
    assert 8 <= steps <= 8 * 8 + 8, wall  # at least one step per token position, at most one per token
    assert all(0 < k["mbu"] < 1 and k["measured_over_predicted"] > 0 for k in wall["kinds"].values()), wall
