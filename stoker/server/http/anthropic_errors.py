"""Errors on /v1/messages in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

Every error the server answers is written in OpenAI's shape, wherever it arises: Gatekeeper's
401 / 408 / 413 and 500 (middleware.py), a validation 400, an ApiError's 404 or 503 (app.py).
The `anthropic` SDK reads Anthropic's shape, so on the Messages routes this outermost pure-ASGI
layer rewrites an error response's JSON body, keeping its status and headers. Everything else
(the OpenAI routes, any 2xx, streams) passes through untouched, at the cost of one prefix test.
"""

from __future__ import annotations

import json
from typing import Any

from stoker.server.http.middleware import Message, Receive, Scope, Send

PREFIX = "/v1/messages"

# HTTP status -> Anthropic's error type (the types the `anthropic` SDK knows).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _reshaped(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body (or anything else) as Anthropic's."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    if status == 401:  # Anthropic's clients send their key as x-api-key, which the server accepts too
        message = f"{message} (or 'x-api-key: <key>')"
    return json.dumps(anthropic_error(status, str(message))).encode()


class AnthropicErrors:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            return await self.app(scope, receive, send)
        start: Message | None = None  # an error's response start, held until its body is read
        body = b""

        async def reshaping_send(msg: Message) -> None:
            nonlocal start, body
            if msg["type"] == "http.response.start":
                headers = dict(msg.get("headers") or [])
                if msg["status"] >= 400 and headers.get(b"content-type", b"").startswith(b"application/json"):
                    start = msg
                    return
            elif msg["type"] == "http.response.body" and start is not None:
                body += msg.get("body", b"")
                if msg.get("more_body", False):
                    return
                new = _reshaped(start["status"], body)
                headers = [(k, v) for k, v in start.get("headers") or [] if k != b"content-length"]
                await send({**start, "headers": headers + [(b"content-length", str(len(new)).encode())]})
                await send({"type": "http.response.body", "body": new})
                return
            await send(msg)

        await self.app(scope, receive, reshaping_send)
