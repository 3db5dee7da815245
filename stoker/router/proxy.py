"""Sending one request to an upstream and passing its answer back, streamed or whole. [no torch]

The body goes on as bytes and the answer comes back as bytes: SSE chunks are relayed as they
arrive (no re-encoding), so the client sees exactly what the server sent, and the router's
cost per request stays a fraction of a millisecond (docs/benchmarks.md, Router).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from stoker.router.upstream import Upstream

# Headers worth passing on: auth for servers started with --api-key, and the request id that
# vLLM's proxy sets identically on both legs so both servers log the same id.
_FORWARDED = ("authorization", "x-request-id")
# Errors before any answer byte: the request may be retried on another replica.
# (aiohttp: refused, reset, disconnected, connect timeout; a read timeout is not retried.)
RETRYABLE = (aiohttp.ClientConnectionError,)


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


async def send(session: aiohttp.ClientSession, up: Upstream, path: str, content: bytes, headers: dict[str, str],
               stream: bool, on_first_byte: Callable[[], None], on_done: Callable[[str | None], None]) -> Response:
    """POST `content` to `up` and return the response to give the client. Raises
    UpstreamUnavailable (nothing was sent to the client yet). `on_done` runs once, when the
    answer has been passed on or abandoned (the client went away: closing the upstream
    connection makes the server abort the request and free its KV blocks), with the error that
    cut it short if one did."""
    up.in_flight += 1
    done = False

    def finish(error: str | None = None) -> None:
        nonlocal done
        if not done:
            done = True
            up.in_flight -= 1
            on_done(error)

    try:
        resp = await session.post(up.url + path, data=content, headers=headers)
    except RETRYABLE as exc:
        finish(type(exc).__name__)
        raise UpstreamUnavailable(f"{type(exc).__name__}: {exc}") from exc
    except BaseException:
        finish()
        raise
    if resp.status == 503:
        resp.release()
        finish("status_503")
        raise UpstreamUnavailable("answered 503 (loading, engine stopped or shutting down)")
    media_type = resp.headers.get("content-type")
    if not stream or resp.status != 200 or not (media_type or "").startswith("text/event-stream"):
        try:
            data = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            resp.close()
            finish(type(exc).__name__)
            raise UpstreamUnavailable(f"answer cut: {type(exc).__name__}: {exc}") from exc
        resp.release()
        on_first_byte()
        finish("status_5xx" if resp.status >= 500 else None)
        return Response(data, status_code=resp.status, media_type=media_type)

    async def relay() -> AsyncIterator[bytes]:
        first = True
        error = None
        whole = False
        try:
            async for chunk in resp.content.iter_any():
                if first:
                    on_first_byte()
                    first = False
                yield chunk
            whole = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # The server went away mid-answer: end the stream with an error event (vLLM's shape
            # for errors inside a stream) rather than a silently truncated one.
            error = type(exc).__name__
            msg = f"upstream {up.url} cut the stream: {error}"
            yield f"data: {json.dumps({'error': {'message': msg, 'type': 'BadGateway', 'code': 502}})}\n\n".encode()
        finally:
            if whole:
                resp.release()  # the connection goes back to the pool
            else:
                resp.close()  # the client left (or the stream broke): the server sees the disconnect
            finish(error)

    async def cleanup() -> None:  # a no-op after relay() ran; closes the upstream if it never started
        resp.close()
        finish()

    return StreamingResponse(relay(), status_code=200, media_type=media_type, background=BackgroundTask(cleanup))


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
