"""`stoker router` in disaggregated mode against small fake prefill/decode servers that record
what they receive: the prefill leg's body (vLLM's proxy protocol), the decode leg's, the
local-prefill decisions (short prompt, queued prefill pool, batch), and failing prefill legs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from stoker.router.app import create_app
from stoker.router.config import RouterConfig
from tests.server.conftest import LiveServer, serve_app

KV_PARAMS = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "engine-p0",
             "remote_block_ids": [3, 4, 5], "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1}


class Fake:
    """A vLLM-shaped server: records bodies and headers; `mode` scripts its answers."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.tokenized: list[dict[str, Any]] = []
        self.mode = "ok"  # ok | http500 | no_params | slow | bad_request
        self.waiting = 0
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=503 if self.mode == "unavailable" else 200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
                                     'vllm:num_requests_running{model_name="m"} 0.0\n'
                                     'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n')

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            body = await request.json()
            self.tokenized.append(body)
            text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
            return JSONResponse({"count": len(text.split()), "max_model_len": 4096, "tokens": []})

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

        async def generate(request: Request, chat: bool) -> Response:
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            if self.mode == "unavailable":
                return JSONResponse({"error": {"message": "engine stopped"}}, status_code=503)
            if self.mode == "http500":
                return JSONResponse({"error": {"message": "engine fell over"}}, status_code=500)
            if self.mode == "bad_request":
                return JSONResponse({"error": {"message": "temperature: must be >= 0", "param": "temperature"}},
                                    status_code=400)
            if self.mode == "slow":
                import asyncio
                await asyncio.sleep(4)
            text = f"{self.role}-answer"
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
                      else {"index": 0, "text": text, "finish_reason": "length"})
            out: dict[str, Any] = {"id": "x", "object": "chat.completion" if chat else "text_completion",
                                   "created": 0, "model": "m", "choices": [choice],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            if self.role == "prefill" and self.mode != "no_params":
                out["kv_transfer_params"] = KV_PARAMS
            if body.get("stream"):
                async def sse() -> Iterator[bytes]:
                    for word in ("one", " two", " three"):
                        delta = ({"index": 0, "delta": {"content": word}, "finish_reason": None} if chat
                                 else {"index": 0, "text": word, "finish_reason": None})
                        chunk = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                                 "created": 0, "model": "m", "choices": [delta]}
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                return StreamingResponse(sse(), media_type="text/event-stream")
            return JSONResponse(out)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await generate(request, chat=True)

        return app


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[Fake, Fake, LiveServer, LiveServer]]:
    prefill, decode = Fake("prefill"), Fake("decode")
    lp, ld = serve_app(prefill.app, ready_path="/health"), serve_app(decode.app, ready_path="/health")
    yield prefill, decode, lp, ld
    lp.stop()
    ld.stop()


@pytest.fixture
def pd(fakes) -> Iterator[tuple[Fake, Fake, Any]]:
    """A fresh router over the two fakes (long prompts = more than 8 words go remote)."""
    prefill, decode, lp, ld = fakes
    for f in (prefill, decode):
        f.bodies.clear(), f.headers.clear(), f.tokenized.clear()
        f.mode, f.waiting = "ok", 0
    cfg = RouterConfig(prefill=(lp.url,), decode=(ld.url,), max_local_prefill_length=8, metrics_interval_s=0.1,
                       health_check_interval_s=0.1, prefill_timeout_s=2.0)
    router = serve_app(create_app(cfg), ready_path="/health")
    yield prefill, decode, router
    router.stop()


LONG = "the quick brown fox jumps over the lazy dog again and again"  # 12 words > 8


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`, from the router's /metrics."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                total += s.value
    return total


def _metric(router: LiveServer, name: str, **labels: str) -> float:
    return metric(router.url, name, **labels)


def test_remote_prefill_legs_follow_vllm_proxy_protocol(pd):
    prefill, decode, router = pd
    r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 40,
                                                         "temperature": 0, "stream_options": {"include_usage": True}},
                   headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "decode-answer"
    (p,), (d,) = prefill.bodies, decode.bodies
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                       "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert p["prompt"] == LONG and p["temperature"] == 0
    assert d["kv_transfer_params"] == KV_PARAMS  # what the prefill server returned, unchanged
    assert d["max_tokens"] == 40 and d["prompt"] == LONG and d["stream_options"] == {"include_usage": True}
    assert prefill.headers[0]["x-request-id"] == decode.headers[0]["x-request-id"] == "req-42"
    assert _metric(router, "stoker_router:requests_total", route="remote_prefill", endpoint="completions") == 1


def test_chat_streams_from_decode_with_max_completion_tokens(pd):
    from openai import OpenAI

    prefill, decode, router = pd
    client = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": LONG}]
    stream = client.chat.completions.create(model="m", messages=msgs, max_completion_tokens=30, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == "one two three"
    (p,), (d,) = prefill.bodies, decode.bodies
    assert p["max_completion_tokens"] == 1 and p["max_tokens"] == 1 and p["stream"] is False
    assert p["messages"] == msgs
    assert d["stream"] is True and d["max_completion_tokens"] == 30 and d["kv_transfer_params"] == KV_PARAMS
    assert decode.tokenized and decode.tokenized[0]["messages"] == msgs  # counted on the decode server
    assert _metric(router, "stoker_router:time_to_first_token_seconds_count", route="remote_prefill") == 1


def test_short_prompt_prefills_locally(pd):
    prefill, decode, router = pd
    r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "hi there", "max_tokens": 5})
    assert r.status_code == 200
    assert prefill.bodies == [] and "kv_transfer_params" not in decode.bodies[0]
    assert decode.bodies[0]["max_tokens"] == 5
    # token ids are counted without a round trip
    r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 5})
    assert r.status_code == 200 and prefill.bodies == [] and len(decode.tokenized) == 1
    assert _metric(router, "stoker_router:local_prefill_reasons_total", reason="short_prompt") == 2
    assert _metric(router, "stoker_router:requests_total", route="local_prefill", endpoint="completions") == 2


def test_queued_prefill_pool_and_batches_prefill_locally(pd):
    prefill, decode, router = pd
    prefill.waiting = 5  # over --max-prefill-queue-size 2, seen at the next scrape
    time.sleep(0.5)
    r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 5})
    assert r.status_code == 200 and prefill.bodies == []
    prefill.waiting = 0
    time.sleep(0.5)
    r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": [LONG, LONG], "max_tokens": 5})
    assert r.status_code == 200 and prefill.bodies == []
    assert _metric(router, "stoker_router:local_prefill_reasons_total", reason="prefill_queue") == 1
    assert _metric(router, "stoker_router:local_prefill_reasons_total", reason="multi_sequence") == 1
    r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 5})
    assert r.status_code == 200 and len(prefill.bodies) == 1


@pytest.mark.parametrize("mode, status, words", [
    ("http500", 502, "failed with HTTP 500"),
    ("no_params", 502, "without kv_transfer_params"),
    ("slow", 504, "did not answer within 2 s"),
    ("bad_request", 400, "temperature"),
])
def test_failing_prefill_leg_answers_clearly(pd, mode, status, words):
    prefill, decode, router = pd
    prefill.mode = mode
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 5}, timeout=20)
    assert time.monotonic() - t0 < 10  # no hang
    assert r.status_code == status and words in r.text, r.text
    assert decode.bodies == []  # no decode leg without KV to read
    if status >= 500:
        assert _metric(router, "stoker_router:upstream_errors_total", role="prefill") == 1


def test_unreachable_prefill_server_falls_back_to_local(fakes):
    from tests.server.conftest import free_port

    prefill, decode, lp, ld = fakes
    decode.bodies.clear()
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = RouterConfig(prefill=(dead,), decode=(ld.url,), max_local_prefill_length=8, health_check_interval_s=0.1)
    router = serve_app(create_app(cfg), ready_path="/health")
    try:
        r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 5})
        assert r.status_code == 200 and "kv_transfer_params" not in decode.bodies[-1]
        assert _metric(router, "stoker_router:upstream_healthy", role="prefill") == 0
        assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "m"
    finally:
        router.stop()


def test_router_rejects_non_json_and_bad_flags(pd):
    _, _, router = pd
    r = httpx.post(router.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    big = b'{"prompt": "' + b"x" * (16 * 2**20) + b'"}'
    r = httpx.post(router.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]

    def chunked():  # no content-length: counted as it arrives
        for _ in range(17):
            yield b"x" * 2**20
    r = httpx.post(router.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    with pytest.raises(ValueError, match="--decode"):
        RouterConfig(prefill=("http://a:1",))
    with pytest.raises(ValueError, match="listed twice"):
        RouterConfig(workers=("a:1", "http://a:1/"))


def test_unhealthy_replica_skipped_until_health_recovers(fakes):
    """A replica answering 503 is marked unhealthy, skipped, and taken back once /health says 200."""
    prefill, decode, lp, ld = fakes
    prefill.mode, decode.mode = "unavailable", "ok"
    prefill.bodies.clear(), decode.bodies.clear()
    cfg = RouterConfig(workers=(lp.url, ld.url), policy="round_robin", metrics_interval_s=0.1,
                       health_check_interval_s=0.1)
    router = serve_app(create_app(cfg), ready_path="/health")
    try:
        for _ in range(4):
            r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode-answer"
        assert len(prefill.bodies) == 1 and len(decode.bodies) == 4  # tried once, then skipped
        assert metric(router.url, "stoker_router:upstream_healthy", upstream=lp.url) == 0
        prefill.mode = "ok"
        deadline = time.monotonic() + 5
        while metric(router.url, "stoker_router:upstream_healthy", upstream=lp.url) == 0:
            assert time.monotonic() < deadline, "never taken back"
            time.sleep(0.05)
        answers = [httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}) for _ in range(4)]
        texts = {a.json()["choices"][0]["text"] for a in answers}
        assert texts == {"prefill-answer", "decode-answer"}
        decode.mode = "unavailable"  # every replica down: a clear 503, no hang
        prefill.mode = "unavailable"
        r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and "no healthy server" in r.text
        assert httpx.get(router.url + "/health").status_code == 503
    finally:
        prefill.mode = decode.mode = "ok"
        router.stop()


def test_local_tokenizer_counts_without_a_round_trip(fakes, tiny_llama):
    from stoker.router.tokens import LocalTokenizer

    prefill, decode, lp, ld = fakes
    for f in (prefill, decode):
        f.bodies.clear(), f.tokenized.clear()
    tok = LocalTokenizer(str(tiny_llama))
    n_long = tok.count({"prompt": LONG}, chat=False)
    n_chat = tok.count({"messages": [{"role": "user", "content": LONG}]}, chat=True)
    assert n_chat > n_long > 8  # the template adds its framing
    cfg = RouterConfig(prefill=(lp.url,), decode=(ld.url,), tokenizer=str(tiny_llama),
                       max_local_prefill_length=n_long - 1)
    router = serve_app(create_app(cfg), ready_path="/health")
    try:
        r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 3})
        assert r.status_code == 200 and len(prefill.bodies) == 1
        r = httpx.post(router.url + "/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 3})
        assert r.status_code == 200 and len(prefill.bodies) == 2
        assert decode.tokenized == []  # counted in the router
    finally:
        router.stop()


def test_scraped_queue_steers_the_balancer(fakes):
    """Load the router did not send (another client's, seen on the server's /metrics) counts."""
    prefill, decode, lp, ld = fakes
    prefill.mode = decode.mode = "ok"
    prefill.bodies.clear(), decode.bodies.clear()
    decode.waiting = 6  # the "decode" fake reports a queue; the "prefill" fake none
    cfg = RouterConfig(workers=(lp.url, ld.url), policy="least_load", metrics_interval_s=0.1)
    router = serve_app(create_app(cfg), ready_path="/health")
    try:
        deadline = time.monotonic() + 5
        while metric(router.url, "stoker_router:upstream_load", upstream=ld.url) < 6:
            assert time.monotonic() < deadline, "the queue was never scraped"
            time.sleep(0.05)
        for i in range(4):
            assert httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": f"q{i}"}).status_code == 200
        assert len(prefill.bodies) == 4 and decode.bodies == []
    finally:
        decode.waiting = 0
        router.stop()
