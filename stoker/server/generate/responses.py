"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat path.

The request becomes a chat-completions request (responses_protocol.py) and runs through
OpenAIServingChat unchanged, so templating, structured outputs and tool calling (parsed or
enforced) exist once. Its answer is re-shaped: a chat.completion becomes a Response with
message and function_call output items; a chat stream's chunks become Responses events
(response.created, output_item.added, output_text.delta, function_call_arguments.delta, ...,
response.completed), each with its sequence_number, as the `openai` SDK's stream reads them.
With `--reasoning-parser`, the chat message's reasoning becomes a `reasoning` item before the
message (`{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", ...}]}`,
as OpenAI and vLLM return it), streamed as response.reasoning_text.delta events.
The chat stream is read as the dicts its chunks encode (one json.loads per chunk, beside a
forward pass per token: not the cost that matters).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stoker.server.errors import bad_request, describe_validation_errors
from stoker.server.generate.protocol import ChatCompletionRequest
from stoker.server.generate.responses_protocol import ResponsesRequest
from stoker.server.generate.serving import Serving, new_id
from stoker.server.generate.chat import OpenAIServingChat


class OpenAIServingResponses(Serving):
    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        try:
            chat = ChatCompletionRequest.model_validate(req.chat_body())
        except ValueError as exc:  # pydantic's ValidationError is a ValueError too
            if isinstance(exc, ValidationError):
                message, param = describe_validation_errors(exc.errors())
                raise bad_request(message, _responses_param(param)) from None
            field = re.match(r"[a-z_]+", str(exc))  # chat_body's messages start with the field
            raise bad_request(str(exc), field.group(0) if field else None) from None
        answer = await OpenAIServingChat(self.state).create(chat, raw)
        shell = _Shell(new_id("resp"), self.state.check_model(req.model), req.echo_fields())
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(_events(shell, answer.body_iterator), media_type="text/event-stream")
        return JSONResponse(shell.from_completion(json.loads(bytes(answer.body))))


def _responses_param(param: str | None) -> str | None:
    """A chat field named in an error, as the Responses request calls it."""
    return {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}.get(param or "", param)


class _Shell:
    """The Response object around the output items: the request's echoed fields, the status."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any]) -> None:
        self.id = response_id
        self.model = model
        self.echo = echo
        self.created_at = int(time.time())

    def response(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model, "status": status,
            "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage, **self.echo,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        }

    def from_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = body["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            output.append(_reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content") or not (message.get("tool_calls") or output):
            output.append(_message_item(new_id("msg"), message.get("content") or "", "completed"))
        for call in message.get("tool_calls") or []:
            output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
        status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
        return self.response(output, status, _usage(body.get("usage")))


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.rsplit("-", 1)[-1].rsplit("_", 1)[-1], "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


async def _chunks(body: AsyncIterator[bytes | str]) -> AsyncIterator[dict[str, Any]]:
    """The chat stream's chunks as dicts (SSE `data:` lines; [DONE] ends it)."""
    buffer = b""
    async for piece in body:
        buffer += piece if isinstance(piece, bytes) else piece.encode()
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                    yield json.loads(line[6:])


class _EventWriter:
    """Responses events, numbered in order."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def _events(shell: _Shell, chat_stream: AsyncIterator[bytes | str]) -> AsyncIterator[bytes]:
    emit = _EventWriter()
    yield emit("response.created", response=shell.response([], "in_progress"))
    yield emit("response.in_progress", response=shell.response([], "in_progress"))
    output: list[dict[str, Any]] = []  # finished items
    text_item: dict[str, Any] | None = None  # the open message item
    reasoning_item: dict[str, Any] | None = None  # the open reasoning item
    calls: dict[int, tuple[int, dict[str, Any]]] = {}  # chat tool-call index -> (output index, open item)
    finish_reason = None
    usage = None

    def close_text() -> list[bytes]:
        nonlocal text_item
        if text_item is None:
            return []
        item, index, text = text_item, len(output), text_item["content"][0]["text"]
        item["status"] = "completed"
        output.append(item)
        text_item = None
        part = item["content"][0]
        return [emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                     logprobs=[]),
                emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
                emit("response.output_item.done", output_index=index, item=item)]

    def close_reasoning() -> list[bytes]:
        nonlocal reasoning_item
        if reasoning_item is None:
            return []
        item, index = reasoning_item, len(output)
        item["status"] = "completed"
        output.append(item)
        reasoning_item = None
        return [emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                     text=item["content"][0]["text"]),
                emit("response.output_item.done", output_index=index, item=item)]

    def close_calls() -> list[bytes]:
        events = []
        for index in sorted(calls):
            position, item = calls.pop(index)
            item["status"] = "completed"
            events += [emit("response.function_call_arguments.done", item_id=item["id"], output_index=position,
                            arguments=item["arguments"], name=item["name"]),
                       emit("response.output_item.done", output_index=position, item=item)]
        return events

    async for chunk in _chunks(chat_stream):
        if "error" in chunk:  # the engine failed the request mid-stream
            err = chunk["error"]
            yield emit("response.failed", response=shell.response(output, "failed",
                                                                   error={"code": "server_error", "message": err.get("message", "")}))
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if reasoning_item is None:
                    for event in close_text() + close_calls():
                        yield event
                    reasoning_item = _reasoning_item(new_id("rs"), "", "in_progress")
                    yield emit("response.output_item.added", output_index=len(output),
                               item={**reasoning_item, "content": []})
                reasoning_item["content"][0]["text"] += delta["reasoning_content"]
                yield emit("response.reasoning_text.delta", item_id=reasoning_item["id"], output_index=len(output),
                           content_index=0, delta=delta["reasoning_content"])
            if delta.get("content") or delta.get("tool_calls"):
                for event in close_reasoning():
                    yield event
            if delta.get("content"):
                for event in close_calls():
                    yield event
                if text_item is None:
                    text_item = _message_item(new_id("msg"), "", "in_progress")
                    index = len(output)
                    yield emit("response.output_item.added", output_index=index,
                               item={**text_item, "content": []})
                    yield emit("response.content_part.added", item_id=text_item["id"], output_index=index,
                               content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                text_item["content"][0]["text"] += delta["content"]
                yield emit("response.output_text.delta", item_id=text_item["id"], output_index=len(output),
                           content_index=0, delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls") or []:
                index = call.get("index", 0)
                fn = call.get("function") or {}
                if index not in calls:
                    for event in close_text():
                        yield event
                    item = _call_item(call.get("id") or new_id("call"), fn.get("name") or "", "", "in_progress")
                    calls[index] = (len(output), item)
                    output.append(item)
                    yield emit("response.output_item.added", output_index=len(output) - 1, item=dict(item))
                position, item = calls[index]
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    yield emit("response.function_call_arguments.delta", item_id=item["id"], output_index=position,
                               delta=fn["arguments"])
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
    for event in close_reasoning() + close_text() + close_calls():
        yield event
    if finish_reason is None:  # the stream ended without a finish: the client went away or it was aborted
        yield emit("response.failed", response=shell.response(output, "failed",
                                                               error={"code": "server_error", "message": "generation ended early"}))
        return
    status = "incomplete" if finish_reason == "length" else "completed"
    yield emit(f"response.{status}", response=shell.response(output, status, _usage(usage)))

