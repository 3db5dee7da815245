"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

Timing follows vLLM's `bench serve` (shared/reference/facts.md): TTFT is request sent ->
first chunk that carries content; ITL is the gap between successive content chunks; E2EL
is request sent -> last content chunk. Every way a stream can go wrong is a *failure with a
reason*, never a success: a non-200 status, an SSE error payload inside a 200 stream, a
stream that ends without content or without `[DONE]`, a timeout, a broken connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Failure reasons (keys of the report's `failures` table). HTTP errors are "http_<status>".
TIMEOUT = "timeout"
SSE_ERROR = "sse_error"
NO_CONTENT = "no_content"
TRUNCATED = "truncated_stream"
CONNECTION = "connection_error"
BAD_PAYLOAD = "bad_payload"


@dataclass(frozen=True)
class RequestSpec:
    """What to send: the prompt and how many tokens to ask for."""

    prompt: str
    prompt_len: int  # tokens as the dataset counted them (exact only with --tokenizer)
    max_tokens: int


@dataclass
class RequestResult:
    """What happened to one request. Times are seconds; `start`/`end` are run-relative."""

    success: bool = False
    error_reason: str | None = None
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL: sent -> last content chunk
    prompt_len: int = 0
    prompt_tokens: int | None = None  # from usage.prompt_tokens when the server sends it
    output_tokens: int | None = None  # from usage.completion_tokens when the server sends it
    num_chunks: int = 0  # content chunks received
    http_status: int | None = None  # None: no response arrived
    generated_text: str = ""

    def fail(self, reason: str, message: str) -> RequestResult:
        self.success = False
        self.error_reason = reason
        self.error = message[:500]
        return self


@dataclass
class LiveCounters:
    """Shared by all in-flight requests; read by the progress display (plain ints: cheap)."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    chunks: int = 0


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: built once per run, shared by every request."""

    url: str  # full URL of /v1/completions or /v1/chat/completions
    model: str
    chat: bool
    headers: dict[str, str]
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM/Stoker extension: generate exactly max_tokens
        body.update(self.extra_body)
        return body


def _content(event: dict[str, Any], chat: bool) -> str:
    choices = event.get("choices")
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        # Reasoning models stream thoughts first; those are output tokens too.
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def _event_error(event: dict[str, Any]) -> str | None:
    if "error" in event:
        err = event["error"]
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    if event.get("object") == "error":  # vLLM's older in-stream error shape
        return str(event.get("message", event))
    return None


async def send_request(session: aiohttp.ClientSession, endpoint: Endpoint, spec: RequestSpec,
                       t0: float, counters: LiveCounters | None = None) -> RequestResult:
    """Send one streamed request; never raises for server misbehaviour (see module doc)."""
    result = RequestResult(prompt_len=spec.prompt_len)
    body = json.dumps(endpoint.payload(spec)).encode()
    sent = time.perf_counter()
    result.start = sent - t0
    try:
        try:
            await _stream(session, endpoint, body, sent, result, counters)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if result.http_status is not None:
                raise
            # No answer at all: the pooled kept-alive connection was one the server had closed
            # (llama-server closes each after a streamed response without saying so). The
            # request never reached a handler; send it once more, on a new connection.
            sent = time.perf_counter()
            result.start = sent - t0
            await _stream(session, endpoint, body, sent, result, counters)
    except asyncio.TimeoutError:
        result.fail(TIMEOUT, "request timed out (see --request-timeout)")
    except aiohttp.ClientPayloadError as exc:
        result.fail(TRUNCATED, f"stream broke off: {exc}")
    except aiohttp.ClientError as exc:
        result.fail(CONNECTION, f"{type(exc).__name__}: {exc}")
    except OSError as exc:
        result.fail(CONNECTION, f"{type(exc).__name__}: {exc}")
    result.end = time.perf_counter() - t0
    return result


async def _stream(session: aiohttp.ClientSession, endpoint: Endpoint, body: bytes, sent: float,
                  result: RequestResult, counters: LiveCounters | None) -> None:
    async with session.post(endpoint.url, data=body, headers=endpoint.headers) as resp:
        result.http_status = resp.status
        if resp.status != 200:
            text = await resp.text(errors="replace")
            result.fail(f"http_{resp.status}", text.strip() or resp.reason or "")
            return
        last = sent
        seen_done = False
        text_parts: list[str] = []
        buffer = b""
        # iter_any hands over whatever arrived; events are split on the SSE blank line. All
        # events in one read share its arrival time (they did arrive together).
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            if b"\r" in data:  # the SSE spec allows CRLF line ends
                data = data.replace(b"\r\n", b"\n")
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for raw in events:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # comments (": keep-alive"), "event:" lines, blank keep-alives
                line = line[5:].strip()
                if line == b"[DONE]":
                    seen_done = True
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    result.fail(BAD_PAYLOAD, f"not JSON: {line[:200]!r}")
                    return
                error = _event_error(event)
                if error is not None:
                    result.fail(SSE_ERROR, error)
                    return
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                content = _content(event, endpoint.chat)
                if not content:
                    continue
                if result.num_chunks == 0:
                    result.ttft = now - sent
                else:
                    result.itl.append(now - last)
                last = now
                result.num_chunks += 1
                text_parts.append(content)
                if counters is not None:
                    counters.chunks += 1
        result.generated_text = "".join(text_parts)
        if result.num_chunks == 0:
            result.fail(NO_CONTENT, "stream ended without any content")
        elif not seen_done:
            result.fail(TRUNCATED, "stream ended without data: [DONE]")
        else:
            result.success = True
            result.latency = last - sent
