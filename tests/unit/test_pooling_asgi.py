"""server/pooling/asgi.py: PoolingEndpoints' hand-offs, without a server: what it does not answer reaches
the app behind it with every body message in order, and a client gone mid-body gets nothing."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import Response

from stoker.server.pooling.asgi import PoolingEndpoints


def _scope(path: str = "/v1/embeddings", method: str = "POST", content_type: bytes | None = b"application/json") -> dict[str, Any]:
    headers = [(b"content-type", content_type)] if content_type is not None else []
    return {"type": "http", "method": method, "path": path, "headers": headers}


def _run(scope: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    """(what the app behind received, what was sent, error responses made)."""
    inner_got: list[dict[str, Any]] = []
    sent: list[dict[str, Any]] = []
    errors: list[Any] = []
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        while True:
            msg = await receive()
            inner_got.append(msg)
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                return

    def error_response(*args: Any) -> Response:
        errors.append(args)
        return Response(status_code=args[0])

    endpoints = PoolingEndpoints(inner, state=None, error_response=error_response)
    asyncio.run(endpoints(scope, receive, send))
    return inner_got, sent, errors


def _body(*parts: bytes) -> list[dict[str, Any]]:
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


def test_requests_it_does_not_take_reach_the_app_with_their_body_in_order() -> None:
    for scope, parts in [
        (_scope(path="/v1/completions"), (b'{"prompt": "x"}',)),      # another path
        (_scope(method="PUT"), (b'{"input": "x"}',)),                  # another method
        (_scope(content_type=b"text/plain"), (b'{"input": "x"}',)),    # not JSON by its type
        (_scope(), (b'{"input": ', b'"x"')),                           # JSON that does not parse, in 2 pieces
        (_scope(), (b'["x"]',)),                                       # JSON, not an object
        (_scope(), (b"",)),                                            # no body
        (_scope(), (b'{"input": "\xff"}',)),                           # not UTF-8
    ]:
        inner_got, sent, errors = _run(scope, _body(*parts))
        assert [m.get("body") for m in inner_got] == list(parts), scope
        assert sent == [] and errors == []


def test_a_client_gone_before_its_body_is_in_gets_nothing() -> None:
    inner_got, sent, errors = _run(_scope(), [{"type": "http.request", "body": b'{"in', "more_body": True},
                                              {"type": "http.disconnect"}])
    assert inner_got == [] and sent == [] and errors == []


def test_a_missing_content_type_is_json_as_for_fastapi() -> None:
    # a body that validates against nothing answers through error_response, not the app behind
    inner_got, sent, errors = _run(_scope(content_type=None), _body(b'{"input": 5}'))
    assert inner_got == [] and len(errors) == 1 and errors[0][0] == 400 and errors[0][2] == "input"
    assert sent[0]["status"] == 400


def test_a_chunked_body_over_the_limit_is_refused_by_gatekeeper_in_front() -> None:
    """Gatekeeper stays in front of the fast path: a chunked body (no Content-Length) that
    crosses the limit while the fast path reads it is a 413, and the app behind never runs."""
    from stoker.server.http.middleware import Gatekeeper

    inner_called: list[bool] = []
    sent: list[dict[str, Any]] = []
    queue = _body(b'{"input": "' + b"x" * 60, b"x" * 60, b'"}')

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        inner_called.append(True)

    def error_response(*args: Any) -> Response:
        raise AssertionError(f"the fast path answered {args}")

    app = Gatekeeper(PoolingEndpoints(inner, state=None, error_response=error_response), api_key=None, max_body_bytes=100)
    asyncio.run(app(_scope(), receive, send))
    assert inner_called == [] and sent[0]["status"] == 413
