"""Bad input, auth, back-pressure, disconnects and failures: right status, OpenAI error shape."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from tests.server.conftest import MODEL, LiveServer

CHAT = [{"role": "user", "content": "hi"}]


def _assert_error(resp: httpx.Response, status: int, param: str | None = "", text: str = "") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert err["code"] == status and isinstance(err["message"], str) and err["type"].endswith("Error")
    if param != "":
        assert err["param"] == param, err
    assert text in err["message"], err
    return err


BAD = [
    ("completions", {"prompt": "x", "temperature": -1}, "temperature", "[0, 2]"),
    ("completions", {"prompt": "x", "temperature": 2.5}, "temperature", "[0, 2]"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k", ""),
    ("completions", {"prompt": "x", "min_p": 1.5}, "min_p", "[0, 1]"),
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("completions", {"prompt": "x", "n": 0}, "n", ""),
    ("completions", {"prompt": "x", "n": 1000}, "n", ""),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1 token"),
    ("completions", {"prompt": "x", "max_tokens": 300}, "max_tokens", "maximum context length is 256"),
    ("completions", {"prompt": "hello " * 300}, "", "maximum context length is 256"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop", "non-empty"),
    ("completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens", ""),
    ("completions", {"prompt": "x", "seed": 2**70}, "seed", ""),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature", ""),
    ("completions", {"prompt": []}, "prompt", "empty"),
    ("completions", {"prompt": [5, 99999]}, "prompt", "[0, 1024)"),
    ("completions", {"prompt": [-1]}, "prompt", ""),
    ("completions", {"prompt": 5}, "prompt", ""),
    ("completions", {}, "prompt", "Field required"),
    ("completions", {"prompt": "x", "stream_options": "yes"}, "stream_options", ""),
    ("chat/completions", {"messages": []}, "messages", ""),
    ("chat/completions", {"messages": "hi"}, "messages", ""),
    ("chat/completions", {"messages": [{"content": "no role"}]}, "messages", ""),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "[0, 20]"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 1000}, "max_completion_tokens", "maximum context length"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, "messages", "maximum context length"),
]


@pytest.mark.parametrize("endpoint,body,param,text", BAD, ids=[f"{e}:{json.dumps(b)[:40]}" for e, b, _, _ in BAD])
def test_bad_input_is_400(live_server: LiveServer, endpoint: str, body: dict, param: str | None, text: str) -> None:
    resp = httpx.post(f"{live_server.url}/v1/{endpoint}", json={"model": MODEL, **body}, timeout=30)
    _assert_error(resp, 400, param, text)


def test_context_message_has_the_numbers(live_server: LiveServer) -> None:
    resp = httpx.post(f"{live_server.url}/v1/completions", json={"prompt": [1] * 250, "max_tokens": 10}, timeout=30)
    err = _assert_error(resp, 400, "max_tokens", "maximum context length is 256 tokens")
    assert "260" in err["message"] and "250" in err["message"] and "10" in err["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x", "temperature": NaN}',
                                 b'{"prompt": "x", "top_p": Infinity}', b"\xff\xfe"])
def test_malformed_bodies_are_400(live_server: LiveServer, raw: bytes) -> None:
    resp = httpx.post(f"{live_server.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=30)
    _assert_error(resp, 400)


def test_oversized_body_is_413(server_factory) -> None:
    live = server_factory(max_request_body_bytes=1000)
    resp = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x" * 2000}, timeout=30)
    _assert_error(resp, 413, None, "1000 bytes")

    def chunks():  # no Content-Length: counted while read
        for _ in range(5):
            yield b" " * 400
        yield b'{"prompt": "x"}'

    resp = httpx.post(f"{live.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    _assert_error(resp, 413)
    assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200


def test_unknown_model_is_404_and_unknown_fields_ignored(live_server: LiveServer) -> None:
    resp = httpx.post(f"{live_server.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}, timeout=30)
    _assert_error(resp, 404, "model", "gpt-9")
    resp = httpx.post(f"{live_server.url}/v1/chat/completions", json={"model": "gpt-9", "messages": CHAT}, timeout=30)
    _assert_error(resp, 404, "model")
    ok = httpx.post(f"{live_server.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1}, "logit_bias": {"5": 1}, "user": "u", "suffix": None})
    assert ok.status_code == 200, ok.text
    _assert_error(httpx.get(f"{live_server.url}/v1/nope", timeout=30), 404)
    _assert_error(httpx.get(f"{live_server.url}/v1/completions", timeout=30), 405)


def test_api_key(server_factory) -> None:
    live = server_factory(api_key="sekrit")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        resp = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}, headers=headers, timeout=30)
        _assert_error(resp, 401, None, "API key")
    _assert_error(httpx.get(f"{live.url}/v1/models", timeout=30), 401)
    _assert_error(httpx.post(f"{live.url}/tokenize", json={"prompt": "x"}, timeout=30), 401)
    for path in ("/health", "/v1/health/live", "/v1/health/ready", "/metrics"):
        assert httpx.get(live.url + path, timeout=30).status_code == 200, path
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = OpenAI(base_url=live.url + "/v1", api_key="sekrit", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_queue_full_is_503_with_retry_after(server_factory) -> None:
    live = server_factory(engine_kwargs={"max_num_seqs": 1}, max_waiting_requests=1)
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2:
        with c1.stream("POST", f"{live.url}/v1/completions", json=body) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it runs
            with c2.stream("POST", f"{live.url}/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200  # admitted; waits for the one slot
                resp = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}, timeout=30)
                _assert_error(resp, 503, None, "busy")
                assert int(resp.headers["retry-after"]) >= 1
    live.wait_idle()
    assert live.metrics()['stoker:requests_rejected_total{model_name="tiny-llama",status="503"}'] >= 1


def _kv_blocks_used(live: LiveServer) -> float:
    return live.metric("stoker:kv_cache_total_blocks") - live.metric("stoker:kv_cache_free_blocks")


def _slow_steps(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """10 ms per step, so a 240-token request is surely still running when the client leaves."""
    real_step = live.engine.step

    def slow_step():
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(live.engine, "step", slow_step)


def test_disconnect_mid_stream_frees_blocks(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    live_server.wait_idle()
    _slow_steps(live_server, monkeypatch)
    aborted_before = live_server.metrics().get('vllm:request_success_total{finished_reason="abort",model_name="tiny-llama"}', 0)
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{live_server.url}/v1/completions", json=body) as resp:
            # Keep the iterator referenced: dropping it would close the connection early.
            lines = resp.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data:")
            assert _kv_blocks_used(live_server) > 0 and live_server.metric("vllm:kv_cache_usage_perc") > 0
    # Closing the connection mid-stream aborts the request: its blocks come back.
    live_server.wait_idle()
    assert _kv_blocks_used(live_server) == 0
    bm = live_server.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    live_server.engine.check_integrity()
    after = live_server.metrics()['vllm:request_success_total{finished_reason="abort",model_name="tiny-llama"}']
    assert after == aborted_before + 1


def test_disconnect_non_streaming_frees_blocks(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    live_server.wait_idle()
    _slow_steps(live_server, monkeypatch)
    key = 'vllm:request_success_total{finished_reason="abort",model_name="tiny-llama"}'
    aborted_before = live_server.metrics().get(key, 0)
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 240, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=0.3)
    live_server.wait_idle()
    assert _kv_blocks_used(live_server) == 0
    assert live_server.metrics()[key] == aborted_before + 1


def test_one_failing_request_fails_alone(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.server.generate.completion import OpenAIServingCompletion

    def boom(*args, **kwargs):
        raise RuntimeError("formatting bug")

    monkeypatch.setattr(OpenAIServingCompletion, "_logprobs", staticmethod(boom))
    results: dict[str, httpx.Response] = {}

    def call(name: str, body: dict) -> None:
        results[name] = httpx.post(f"{live_server.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)

    threads = [threading.Thread(target=call, args=("bad", {"prompt": "x", "max_tokens": 30, "logprobs": 1})),
               threading.Thread(target=call, args=("good", {"prompt": "y", "max_tokens": 30, "ignore_eos": True}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _assert_error(results["bad"], 500, None, "formatting bug")
    assert results["good"].status_code == 200 and results["good"].json()["usage"]["completion_tokens"] == 30
    # The streamed variant reports the failure in-band and still ends with [DONE].
    with httpx.stream("POST", f"{live_server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 5, "logprobs": 1, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert httpx.get(live_server.url + "/health", timeout=30).status_code == 200
    live_server.wait_idle()


def test_engine_death_is_503(server_factory) -> None:
    live = server_factory()
    engine = live.engine
    real_step = engine.step

    def dying_step():
        if any(r.request.prompt_token_ids[-1:] == [13] for r in engine.requests.values()):
            raise RuntimeError("simulated CUDA error")
        return real_step()

    engine.step = dying_step
    resp = httpx.post(f"{live.url}/v1/completions", json={"prompt": [13], "max_tokens": 5}, timeout=30)
    _assert_error(resp, 500, None, "simulated CUDA error")
    deadline = time.monotonic() + 10
    while httpx.get(live.url + "/health", timeout=30).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _assert_error(httpx.get(live.url + "/v1/health/ready", timeout=30), 503)
    _assert_error(httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}, timeout=30), 503)
    assert live.metric("stoker:engine_healthy") == 0


def test_metrics_names(live_server: LiveServer, client: OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"ignore_eos": True})
    m = live_server.metrics()
    label = 'model_name="tiny-llama"'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert f"{name}{{{label}}}" in m, name
    for hist in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert m[f"{hist}_count{{{label}}}"] >= 1, hist
    assert m[f'vllm:request_success_total{{finished_reason="length",{label}}}'] >= 1
    assert m[f"vllm:generation_tokens_total{{{label}}}"] >= 4


def test_live_before_ready(tiny_llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the model loads, live answers 200 and ready / the API answer 503."""
    import uvicorn

    from stoker.engine.llm import LLM
    from stoker.server.app import create_app
    from stoker.server.state import ServerSettings
    from tests.server.conftest import free_port

    gate = threading.Event()

    def slow_factory():
        gate.wait(30)
        return LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks_override=64).engine

    app = create_app(ServerSettings(str(tiny_llama), (MODEL,)), slow_factory)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                resp = httpx.get(url + "/v1/health/live", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert resp.status_code == 200
        _assert_error(httpx.get(url + "/v1/health/ready", timeout=5), 503, None, "loading")
        # vLLM's /health means ready: scripts and Helm charts poll it before sending traffic
        _assert_error(httpx.get(url + "/health", timeout=5), 503, None, "loading")
        _assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=5), 503)
        gate.set()
        while httpx.get(url + "/v1/health/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline + 30
            time.sleep(0.05)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        gate.set()
        server.should_exit = True
        thread.join(30)


def test_loopback_only_default() -> None:
    from stoker.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.model_dir is None
    assert socket.inet_aton(args.host)
