"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

`type` names the HTTP class the way vLLM does (BadRequestError, NotFoundError, ...) and
`code` repeats the status, so clients that switch on either work.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """Raised anywhere in request handling; app.py turns it into the JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_bytes(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param)).encode()


def param_of_value_error(message: str, known: set[str]) -> str | None:
    """SamplingParams messages start with the field name ("top_p must be in (0, 1], ...")."""
    head = message.split(" ", 1)[0]
    return head if head in known else None


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message (and the first offending field) from pydantic's error list."""
    parts: list[str] = []
    param: str | None = None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # Union branches add type names to the location ("prompt.list[int].0"): drop them.
        loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        if err.get("type") in ("invalid_unicode", "unsupported_field"):  # protocol: names the field itself
            return str(err.get("msg")), err.get("ctx", {}).get("param")
        if param is None and loc:
            param = loc[0]
        parts.append(f"{where or 'body'}: {err.get('msg')}")
    more = len(errors) - 5
    if more > 0:
        parts.append(f"(+{more} more)")
    return "invalid request: " + "; ".join(parts), param
