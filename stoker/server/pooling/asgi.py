"""POST /v1/embeddings, /v1/rerank and /v1/score answered in pure ASGI, before FastAPI routes.

Why: FastAPI 0.165's per-request machinery (route matching, dependency solving, its Request
and body handling) was most of the event loop's CPU per embeddings request, and on a small
machine that CPU is taken from the model's forward while requests wait in a closed loop; with
this path the loop's CPU per request fell from 271-290 to 181-199 us in process
(benchmarks/embeddings_loop_cpu.py; docs/benchmarks.md, "Event-loop CPU per request"). The endpoints are the same: the same request models validate the same
JSON, the same serving class answers, errors take the same shape (server/errors.py) and are counted
the same way.

What stays FastAPI's: the declarations in server/routes.py (the OpenAPI schema), and every request
this path does not take, handed on untouched (its body replayed): another method or path, a
body that is not JSON by its Content-Type, an empty body, or one whose JSON does not parse or
is not an object (FastAPI's own 400s for those, as before).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from stoker.server.errors import ApiError, describe_validation_errors
from stoker.server.pooling.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from stoker.server.pooling.serving import OpenAIServingPooling

ErrorResponse = Callable[[int, str, "str | None", "dict[str, str] | None"], Response]

# path -> (request body model, OpenAIServingPooling method)
_ROUTES: dict[str, tuple[type[BaseModel], Callable[[OpenAIServingPooling, Any], Awaitable[Response]]]] = {
    "/v1/embeddings": (EmbeddingRequest, OpenAIServingPooling.embeddings),
    "/v1/rerank": (RerankRequest, OpenAIServingPooling.rerank),
    "/v1/score": (ScoreRequest, OpenAIServingPooling.score),
}


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """FastAPI's rule: no Content-Type, application/json, or an application/*+json type."""
    for name, value in headers:
        if name.lower() == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    return True


class PoolingEndpoints:
    def __init__(self, app: Any, state: Any, error_response: ErrorResponse) -> None:
        """`state`: the server's ServerState; `error_response(status, message, param, headers)`:
        the app's error answer (OpenAI's shape, counted in the rejection metrics)."""
        self.app, self.state, self.error_response = app, state, error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not _is_json(scope.get("headers") or []):
            return await self.app(scope, receive, send)
        body, messages, disconnected = await _read_body(receive)
        if disconnected:  # the client left before its body was in: nobody to answer
            return
        data = _json_object(body)
        if data is None:  # FastAPI answers these as it always has
            return await self.app(scope, _replay(messages, receive), send)
        model, handler = route
        try:
            response = await handler(OpenAIServingPooling(self.state), model.model_validate(data))
        except ValidationError as exc:
            message, param = describe_validation_errors(list(exc.errors()))
            response = self.error_response(400, message, param, None)
        except ApiError as exc:
            response = self.error_response(exc.status, exc.message, exc.param, exc.headers)
        await response(scope, receive, send)


async def _read_body(receive: Receive) -> tuple[bytes, list[Message], bool]:
    """(the whole body, the messages it came in, whether the client disconnected first)."""
    messages: list[Message] = []
    while True:
        msg = await receive()
        messages.append(msg)
        if msg["type"] != "http.request":
            return b"", messages, True
        if not msg.get("more_body", False):
            break
    body = messages[0].get("body", b"") if len(messages) == 1 else b"".join(m.get("body", b"") for m in messages)
    return body, messages, False


def _json_object(body: bytes) -> dict[str, Any] | None:
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        return None
    return data if isinstance(data, dict) else None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives back the messages already read, then the connection's own."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
