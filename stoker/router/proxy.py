"""Sending one request to an upstream and passing its answer back, streamed or whole. [no torch]

The body goes on as bytes and the answer comes back as bytes: SSE chunks are relayed as they
arrive (no re-encoding), so the client sees exactly what the server sent, and the router's
CPU per request stays near a minimal HTTP endpoint's (docs/benchmarks.md, Router).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from stoker.router.http1 import HTTP1Pool, UpstreamConnectionError, UpstreamResponse
from stoker.router.upstream import Upstream

# Headers worth passing on: auth for servers started with --api-key, and the request id that
# vLLM's proxy sets identically on both legs so both servers log the same id.
_FORWARDED = ("authorization", "x-request-id")


def forward_headers(incoming: dict[str, str] | None) -> dict[str, str]:
    out = {"content-type": "application/json"}
    for k in _FORWARDED:
        if incoming and k in incoming:
            out[k] = incoming[k]
    return out


def error_response(status: int, message: str, type_: str = "BadGateway") -> JSONResponse:
    """The OpenAI error body the servers use, so clients raise their usual exception."""
    return JSONResponse({"object": "error", "error": {"message": message, "type": type_, "param": None, "code": status},
                         "message": message, "type": type_, "code": status}, status_code=status)


class UpstreamUnavailable(Exception):
    """The upstream answered 503 or could not be reached before answering: try another."""


async def send(http: HTTP1Pool, up: Upstream, path: str, content: bytes, headers: dict[str, str], stream: bool,
               timeout_s: float | None, on_first_byte: Callable[[], None],
               on_done: Callable[[str | None], None]) -> Response | RelayResponse:
    """POST `content` to `up` (over `http`, its connection pool) and return the response to give
    the client. Raises UpstreamUnavailable (nothing was sent to the client yet). `on_done` runs
    once, when the answer has been passed on or abandoned (the client went away: closing the
    upstream connection makes the server abort the request and free its KV blocks), with the
    error that cut it short if one did."""
    up.in_flight += 1
    done = False

    def finish(error: str | None = None) -> None:
        nonlocal done
        if not done:
            done = True
            up.in_flight -= 1
            on_done(error)

    try:
        resp = await http.post(path, content, headers, timeout_s)
    except UpstreamConnectionError as exc:
        finish(exc.kind)
        raise UpstreamUnavailable(str(exc)) from exc
    except BaseException:
        finish()
        raise
    if resp.status == 503:
        resp.close()
        finish("status_503")
        raise UpstreamUnavailable("answered 503 (loading, engine stopped or shutting down)")
    media_type = resp.headers.get("content-type")
    if not stream or resp.status != 200 or not (media_type or "").startswith("text/event-stream"):
        try:
            data = await resp.read()
        except (UpstreamConnectionError, asyncio.TimeoutError) as exc:
            resp.close()
            finish(getattr(exc, "kind", "timeout"))
            raise UpstreamUnavailable(f"answer cut: {exc}") from exc
        resp.release()
        on_first_byte()
        finish("status_5xx" if resp.status >= 500 else None)
        return Response(data, status_code=resp.status, media_type=media_type)

    return RelayResponse(resp, up.url, media_type or "text/event-stream", on_first_byte, finish)


class RelayResponse:
    """An ASGI response that relays an upstream SSE stream chunk by chunk. Lighter than
    Starlette's StreamingResponse (an anyio task group per request): one plain task waits for
    the client's disconnect and closes the upstream connection, which ends the relay; the
    server sees the disconnect and aborts the request.

    The status line and headers go out as soon as the upstream's have arrived, as a server
    streaming directly would send them: the client reads them while the first token is being
    computed, not after it. The last chunk carries the end of the body when the upstream's end
    arrived with it (one write fewer per request)."""

    def __init__(self, resp: UpstreamResponse, url: str, media_type: str, on_first_byte: Callable[[], None],
                 finish: Callable[[str | None], None]) -> None:
        self.resp, self.url, self.media_type = resp, url, media_type
        self.on_first_byte, self.finish = on_first_byte, finish
        self.client_gone = False

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self.resp.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp, error, whole, chunk = self.resp, None, False, None
        watcher = asyncio.create_task(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", self.media_type.encode())]})
            chunk = await resp.next_chunk()
            if chunk is not None:
                self.on_first_byte()
            while chunk is not None:
                if resp.at_eof:
                    whole = True
                    await send({"type": "http.response.body", "body": chunk, "more_body": False})
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await resp.next_chunk()
            else:
                whole = True
        except (UpstreamConnectionError, asyncio.TimeoutError) as exc:
            if not self.client_gone:
                # The server went away mid-answer: end the stream with an error event (vLLM's
                # shape for errors inside a stream) rather than a silently truncated one.
                error = getattr(exc, "kind", "timeout")
                msg = f"upstream {self.url} cut the stream: {exc}"
                event = {"error": {"message": msg, "type": "BadGateway", "code": 502}}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                            "more_body": True})
        finally:
            watcher.cancel()
            if whole:
                resp.release()  # the connection goes back to the pool
            else:
                resp.close()  # the client left or the stream broke: the server sees the disconnect
            self.finish(error)
        if not (whole and chunk is not None):  # the body's end was not sent with the last chunk
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class Stopwatch:
    """Request timing: arrival to first byte (TTFT) and to last byte, for one route."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None

    def first_byte(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
