"""A real uvicorn server on a free loopback port, in a thread of the test process, serving a
tiny random checkpoint. In-process so tests can also look at the engine's block manager."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def state(self) -> Any:
        return self.app.state.stoker

    @property
    def engine(self) -> Any:
        """The LLMEngine behind the server's AsyncEngine, which the server itself never reaches:
        tests read it (only while no request is in flight) to check the KV cache."""
        return self.state.engine._engine

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels) -> value, from GET /metrics."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        """One sample by name, ignoring labels (the first match)."""
        for key, value in self.metrics().items():
            if key == name or key.startswith(name + "{"):
                return value
        raise KeyError(name)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no sequence runs or waits and the KV cache is empty again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.metric("vllm:num_requests_running") == 0 and self.metric("vllm:num_requests_waiting") == 0
                    and self.metric("vllm:kv_cache_usage_perc") == 0):
                return
            time.sleep(0.05)
        raise AssertionError(f"server not idle after {timeout} s: {self.metrics()}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_serve_process(args: list[str], log_path: Path, timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`python -m stoker serve ARGS` on a free port of 127.0.0.1, logging to log_path; returns
    (process, url) once /v1/health/ready answers 200 (AssertionError with the log's tail if the
    process exits or is not ready in time). The command a user runs, in a fresh interpreter."""
    import httpx

    port = free_port()
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "stoker", "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(log_path.read_text()[-3000:])
        try:
            if httpx.get(url + "/v1/health/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise AssertionError("not ready: " + log_path.read_text()[-3000:])
        time.sleep(0.2)


def stop_process(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_app(app: Any, ready_path: str = "/v1/health/ready", http: Any = None, timeout_s: float = 60) -> LiveServer:
    """`app` under a real uvicorn in a daemon thread on a free loopback port, once `ready_path`
    answers 200 (the caller stops it: LiveServer.stop)."""
    import uvicorn

    port = free_port()
    extra = {"http": http} if http is not None else {}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           **extra))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app, server, thread)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(live.url + ready_path, timeout=2) as resp:
                if resp.status == 200:
                    return live
        except OSError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            live.stop()
            raise RuntimeError(f"test server did not answer {ready_path} within {timeout_s:g} s")
        time.sleep(0.05)


def start_server(ckpt: Path, engine_kwargs: dict[str, Any] | None = None, h11: bool = False,
                 **settings: Any) -> LiveServer:
    """h11: run the pure-Python fallback protocol (what a machine without httptools serves)."""
    from stoker.engine.llm import LLM
    from stoker.server.app import create_app
    from stoker.server.http.limits import _H11WithHeaderTimeout, header_timeout_protocol
    from stoker.server.state import ServerSettings

    kwargs = {"max_model_len": 256, "num_gpu_blocks_override": 512, "seed": 0, **(engine_kwargs or {})}
    base = ServerSettings(model_path=str(ckpt), served_model_names=(MODEL,), log_interval_s=3600)
    full = replace(base, **settings)
    app = create_app(full, lambda: LLM(str(ckpt), **kwargs).engine)
    # The protocol `stoker serve` runs (httptools, or h11 without it, with a deadline for headers).
    protocol = (type("H11", (_H11WithHeaderTimeout,), {"header_timeout_s": full.header_read_timeout_s}) if h11
                else header_timeout_protocol(full.header_read_timeout_s))
    return serve_app(app, http=protocol)


@pytest.fixture(scope="session")
def server_factory(tiny_llama: Path) -> Iterator[Callable[..., LiveServer]]:
    """Start extra servers (own settings) on the session's tiny checkpoint; all stopped at the end."""
    started: list[LiveServer] = []

    def make(engine_kwargs: dict[str, Any] | None = None, h11: bool = False, **settings: Any) -> LiveServer:
        live = start_server(tiny_llama, engine_kwargs, h11, **settings)
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


@pytest.fixture(scope="session")
def live_server(server_factory: Callable[..., LiveServer]) -> LiveServer:
    return server_factory()


@pytest.fixture
def client(live_server: LiveServer) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def _shared_server_whole_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Issue 20: after every test that used the shared server, all its KV blocks are free and
    its engine is alive (a test that leaks a block or kills the engine fails here)."""
    yield
    if "live_server" not in request.fixturenames:
        return
    live = request.getfixturevalue("live_server")
    live.wait_idle(30)
    engine = live.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "a KV block leaked"
    engine.check_integrity()
    assert not live.state.engine.is_dead, "the shared server's engine died"
    with urllib.request.urlopen(live.url + "/health", timeout=10) as resp:
        assert resp.status == 200
