"""Issue 20's findings, each through a live server: no input a client can send answers 5xx or
takes the engine down, and every test ends with all KV blocks free and the engine alive."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer


def _error(resp: httpx.Response, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


@pytest.fixture(autouse=True)
def _uses_the_shared_server(live_server: LiveServer) -> None:
    """Every test here is followed by conftest's whole-server check, even those that start
    their own server."""


# A lone surrogate: valid JSON, not valid Unicode.
SURROGATE = '"\\ud800"'


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"model": "%s", "prompt": %s}' % (MODEL, SURROGATE)),
    ("/v1/completions", '{"model": %s, "prompt": "x"}' % SURROGATE),
    ("/v1/completions", '{"model": "%s", "prompt": ["ok", %s]}' % (MODEL, SURROGATE)),
    ("/v1/completions", '{"model": "%s", "prompt": "x", "stop": [%s]}' % (MODEL, SURROGATE)),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (MODEL, SURROGATE)),
    ("/v1/chat/completions", '{"model": %s, "messages": [{"role": "user", "content": "x"}]}' % SURROGATE),
    ("/tokenize", '{"model": "%s", "prompt": %s}' % (MODEL, SURROGATE)),
    ("/detokenize", '{"model": %s, "tokens": [1]}' % SURROGATE),
])
def test_lone_surrogates_are_400(live_server: LiveServer, path: str, body: str) -> None:
    resp = httpx.post(live_server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    err = _error(resp, 400, "is not valid Unicode")
    field = err["message"].split(" ", 1)[0]
    assert field.split(".")[0] == err["param"] and err["param"] in body.replace("\\ud800", "")


def test_500_closes_the_connection_and_the_pool_carries_on(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An internal bug answers 500 with Connection: close, so a pooled client's next request
    opens a new connection instead of failing on a reset one."""
    tokenization = live_server.state.tokenization
    real = tokenization.encode

    async def broken(text: str, *args, **kwargs):
        if text == "boom":
            raise RuntimeError("a planted bug")
        return await real(text, *args, **kwargs)

    monkeypatch.setattr(tokenization, "encode", broken)
    with httpx.Client(base_url=live_server.url, timeout=30) as client:
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2})
        assert ok.status_code == 200
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 2})
        _error(resp, 500, "RuntimeError: a planted bug")
        assert resp.headers["connection"] == "close"
        for _ in range(3):
            assert client.post("/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2}).status_code == 200


def test_sequences_per_request_are_bounded(live_server: LiveServer) -> None:
    """prompts x n beyond the engine's max_num_seqs is refused before anything is queued."""
    limit = live_server.state.max_num_seqs
    prompts = ["x"] * (limit // 2 + 1)
    resp = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 1},
                      timeout=30)
    err = _error(resp, 400, f"asks for {2 * len(prompts)} sequences", f"at most {limit}")
    assert err["param"] == "n"
    ok = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL, "prompt": ["x", "y"], "n": 3, "max_tokens": 1},
                    timeout=30)
    assert len(ok.json()["choices"]) == 6


def test_waiting_queue_counts_sequences(server_factory) -> None:
    live = server_factory(max_waiting_requests=4)
    resp = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 5, "max_tokens": 1}, timeout=30)
    err = _error(resp, 400, "n = 5 sequences can never fit the waiting queue of 4")
    assert err["param"] == "n"
    ok = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 4, "max_tokens": 1}, timeout=30)
    assert len(ok.json()["choices"]) == 4
    live.wait_idle()


def test_a_huge_prompt_is_refused_without_tokenizing_it_all(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenization = live_server.state.tokenization
    seen: list[tuple[int, str]] = []
    real_encode = tokenization.tokenizer.encode

    def spy(text: str, *args, **kwargs):
        seen.append((len(text), threading.current_thread().name))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenization.tokenizer, "encode", spy)
    prompt = "lorem ipsum dolor sit amet " * 200_000  # 5.4 MB of text
    resp = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt}, timeout=60)
    _error(resp, 400, "maximum context length is 256 tokens", "your prompt has at least")
    bound = (256 + 2) * tokenization.max_chars_per_token
    assert seen and all(n <= bound for n, _ in seen), "only a bounded prefix is tokenized"
    assert all(name.startswith("stoker-tokenizer") for _, name in seen), "tokenization runs off the event loop"
    chat = httpx.post(live_server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": prompt}]}, timeout=60)
    err = _error(chat, 400, "your prompt has at least")
    assert err["param"] == "messages"


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(live_server: LiveServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    runner = live_server.engine.executor.driver_runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("planted fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", flaky)
    resp = httpx.post(live_server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "x", "max_tokens": 8, "ignore_eos": True}, timeout=30)
    _error(resp, 500, "generation failed: RuntimeError: planted fault")
    assert not live_server.state.engine.is_dead
    ok = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200


def test_an_engine_that_fails_every_step_is_reported_dead(server_factory) -> None:
    live = server_factory()
    runner = live.engine.executor.driver_runner

    def broken(*args, **kwargs):
        raise RuntimeError("the device is gone")

    runner.execute = broken
    for _ in range(3):
        resp = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}, timeout=30)
        assert resp.status_code in (500, 503), resp.text
    assert live.state.engine.is_dead
    _error(httpx.get(live.url + "/health", timeout=10), 503)
    _error(httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30), 503, "restart")


def _raw_exchange(url: str, payload: bytes, wait_s: float) -> bytes:
    """Send raw bytes, then read whatever the server answers until it closes (or wait_s + 10 s)."""
    import socket
    import time

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s + 10) as sock:
        sock.sendall(payload)
        start, data = time.monotonic(), b""
        while time.monotonic() - start < wait_s + 10:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_slow_headers_and_stalled_bodies_get_408(server_factory) -> None:
    live = server_factory(header_read_timeout_s=0.5, body_read_timeout_s=0.5)
    partial_headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
    answer = _raw_exchange(live.url, partial_headers, 0.5)
    assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive within 0.5 s" in answer
    stalled_body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro"
    answer = _raw_exchange(live.url, stalled_body, 0.5)
    assert answer.startswith(b"HTTP/1.1 408") and b"request body stalled" in answer and b"connection: close" in answer.lower()
    # A prompt client on a kept-alive connection is unaffected by either deadline.
    with httpx.Client(base_url=live.url, timeout=30) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200
    live.wait_idle()


def test_both_http_protocols_keep_the_header_deadline_and_the_error_shape(server_factory) -> None:
    """httptools (what `stoker serve` runs when installed) and the h11 fallback answer alike."""
    import json

    from stoker.server.http.limits import HttpToolsProtocol, header_timeout_protocol

    assert HttpToolsProtocol is not None and issubclass(header_timeout_protocol(1.0), HttpToolsProtocol)
    for h11 in (False, True):
        live = server_factory(h11=h11, header_read_timeout_s=0.5)
        answer = _raw_exchange(live.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty", 0.5)
        assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive within 0.5 s" in answer, (h11, answer)
        head, _, body = _raw_exchange(live.url, b"GARBAGE / NOT-HTTP\r\n\r\n", 5).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["message"].startswith("malformed HTTP"), h11
        with httpx.Client(base_url=live.url, timeout=30) as client:  # keep-alive: the deadline re-arms, no 408
            for _ in range(2):
                assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200
                time.sleep(0.7)
        live.wait_idle()


def test_keys_in_query_strings_never_reach_the_access_log() -> None:
    import logging

    from stoker.server.http.limits import RedactSecrets, redact

    assert redact("/v1/models?api_key=sk-123&x=1") == "/v1/models?api_key=REDACTED&x=1"
    assert redact("/v1/models?token=abc;Authorization=Bearer%20q") == "/v1/models?token=REDACTED;Authorization=REDACTED"
    assert redact("/v1/models?limit=5") == "/v1/models?limit=5"
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:1", "GET", "/v1/models?api_key=sk-live", "1.1", 401), None)
    RedactSecrets().filter(record)
    assert "sk-live" not in record.getMessage() and "api_key=REDACTED" in record.getMessage()
    assert any(isinstance(f, RedactSecrets) for f in logging.getLogger("uvicorn.access").filters)


def test_malformed_http_gets_the_openai_error_shape(live_server: LiveServer) -> None:
    import json

    answer = _raw_exchange(live_server.url, b"GARBAGE / NOT-HTTP\r\n\r\n", 5)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == 400 and err["message"].startswith("malformed HTTP request")


@pytest.mark.parametrize("field, flag", [("header_read_timeout_s", "--header-read-timeout"),
                                         ("body_read_timeout_s", "--body-read-timeout")])
def test_read_timeouts_must_be_positive(field: str, flag: str) -> None:
    from stoker.server.state import ServerSettings

    with pytest.raises(ValueError, match=f"{flag} must be > 0 seconds"):
        ServerSettings("m", ("m",), **{field: 0})
