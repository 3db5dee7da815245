"""`stoker serve` with tensor parallelism, as processes: two "nodes" on 127.0.0.1, and a
worker killed under a running server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port
from tests.server.test_server_lifecycle import start_server

KV = ("--kv-cache-memory-bytes", str(1 << 22), "--device", "cpu")  # gloo, also on a GPU machine


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _complete(url: str) -> dict:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_two_nodes_on_loopback_serve_one_tp2_model(tiny_llama: Path, tmp_path: Path) -> None:
    """Node 1 finds the checkpoint at its own path (its MODEL_DIR), not node 0's."""
    import shutil

    node1_copy = shutil.copytree(tiny_llama, tmp_path / "node1-checkpoint")
    port = free_port()
    dist = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    with (tmp_path / "node1.log").open("w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "stoker", "serve", str(node1_copy), *dist, "--node-rank", "1",
                                  "--headless", "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT)
    node0 = None
    try:
        node0, url = start_server(tiny_llama, tmp_path / "node0.log", *dist, "--node-rank", "0", *KV)
        text = _complete(url)["choices"][0]["text"]
        assert text == _complete(url)["choices"][0]["text"]  # greedy, repeatable
        node0.send_signal(signal.SIGTERM)
        node0.wait(60)
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        for p in (node0, node1):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    log1 = (tmp_path / "node1.log").read_text()
    assert "ranks exited with [0]" in log1 and f"loaded from {node1_copy}" in log1


def test_a_killed_worker_turns_health_503_and_leaves_no_process(tiny_llama: Path, tmp_path: Path) -> None:
    proc, url = start_server(tiny_llama, tmp_path / "server.log", "--tensor-parallel-size", "2", *KV)
    try:
        _complete(url)
        workers = _children(proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503 after a worker died"
            time.sleep(0.2)
        resp = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4}, timeout=30)
        assert resp.status_code == 503 and "error" in resp.json()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not any(_alive(pid) for pid in workers)
    assert "exited with code -9" in (tmp_path / "server.log").read_text()


# Runs alone (`make test`'s second phase). Rank 0 used to abort after RESULT ("terminate called
# without an active exception", SIGABRT, ~5% of runs): a gloo worker thread dropping the last
# broadcast's tensors took the GIL during interpreter finalization. The script leaves the LLM to
# the interpreter's exit on purpose: shutdown at exit now waits for gloo to let go (TensorParallelGroup.drain).
@pytest.mark.serial
def test_torchrun_starts_every_rank_the_same_script_runs(tiny_llama: Path, tmp_path: Path) -> None:
    """Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT from its env:// rendezvous) the same
    offline script runs on every rank: rank 0 generates, rank 1 serves it as a worker and exits."""
    import shutil

    from stoker import LLM, SamplingParams

    script = tmp_path / "gen.py"
    script.write_text(
        "from stoker import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_llama)!r}, kv_cache_memory_bytes=1 << 22, max_model_len=256, device='cpu', tensor_parallel_size=2)\n"
        "out = llm.generate([{'prompt_token_ids': [1, 17, 300, 42]}], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)\n"
        "print('RESULT', out[0].outputs[0].token_ids, flush=True)\n"
    )
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"stdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}"
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    llm = LLM(str(tiny_llama), kv_cache_memory_bytes=1 << 22, max_model_len=256, device="cpu")
    want = llm.generate([{"prompt_token_ids": [1, 17, 300, 42]}], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert results == [f"RESULT {want[0].outputs[0].token_ids}"]  # printed once: by rank 0


def test_a_headless_node_refuses_settings_only_node_0_honours(tiny_llama: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stoker", "serve", str(tiny_llama), "--tensor-parallel-size", "2",
                           "--nnodes", "2", "--node-rank", "1", "--master-port", str(free_port()), "--headless",
                           "--max-model-len", "64", "--port", "9"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--max-model-len, --port: a --headless node takes every engine and server setting from node 0" in proc.stderr
