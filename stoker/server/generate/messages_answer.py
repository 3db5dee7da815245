"""A chat answer re-shaped as Anthropic's: a chat.completion -> a `message`, a chat stream ->
Anthropic's stream events.

Events, in Anthropic's order: message_start (the message with empty content and usage
input_tokens), ping, then per content block content_block_start, content_block_delta ...
(`text_delta`; `input_json_delta` with `partial_json` for tool_use), content_block_stop, then
message_delta (stop_reason, stop_sequence, usage output_tokens) and message_stop. An engine
failure mid-stream is an `error` event, as Anthropic streams one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from stoker.server.generate.responses import _chunks as chat_chunks  # the chat stream's chunks as dicts
from stoker.server.http.anthropic_errors import anthropic_error


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id(chat_call_id: str) -> str:
    """Anthropic's `toolu_` ids over the chat path's call ids (same unique part)."""
    return "toolu_" + chat_call_id.rsplit("-", 1)[-1]


def stop_of(finish_reason: str | None, matched: Any, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) from the chat path's finish_reason and stop_reason (vLLM's:
    the stop string that ended the output, a stop token id, or None for EOS)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason is None:
        return None, None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use input. Output cut by max_tokens may leave them incomplete:
    then {}, and stop_reason says max_tokens (a streaming client has had the partial JSON itself)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def from_completion(msg_id: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion -> an Anthropic message."""
    choice = body["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    stop_reason, stop_sequence = stop_of(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
    usage = body.get("usage") or {}
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}}


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One SSE event as Anthropic sends it: an `event:` line naming the type, then its data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


def error_event(message: str, status: int = 500) -> bytes:
    return event("error", anthropic_error(status, message))


class _Blocks:
    """The content blocks streamed so far: which one is open, and the events that open and close them."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open_kind: str | None = None
        self.called = False  # a tool_use block was started

    @property
    def index(self) -> int:
        return self.count - 1

    def close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [event("content_block_stop", {"index": self.index})]

    def start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.count += 1
        self.open_kind = block["type"]
        self.called = self.called or block["type"] == "tool_use"
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})


async def message_events(msg_id: str, model: str, prompt_len: int,
                         chat_stream: AsyncIterator[bytes | str]) -> AsyncIterator[bytes]:
    """The chat stream (with its usage chunk: stream_options.include_usage) as Anthropic's events."""
    yield event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": prompt_len, "output_tokens": 0}}})
    yield event("ping", {})
    blocks = _Blocks()
    finish_reason: str | None = None
    matched: Any = None
    input_tokens, output_tokens = prompt_len, 0
    try:
        async for chunk in chat_chunks(chat_stream):
            if "error" in chunk:  # the engine failed the request mid-stream (chat's in-band error)
                err = chunk["error"] if isinstance(chunk["error"], dict) else {}
                code = err.get("code")
                yield error_event(str(err.get("message", "generation failed")), code if isinstance(code, int) else 500)
                return
            if chunk.get("usage"):  # the chat path's own count: what message_delta states
                input_tokens = chunk["usage"].get("prompt_tokens", input_tokens)
                output_tokens = chunk["usage"].get("completion_tokens", 0)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if blocks.open_kind != "text":
                        for ev in blocks.start({"type": "text", "text": ""}):
                            yield ev
                    yield blocks.delta({"type": "text_delta", "text": delta["content"]})
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if call.get("id"):  # a new call: the chat stream sends its id and name once
                        block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn.get("name") or "",
                                 "input": {}}
                        for ev in blocks.start(block):
                            yield ev
                    if fn.get("arguments"):
                        yield blocks.delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
                if choice.get("finish_reason") is not None:
                    finish_reason, matched = choice["finish_reason"], choice.get("stop_reason")
    finally:
        if hasattr(chat_stream, "aclose"):  # a client gone mid-stream: the chat stream aborts its engine request
            await chat_stream.aclose()
    for ev in blocks.close():
        yield ev
    if finish_reason is None:  # ended without a finish: aborted
        yield error_event("generation ended early")
        return
    stop_reason, stop_sequence = stop_of(finish_reason, matched, blocks.called)
    yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                  "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}})
    yield event("message_stop", {})
