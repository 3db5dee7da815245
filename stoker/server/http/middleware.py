"""Pure-ASGI gatekeeping before FastAPI sees a request: API key, then body size; and the
last catch for errors nothing else handled.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client-disconnect
cancellation pass through untouched and the hot path costs one dict lookup.

An unexpected exception is answered here with a 500 in the OpenAI shape and
`Connection: close`, and not re-raised: left to Starlette's outermost error middleware, the
500 was sent and the exception re-raised, and uvicorn then dropped the keep-alive connection
without saying so, so a pooled client's next (valid) request failed with a reset (issue 20).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from stoker.server.errors import error_bytes

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

logger = logging.getLogger("stoker.server")

# A deadline on one await: asyncio.timeout (3.11+) arms a timer on the running task;
# asyncio.wait_for (3.10) wraps the await in a new task on every call.
_timeout = getattr(asyncio, "timeout", None)


async def _within(awaitable: Awaitable[Message], seconds: float) -> Message:
    """`awaitable`'s result, or asyncio.TimeoutError after `seconds`."""
    if _timeout is None:
        return await asyncio.wait_for(awaitable, seconds)
    async with _timeout(seconds):
        return await awaitable

# Probes and scrapers stay open when an API key is set (see docs/server.md).
OPEN_PATHS = frozenset({"/health", "/v1/health/live", "/v1/health/ready", "/metrics", "/version",
                        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


async def send_error(send: Send, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
    body = error_bytes(status, message, param)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class Gatekeeper:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, on_reject: Callable[[int], None] | None = None,
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.on_reject = on_reject or (lambda status: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path", "") not in OPEN_PATHS and scope.get("method") != "OPTIONS":
            if not self._authorized(headers):
                self.on_reject(401)
                return await send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                        headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await send_error(send, 400, "Content-Length is not a number")
            if declared > self.max_body_bytes:
                self.on_reject(413)
                return await send_error(send, 413, f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes} bytes")
        await self._limited(scope, receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        assert self.api_key is not None
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b""), self.api_key)

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Chunked bodies carry no length up front: count while reading, answer 413 in place
        of whatever the app answers once the limit is crossed. While the body is incomplete,
        each next piece must come within body_timeout_s, else 408 (a client that stalls
        mid-body would otherwise hold its request open for ever)."""
        received = 0
        refusal: tuple[int, str] | None = None  # (status, message) once the body is refused
        body_done = False
        replaced = False
        started = False  # the app has begun its response

        async def limited_receive() -> Message:
            nonlocal received, refusal, body_done
            if body_done:  # after the body only http.disconnect comes: no deadline
                return await receive()
            try:
                msg = await _within(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                refusal = (408, f"the request body stalled: no data for {self.body_timeout_s:g} s")
                raise ValueError(refusal[1]) from None
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                body_done = not msg.get("more_body", False)
                if received > self.max_body_bytes:
                    refusal = (413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
                    raise ValueError("request body too large")
            else:
                body_done = True
            return msg

        async def refuse() -> None:
            nonlocal replaced
            if not replaced and refusal is not None:
                replaced = True
                self.on_reject(refusal[0])
                await send_error(send, refusal[0], refusal[1], headers={"Connection": "close"})

        async def guarded_send(msg: Message) -> None:
            nonlocal started
            if refusal is not None:
                if msg["type"] == "http.response.start":
                    await refuse()
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception as exc:
            if refusal is not None:
                await refuse()
            elif started:  # a stream broke mid-way: nothing to answer; uvicorn closes the connection
                raise
            else:
                logger.exception("unhandled error while serving %s", scope.get("path", ""))
                self.on_reject(500)
                await send_error(send, 500, f"internal error: {type(exc).__name__}: {exc}", headers={"Connection": "close"})
