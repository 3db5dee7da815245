"""A 15 MB prompt against a live server: how long until it is answered, how long `/health`
stalls meanwhile, and how much the server process grows (issue 20).

The test server (tests/server/conftest.py: the tiny random checkpoint, max_model_len 256)
runs in this process; a second thread polls `/health` every 20 ms while one
`/v1/completions` request carries "lorem ipsum dolor sit amet " x 550,000 (15 MB). To compare
with an older commit, run this file from a checkout of it (it imports the stoker beside it).

    .venv/bin/python benchmarks/large_prompt.py
"""

from __future__ import annotations

import gc
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stoker.testing.tiny_checkpoint import make_tiny_checkpoint  # noqa: E402
from tests.server.conftest import MODEL, start_server  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    tmp_dir = tempfile.TemporaryDirectory()  # removed at exit, also when a run fails
    live = start_server(make_tiny_checkpoint(Path(tmp_dir.name), "llama"))
    try:
        rss_before = rss_mb()
        latencies: list[float] = []
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                start = time.perf_counter()
                httpx.get(live.url + "/health", timeout=120)
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

        poller = threading.Thread(target=probe)
        poller.start()
        time.sleep(0.3)
        prompt = "lorem ipsum dolor sit amet " * 550_000
        start = time.perf_counter()
        resp = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": prompt}, timeout=300)
        elapsed = time.perf_counter() - start
        time.sleep(0.5)
        done.set()
        poller.join()
        gc.collect()
        print(f"status {resp.status_code} after {elapsed:.2f} s: {resp.json()['error']['message'][:100]}")
        print(f"/health: {len(latencies)} probes, worst {max(latencies):.3f} s, median {sorted(latencies)[len(latencies) // 2]:.3f} s")
        print(f"server process RSS: {rss_before:.0f} MB before, {rss_mb():.0f} MB after")
    finally:
        live.stop()


if __name__ == "__main__":
    main()
