"""`/openapi.json` as the server behaves, not as FastAPI assumes (issue 20).

FastAPI documents a 422 with its own validation-error body on every route that takes a body,
and a JSON 200 everywhere; this server answers 400 in OpenAI's error shape, streams
`text/event-stream` when asked, serves Prometheus text on `/metrics` and an empty 200 on
`/health`. `install(app)` replaces FastAPI's generator with one that writes each route's real
responses. tests/server/test_openapi.py holds the server to it with schemathesis.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
# /v1/messages answers errors in Anthropic's shape (http/anthropic_errors.py).
_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}
_ANTHROPIC_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicErrorResponse"}}}
_JSON = {"application/json": {"schema": {"type": "object"}}}
_JSON_OR_SSE = {**_JSON, "text/event-stream": {"schema": {"type": "string"}}}

_WHY = {
    400: "invalid request: bad JSON, not valid Unicode, outside the schema or a value range, too long",
    401: "missing or wrong API key (when the server has one)",
    404: "no such model (/tokenizer_info: turned off by --no-enable-tokenizer-info-endpoint)",
    408: "the request's headers or body did not arrive in time",
    413: "request body over --max-request-body-bytes",
    500: "internal error (the connection is closed)",
    503: "model loading, engine stopped, shutting down, or the waiting queue is full (Retry-After)",
}

# path -> method -> (200's content or None for an empty body, the error statuses it can answer)
_ROUTES: dict[str, dict[str, tuple[dict[str, Any] | None, tuple[int, ...]]]] = {
    "/v1/completions": {"post": (_JSON_OR_SSE, (400, 401, 404, 408, 413, 500, 503))},
    "/v1/chat/completions": {"post": (_JSON_OR_SSE, (400, 401, 404, 408, 413, 500, 503))},
    "/v1/responses": {"post": (_JSON_OR_SSE, (400, 401, 404, 408, 413, 500, 503))},
    "/v1/messages": {"post": (_JSON_OR_SSE, (400, 401, 404, 408, 413, 500, 503))},
    "/v1/messages/count_tokens": {"post": (_JSON, (400, 401, 404, 408, 413, 500, 503))},
    "/tokenize": {"post": (_JSON, (400, 401, 404, 408, 413, 500, 503))},
    "/detokenize": {"post": (_JSON, (400, 401, 404, 408, 413, 500, 503))},
    "/v1/models": {"get": (_JSON, (401, 500, 503))},
    "/v1/embeddings": {"post": (_JSON, (400, 401, 404, 408, 413, 500, 503))},
    "/v1/rerank": {"post": (_JSON, (400, 401, 404, 408, 413, 500, 503))},
    "/v1/score": {"post": (_JSON, (400, 401, 404, 408, 413, 500, 503))},
    "/health": {"get": (None, (500, 503))},
    "/v1/health/live": {"get": (_JSON, (500, 503))},
    "/v1/health/ready": {"get": (_JSON, (500, 503))},
    "/metrics": {"get": ({"text/plain": {"schema": {"type": "string"}}}, (500,))},
    "/tokenizer_info": {"get": (_JSON, (401, 404, 500, 503))},
    "/v1/load_lora_adapter": {"post": ({"text/plain": {"schema": {"type": "string"}}}, (400, 401, 404, 408, 413, 500, 503))},
    "/v1/unload_lora_adapter": {"post": ({"text/plain": {"schema": {"type": "string"}}}, (400, 401, 404, 408, 413, 500, 503))},
}


def build(app: FastAPI) -> dict[str, Any]:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    schemas["AnthropicErrorResponse"] = _ANTHROPIC_ERROR_SCHEMA
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            ok, errors = _ROUTES.get(path, {}).get(method, (_JSON, (400, 500)))
            responses: dict[str, Any] = {"200": {"description": "OK"}}
            if ok is not None:
                responses["200"]["content"] = ok
            error = _ANTHROPIC_ERROR if path.startswith("/v1/messages") else _ERROR
            for status in errors:
                responses[str(status)] = {"description": _WHY[status], "content": error}
            op["responses"] = responses
    return spec


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
