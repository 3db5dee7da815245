"""The router's HTTP front: OpenAI completions and chat, /v1/models, /health, /metrics. [no torch]

Balancer mode (no --prefill): each request goes whole to one replica of the pool (Pool.choose).
Disaggregated mode: the decode replica is chosen first; a request whose uncached prompt is
short, or that arrives while the prefill pool is queued up, is prefilled there (Dynamo's
conditional disaggregation); otherwise the prefill leg runs on a prefill replica and the decode
leg carries the kv_transfer_params it returned (vLLM's proxy protocol, requests.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from stoker.router.config import RouterConfig
from stoker.router.http1 import HTTP1Pool, UpstreamConnectionError, UpstreamTimeout
from stoker.router.metrics import RouterMetrics
from stoker.router.policy import Choice, Pool
from stoker.router.proxy import (RelayResponse, Stopwatch, UpstreamUnavailable, error_response,
                                 forward_headers, send)
from stoker.router.requests import (BadRequest, decode_leg, parse_body, prefill_leg, prompt_text, read_body,
                                    single_sequence)
from stoker.router.tokens import LocalTokenizer, count_tokens
from stoker.router.upstream import Upstream, poll_forever


_READ_HEADERS = frozenset((b"content-length", b"authorization", b"x-request-id"))


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        role = "decode" if cfg.disaggregated else "worker"
        knobs = dict(policy=cfg.policy, cache_threshold=cfg.cache_threshold,
                     balance_abs_threshold=cfg.balance_abs_threshold,
                     balance_rel_threshold=cfg.balance_rel_threshold, prefix_chunk_chars=cfg.prefix_chunk_chars)
        self.pool = Pool([Upstream(u, role) for u in cfg.pool_urls], **knobs)
        self.prefill = Pool([Upstream(u, "prefill") for u in cfg.prefill], **knobs) if cfg.disaggregated else None
        self.tokenizer: LocalTokenizer | None = None
        # Both legs and /tokenize go over a lean HTTP/1.1 pool per upstream (http1.py); aiohttp
        # carries what is off the request path: /v1/models, the health and load checks.
        self.session: aiohttp.ClientSession | None = None
        self.http = {up.url: HTTP1Pool(up.url, cfg.connect_timeout_s) for up in self.upstreams}

    @property
    def upstreams(self) -> list[Upstream]:
        return self.pool.upstreams + (self.prefill.upstreams if self.prefill else [])

    def recovered(self, up: Upstream) -> None:
        """An upstream is healthy again after an outage (a restart, most likely): its prefix
        cache is empty, so the prefix index forgets what it had sent there."""
        for pool in (self.pool, self.prefill):
            if pool is not None and up in pool.upstreams:
                pool.index.forget(up.url)

    def _error(self, up: Upstream, kind: str) -> None:
        self.metrics.upstream_errors.labels(up.url, up.role, kind).inc()

    # --- one request ------------------------------------------------------------------------

    async def generate(self, scope: Scope, receive: Receive, path: str, chat: bool) -> Response | RelayResponse:
        sw = Stopwatch()
        # ASGI header names are lower-case bytes; only these few are read.
        wanted = {k: v for k, v in scope["headers"] if k in _READ_HEADERS}
        try:
            raw = await read_body(receive, wanted.get(b"content-length"), self.cfg.max_request_body_bytes)
            body = parse_body(raw)
        except BadRequest as exc:
            return error_response(exc.status, str(exc), "BadRequestError")
        stream = body.get("stream") is True
        text = prompt_text(body, chat)
        headers = forward_headers({k.decode("latin-1"): v.decode("latin-1") for k, v in wanted.items()
                                   if k != b"content-length"})
        endpoint = "chat" if chat else "completions"
        if self.prefill is None:  # the body goes on byte for byte
            return await self._to_pool(self.pool, path, raw, headers, stream, text, "aggregated", endpoint, sw)
        decode = self.pool.choose(text)
        if decode is None:
            return error_response(503, "no healthy decode server; they are re-checked every "
                                  f"{self.cfg.health_check_interval_s:g} s", "ServiceUnavailable")
        reason = await self._local_reason(body, chat, text, decode)
        if reason is not None:
            self.metrics.local_reasons.labels(reason).inc()
            return await self._to_pool(self.pool, path, raw, headers, stream, text, "local_prefill",
                                       endpoint, sw, first=decode)
        headers.setdefault("x-request-id", uuid.uuid4().hex)  # one id on both legs, as vLLM's proxy does
        outcome = await self._prefill_leg(path, body, headers, text)
        if isinstance(outcome, Response):
            return outcome
        if outcome is None:  # no prefill server could be reached: prefill on the decode server
            self.metrics.local_reasons.labels("prefill_unreachable").inc()
            return await self._to_pool(self.pool, path, raw, headers, stream, text, "local_prefill",
                                       endpoint, sw, first=decode)
        content = json.dumps(decode_leg(body, outcome)).encode()
        return await self._to_pool(self.pool, path, content, headers, stream, text, "remote_prefill", endpoint, sw,
                                   first=decode)

    async def _local_reason(self, body: dict[str, Any], chat: bool, text: str, decode: Choice) -> str | None:
        """Why this request is prefilled on the decode server, or None to disaggregate it."""
        assert self.prefill is not None
        healthy = self.prefill.healthy()
        if not healthy:
            return "no_prefill_server"
        if not single_sequence(body, chat):
            return "multi_sequence"
        tokens, exact = await count_tokens(body, chat, text, self.http[decode.upstream.url], self.tokenizer,
                                           self.cfg.connect_timeout_s)
        if not exact:
            self._error(decode.upstream, "tokenize")
        # Dynamo weighs the prompt's uncached part: what the decode replica already holds (as far
        # as the router's prefix index knows) costs it nothing to prefill.
        if tokens * (1.0 - decode.cached_fraction) <= self.cfg.max_local_prefill_length:
            return "short_prompt"
        if min(u.waiting for u in healthy) >= self.cfg.max_prefill_queue_size:
            return "prefill_queue"
        return None

    async def _prefill_leg(self, path: str, body: dict[str, Any], headers: dict[str, str],
                           text: str) -> dict[str, Any] | Response | None:
        """The decode leg's kv_transfer_params, an error Response for the client, or None when
        no prefill server could be reached."""
        assert self.prefill is not None
        content = json.dumps(prefill_leg(body)).encode()
        tried: set[str] = set()
        choice = self.prefill.choose(text)
        while choice is not None:
            up = choice.upstream
            sw = Stopwatch()
            up.in_flight += 1
            try:
                resp = await self.http[up.url].post(path, content, headers, self.cfg.prefill_timeout_s)
                try:
                    raw = await resp.read()
                finally:
                    resp.release()  # back to the pool when whole, else closed
                status, media_type = resp.status, resp.headers.get("content-type")
            except UpstreamTimeout:
                self._error(up, "timeout")
                return error_response(504, f"the prefill leg to {up.url} did not answer within "
                                      f"{self.cfg.prefill_timeout_s:g} s (--prefill-timeout-secs)", "GatewayTimeout")
            except UpstreamConnectionError as exc:
                status, media_type, raw = -1, None, exc.kind.encode()
            finally:
                up.in_flight -= 1
            if status in (-1, 503):  # unreachable or not serving: the next prefill server
                why = raw.decode() if status == -1 else "status_503"
                self._error(up, why)
                up.mark_unhealthy(f"prefill leg: {why}")
                tried.add(up.url)
                choice = self.prefill.choose(text, frozenset(tried))
                continue
            self.metrics.prefill_leg.observe(sw.elapsed())
            if 400 <= status < 500:  # the request's own fault: the server's words, as it said them
                return Response(raw, status_code=status, media_type=media_type)
            if status != 200:
                self._error(up, f"status_{status}")
                return error_response(502, f"the prefill leg to {up.url} failed with HTTP {status}: "
                                      f"{raw[:300].decode(errors='replace')}")
            try:
                params = json.loads(raw).get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            if not isinstance(params, dict):
                self._error(up, "no_kv_transfer_params")
                return error_response(502, f"the prefill server {up.url} answered without kv_transfer_params; start it "
                                      "with --kv-transfer-config '{\"kv_connector\":\"NixlConnector\","
                                      "\"kv_role\":\"kv_both\"}'")
            return params
        return None

    async def _to_pool(self, pool: Pool, path: str, content: bytes, headers: dict[str, str], stream: bool, text: str,
                       route: str, endpoint: str, sw: Stopwatch,
                       first: Choice | None = None) -> Response | RelayResponse:
        """Send to the chosen replica; one that cannot be reached (or answers 503) is marked
        unhealthy and the next choice is tried, until none is left."""
        tried: set[str] = set()
        choice = first if first is not None else pool.choose(text)
        last = "every server is marked unhealthy"
        while choice is not None:
            up = choice.upstream

            def done(error: str | None, up: Upstream = up) -> None:
                if error is not None:
                    self._error(up, error)
                if sw.first is not None:
                    self.metrics.ttft_of[route].observe(sw.first)
                    self.metrics.e2e_of[route].observe(sw.elapsed())

            try:
                resp = await send(self.http[up.url], up, path, content, headers, stream, self.cfg.request_timeout_s,
                                  sw.first_byte, done)
            except UpstreamUnavailable as exc:
                up.mark_unhealthy(str(exc))
                last = f"{up.url}: {exc}"
                tried.add(up.url)
                choice = pool.choose(text, frozenset(tried))
                continue
            self.metrics.requests_of[route, endpoint].inc()
            return resp
        return error_response(503, f"no healthy server to take the request ({last}); unhealthy servers are "
                              f"re-checked every {self.cfg.health_check_interval_s:g} s", "ServiceUnavailable")

    # --- the rest of the surface ------------------------------------------------------------

    async def models(self) -> Response:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s)
        for up in self.pool.healthy():
            try:
                async with self.session.get(up.url + "/v1/models", timeout=timeout) as r:
                    status, media_type, raw = r.status, r.headers.get("content-type"), await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self._error(up, type(exc).__name__)
                up.mark_unhealthy(f"/v1/models: {type(exc).__name__}")
                continue
            return Response(raw, status_code=status, media_type=media_type)
        return error_response(503, "no healthy server to list the models", "ServiceUnavailable")

    def render_metrics(self) -> bytes:
        m = self.metrics
        for up in self.upstreams:
            m.healthy.labels(up.url, up.role).set(1 if up.healthy else 0)
            m.load.labels(up.url, up.role).set(up.load)
            m.in_flight.labels(up.url, up.role).set(up.in_flight)
        return generate_latest(m.registry)


def create_app(cfg: RouterConfig) -> "HotPaths":
    router = Router(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if cfg.tokenizer:
            router.tokenizer = await asyncio.to_thread(LocalTokenizer, cfg.tokenizer)
        # No cap on connections (the servers have their own admission limits), and no total
        # deadline on a leg to the answering server: a long generation must not be cut.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            router.session = session
            poller = asyncio.create_task(poll_forever(router.upstreams, session, cfg.metrics_interval_s,
                                                      cfg.health_check_interval_s, router.recovered))
            try:
                yield
            finally:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
                for http in router.http.values():
                    http.close()

    app = FastAPI(title="stoker router", lifespan=lifespan)
    app.state.router = router

    # POST /v1/completions and /v1/chat/completions: HotPaths, below.
    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health() -> Response:
        """Ready while at least one server that answers clients (worker or decode) is healthy."""
        if router.pool.healthy():
            return Response(status_code=200)
        return JSONResponse({"message": "no healthy worker/decode server"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return HotPaths(app, router)


class HotPaths:
    """The ASGI app the server runs: POST /v1/completions and /v1/chat/completions go straight to
    the router, past FastAPI's middleware and routing (a measurable share of the router's CPU
    per request, docs/benchmarks.md, Router); everything else, lifespan included, to FastAPI."""

    _PATHS = {"/v1/completions": False, "/v1/chat/completions": True}

    def __init__(self, app: FastAPI, router: Router) -> None:
        self.app, self.router = app, router
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = self._PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if chat is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        response = await self.router.generate(scope, receive, scope["path"], chat)
        await response(scope, receive, send)
