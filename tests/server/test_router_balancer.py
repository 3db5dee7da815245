"""`stoker router` as a replica balancer over two real `stoker serve` apps (uvicorn on loopback,
tiny random checkpoint), driven by the official `openai` client: completions, chat, streaming,
load spreading, prefix affinity, the `stoker router` command itself, and a dead replica."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from stoker.router.app import create_app
from stoker.router.config import RouterConfig
from tests.server.conftest import MODEL, LiveServer, free_port, serve_app, start_server, stop_process
from tests.server.test_router_disagg import metric


@pytest.fixture(scope="module")
def replicas(tiny_llama) -> Iterator[list[LiveServer]]:
    servers = [start_server(tiny_llama), start_server(tiny_llama)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def router(replicas) -> Iterator[LiveServer]:
    cfg = RouterConfig(workers=tuple(s.url for s in replicas), metrics_interval_s=0.2, health_check_interval_s=0.2)
    live = serve_app(create_app(cfg), ready_path="/health")
    yield live
    live.stop()
    for s in replicas:  # every request through the router ended whole on its server
        if s.thread.is_alive():
            s.wait_idle(30)
            s.engine.check_integrity()
            assert s.engine.block_manager.num_free_blocks == s.engine.block_manager.num_blocks


def _client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _served(server: LiveServer) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("vllm:request_success_total"))


def test_completions_and_chat_equal_a_direct_server(router, replicas):
    via, direct = _client(router.url), _client(replicas[0].url)
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert via.completions.create(**kw).choices[0].text == direct.completions.create(**kw).choices[0].text
    msgs = [{"role": "user", "content": "Say something."}]
    a = via.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    b = direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert [m.id for m in via.models.list().data] == [MODEL]
    assert httpx.get(router.url + "/health").status_code == 200
    # the servers' own /metrics are scraped: their KV usage gauge is read (0 <= x <= 1)
    for up in router.app.state.router.pool.upstreams:
        deadline = time.monotonic() + 5
        while up.scraped_at == 0:
            assert time.monotonic() < deadline, f"{up.url} never scraped"
            time.sleep(0.05)
        assert 0 <= up.kv_usage <= 1 and up.healthy


def test_streaming_completions_and_chat(router, replicas):
    via, direct = _client(router.url), _client(replicas[1].url)
    kw = dict(model=MODEL, prompt="The sea", max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].text for c in via.completions.create(**kw, stream=True))
    assert streamed == direct.completions.create(**kw).choices[0].text
    msgs = [{"role": "user", "content": "Hello"}]
    chunks = list(via.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                                  temperature=0).choices[0].message.content
    assert metric(router.url, "stoker_router:time_to_first_token_seconds_count", route="aggregated") == 2


def test_distinct_prompts_spread_over_both_replicas(router, replicas):
    before = [_served(s) for s in replicas]
    via = _client(router.url)
    prompts = [f"{i} distinct prompt number {i} about topic {i * 7}" for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: via.completions.create(model=MODEL, prompt=p, max_tokens=4), prompts))
    got = [_served(s) - b for s, b in zip(replicas, before)]
    assert sum(got) == 8 and min(got) >= 3, got


def test_shared_prefix_sticks_to_one_replica(router, replicas):
    before = [_served(s) for s in replicas]
    system = "You are a careful assistant for a shipping company. " * 4  # ~210 characters shared
    via = _client(router.url)
    for q in ("Where is my parcel?", "Can I change the address?", "How long does it take?", "What does it cost?"):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        via.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    got = sorted(_served(s) - b for s, b in zip(replicas, before))
    assert got == [0, 4], got


def test_stoker_router_command(replicas, tmp_path):
    port = free_port()
    log = (tmp_path / "router.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "stoker", "router", "--worker-urls", *[s.url for s in replicas],
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "router not up"
            time.sleep(0.2)
        out = _client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
        assert metric(url, "stoker_router:requests_total", route="aggregated") == 1
    finally:
        stop_process(proc, 10)
        log.close()


def test_dead_replica_is_skipped(tiny_llama, replicas):
    doomed = start_server(tiny_llama)
    cfg = RouterConfig(workers=(replicas[0].url, doomed.url), metrics_interval_s=0.2, health_check_interval_s=0.2)
    live = serve_app(create_app(cfg), ready_path="/health")
    try:
        doomed.stop()  # as a killed process: its port refuses connections
        via = _client(live.url)
        before = _served(replicas[0])
        for i in range(4):  # the first may hit the dead one: retried on the live one, unseen by the client
            assert via.completions.create(model=MODEL, prompt=f"after the crash {i}", max_tokens=2).choices[0].text
        assert _served(replicas[0]) - before == 4
        assert metric(live.url, "stoker_router:upstream_healthy", upstream=doomed.url) == 0
        assert metric(live.url, "stoker_router:upstream_healthy", upstream=replicas[0].url) == 1
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        live.stop()


def test_client_leaving_mid_stream_aborts_the_request_upstream(router, replicas):
    """The router closes its upstream stream when the client goes: the server aborts the
    request (finish reason "abort") and frees its KV blocks (the fixture checks them)."""
    def aborted() -> float:
        return sum(v for s in replicas for k, v in s.metrics().items()
                   if k.startswith("vllm:request_success_total") and 'finished_reason="abort"' in k)

    before = aborted()
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", router.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # the first chunk, then hang up
    deadline = time.monotonic() + 20
    while aborted() == before:
        assert time.monotonic() < deadline, "the server never saw the client leave"
        time.sleep(0.05)


def test_disaggregated_short_prompts_prefill_on_a_real_decode_server(replicas):
    """Prompt tokens are counted by the decode server's own /tokenize (prompt and chat forms):
    short prompts are served whole by the decode server, the prefill server untouched."""
    prefill, decode = replicas
    cfg = RouterConfig(prefill=(prefill.url,), decode=(decode.url,), max_local_prefill_length=1000)
    live = serve_app(create_app(cfg), ready_path="/health")
    try:
        before = [_served(s) for s in replicas]
        via = _client(live.url)
        assert via.completions.create(model=MODEL, prompt="Short prompt", max_tokens=3).usage.completion_tokens == 3
        msgs = [{"role": "user", "content": "Short chat"}]
        assert via.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3).choices[0].message.content
        assert [_served(s) - b for s, b in zip(replicas, before)] == [0, 2]
        assert metric(live.url, "stoker_router:local_prefill_reasons_total", reason="short_prompt") == 2
        assert metric(live.url, "stoker_router:upstream_errors_total") == 0  # /tokenize answered both forms
    finally:
        live.stop()
