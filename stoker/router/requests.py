"""What the router reads from an OpenAI request body, and the prefill leg it derives. [no torch]

The router forwards bodies it does not validate (the upstream server does, and answers 400
naming a bad field); it only reads the prompt (for prefix affinity and the local/remote
prefill decision) and, in disaggregated mode, rewrites the body for each leg.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Receive

# vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) and vLLM's
# NixlConnector: a prefill server told `do_remote_decode` keeps the prompt's KV blocks for a
# remote reader and answers with the kv_transfer_params the decode server needs to pull them.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class BadRequest(ValueError):
    """The body is not a JSON object: answered 400 by the router itself."""

    status = 400


class BodyTooLarge(BadRequest):
    status = 413


class ClientGone(BadRequest):
    """The client left mid-request; the answer goes nowhere (uvicorn drops it)."""


async def read_body(receive: Receive, content_length: bytes | None, limit: int) -> bytes:
    """The request body, read from the ASGI `receive` and refused past `limit` bytes before it
    is all buffered (as `stoker serve` refuses bodies over --max-request-body-bytes)."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect: no one is left to answer
            raise ClientGone("the client closed the connection before sending its whole request")
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"the request body is larger than {limit} bytes (the router's --max-request-body-bytes); "
                        "send a smaller request")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_text(body: dict[str, Any], chat: bool) -> str:
    """A string whose prefixes stand for the prompt's: the prompt itself, token ids joined, or
    the messages as role + content in order (the chat template adds the same framing to every
    request, so prefixes of this string match when the rendered prompts' prefixes do)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"<{m.get('role', '')}>{_content_text(m.get('content'))}\n"
                       for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return " ".join(str(t) for t in prompt)
        if isinstance(first, str):  # a batch: its first prompt
            return first
        if isinstance(first, list):
            return " ".join(str(t) for t in first)
    return ""


def single_sequence(body: dict[str, Any], chat: bool) -> bool:
    """One prompt and one completion: what one kv_transfer_params can describe. A batch of
    prompts, n > 1 or best_of > 1 are prefilled on the decode server."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            return False
    for key in ("n", "best_of"):
        v = body.get(key)
        if isinstance(v, int) and v > 1:
            return False
    return True


def token_ids_of(body: dict[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids (one sequence), else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return prompt
        if len(prompt) == 1 and isinstance(prompt[0], list):
            return prompt[0]
    return None


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request, as vLLM's proxy sends it: the original with one output
    token, no streaming, and `do_remote_decode`."""
    leg = dict(body)
    leg["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    return leg


def decode_leg(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The decode server's request: the original (its max_tokens, its stream) plus the params
    the prefill server returned."""
    return {**body, "kv_transfer_params": kv_transfer_params}
