"""What completions and chat share: admission checks, engine streams, SSE framing, deltas."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from stoker.engine.async_engine import (
    EngineDeadError,
    EngineNotAcceptingError,
    QueueFullError,
    RequestStream,
)
from stoker.outputs import CompletionOutput, RequestOutput
from stoker.sampling_params import SamplingParams
from stoker.server.errors import ApiError, bad_request, param_of_value_error
from stoker.server.generate.protocol import _SamplingFields
from stoker.server.state import ServerState

T = TypeVar("T")
_FIELDS = set(_SamplingFields.model_fields) | {"max_tokens", "logprobs", "top_logprobs", "max_completion_tokens"}
SYSTEM_FINGERPRINT = "stoker-0.1.0"
DONE = b"data: [DONE]\n\n"


# json.dumps(obj, separators=(",", ":")) without building a JSONEncoder per call (json.dumps
# makes one whenever an argument differs from its defaults): the same text.
_compact = json.JSONEncoder(separators=(",", ":")).encode
_json_string = json.encoder.encode_basestring_ascii  # a str as json.dumps writes it (ensure_ascii), quoted


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _compact(obj).encode() + b"\n\n"


class ChunkEncoder:
    """SSE events of one stream: the fields every chunk repeats (id, object, created, model,
    fingerprint) are encoded once, so each token costs one small encode of its choice."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head
        self._prefix = b"data: " + _compact(head).encode()[:-1] + b',"choices":['

    def choice(self, choice: dict[str, Any], usage: dict[str, int] | None = None) -> bytes:
        """usage: the chunk's own usage (continuous_usage_stats), after the choices."""
        body = self._prefix + _compact(choice).encode()
        if usage is None:
            return body + b"]}\n\n"
        return body + b'],"usage":' + _compact(usage).encode() + b"}\n\n"

    def running_text(self, index: int, text: str) -> bytes:
        """A completion choice that only carries text: not finished, no logprobs, no usage (all
        but a stream's last chunk, usually). The bytes `choice` makes of {"index", "text",
        "logprobs": None, "finish_reason": None, "stop_reason": None}, without the dict and the
        encoder's walk over it: one per streamed request per step."""
        return b'%s{"index":%d,"text":%s,"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n' % (
            self._prefix, index, _json_string(text).encode())

    def running_content(self, index: int, text: str) -> bytes:
        """A chat choice whose delta is content alone: not finished, no logprobs, no usage. The
        bytes `choice` makes of {"index", "delta": {"content": text}, "logprobs": None,
        "finish_reason": None}."""
        return b'%s{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}\n\n' % (
            self._prefix, index, _json_string(text).encode())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_id(prefix: str, client_request_id: str | None) -> tuple[str, str]:
    """(the id the response carries, the engine's request id). A client's request_id (vLLM's
    field) names the response; the engine's id adds a random part, so two clients sending the
    same request_id never collide in the engine."""
    if client_request_id is None:
        rid = new_id(prefix)
        return rid, rid
    shown = f"{prefix}-{client_request_id}"
    return shown, f"{shown}-{uuid.uuid4().hex[:8]}"


class ClientDisconnected(Exception):
    pass


class Serving:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ------------------------------------------------------------------ checks
    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.state.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param}: token ids must be in [0, {vocab}); got {bad[:5]}", param)

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, param: str = "max_tokens") -> int:
        """vLLM's rule: prompt + max_tokens must fit the context; None means all that is left."""
        limit = self.state.max_model_len
        if prompt_len == 0:
            raise bad_request("the prompt is empty; give at least one token", "prompt")
        if max_tokens is None:
            if prompt_len >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your prompt has {prompt_len} "
                    f"tokens, which leaves no room for a completion. Please reduce the length of the prompt.", "messages")
            return limit - prompt_len
        if max_tokens >= 1 and prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
                f"Please reduce the length of the prompt or {param}.", param)
        return max_tokens

    def sampling_params(self, req: _SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs)
        except ValueError as exc:  # a ToolChoiceError names its field itself
            param = getattr(exc, "param", None) or param_of_value_error(str(exc), _FIELDS)
            raise bad_request(str(exc), param) from None

    def check_logprobs(self, value: int | None, param: str) -> None:
        cap = self.state.settings.max_logprobs
        if value is not None and not 0 <= value <= cap:
            raise bad_request(f"{param} must be in [0, {cap}], got {value}", param)

    # ------------------------------------------------------------------ engine
    async def add_all(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                      lora_name: str | None = None, req: _SamplingFields | None = None) -> list[RequestStream]:
        """One engine request per prompt, checked off the event loop by the engine's input
        processor (ids, lengths, grammar, bad_words, priority); all admitted or none (earlier ones
        aborted). req: the request body, for its priority and cache_salt."""
        engine = self.state.ready_engine()
        num_seqs = sum(p.n for p in params)
        limit = self.state.max_num_seqs
        if num_seqs > limit:
            raise bad_request(
                f"this request asks for {num_seqs} sequences ({len(prompts)} prompt(s) x n); the server runs at most "
                f"{limit} at once (--max-num-seqs): send fewer prompts or a smaller n", "n")
        ids_of = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        requests = await self.state.tokenization.engine_requests(
            [(rid, text, ids, p) for rid, (text, ids), p in zip(ids_of, prompts, params)], lora_name,
            req.priority if req is not None else 0, req.cache_salt if req is not None else None)
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(engine.add_request(request))
        except QueueFullError as exc:
            for s in streams:
                s.abort()
            raise ApiError(503, f"server busy: {exc}; retry later",
                           headers={"Retry-After": str(self.state.settings.retry_after_s)}) from None
        except (EngineDeadError, EngineNotAcceptingError) as exc:
            for s in streams:
                s.abort()
            raise ApiError(503, str(exc)) from None
        except ValueError as exc:
            for s in streams:
                s.abort()
            raise bad_request(str(exc), "n" if str(exc).startswith("n = ") else None) from None
        return streams

    @staticmethod
    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from several streams as they come; one stream: no tasks."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    queue.put_nowait((i, out, None))
                queue.put_nowait((i, None, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, None, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, out, exc = await queue.get()
                if exc is not None:
                    raise exc
                if out is None:
                    remaining -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()

    @staticmethod
    async def until_disconnect(raw: Request, work: Awaitable[T]) -> T:
        """Run a non-streaming request, cancelling it (and so aborting its engine requests)
        if the client goes away first: a blocking request must not hold KV blocks for nobody."""
        task = asyncio.ensure_future(work)

        async def watch() -> None:
            while True:
                msg = await raw.receive()
                if msg["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})  # let its finally blocks abort the engine requests
        if task.cancelled():
            raise ClientDisconnected()
        return task.result()

    async def collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        final: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in self.merged(streams):
                final[i] = out
        except ValueError as exc:  # the engine refused the request's input at admission
            raise bad_request(str(exc)) from None
        return [f for f in final if f is not None]

    def error_event(self, exc: BaseException) -> bytes:
        from stoker.server.errors import error_body

        status = 503 if isinstance(exc, EngineDeadError) else 500
        return sse(error_body(status, f"generation failed: {exc}"))

    def timing(self, out: RequestOutput | None) -> dict[str, Any] | None:
        """--enable-request-timing: where a finished request's time went, as an extension field
        OpenAI clients ignore (`stoker_timing`); None when the flag is off."""
        if out is None:
            return None
        walls = self.state.metrics.wall.request_steps(out.request_id)
        if walls is None:
            return None
        m = out.metrics

        def span(a: float | None, b: float | None) -> float | None:
            return round(b - a, 6) if a is not None and b is not None else None

        judged = {w: n for w, n in walls.items() if w != "unjudged"}
        return {
            "queue_s": span(m.arrival_time, m.first_scheduled_time) if m else None,
            "prefill_s": span(m.first_scheduled_time, m.first_token_time) if m else None,
            "decode_s": span(m.first_token_time, m.finished_time) if m else None,
            "num_steps": sum(walls.values()),
            "steps_by_wall": walls,
            "dominant_wall": max(judged, key=judged.__getitem__) if judged else None,
        }

    @staticmethod
    def usage(prompt_lens: list[int], outputs: list[RequestOutput]) -> dict[str, Any]:
        """OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens the prefix
        cache served (aiperf and OpenAI's clients read it)."""
        prompt = sum(prompt_lens)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens or 0 for o in outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class DeltaTracker:
    """What of one completion's cumulative text may be streamed now.

    A stop string can retract up to len(stop) - 1 characters that were already produced
    (they might be its beginning), so while the sequence runs the last max_stop_len - 1
    characters are held back; at the end the rest goes out. Streamed pieces then always
    concatenate to the final (non-streamed) text.
    """

    __slots__ = ("holdback", "num_chars", "num_tokens")

    def __init__(self, params: SamplingParams) -> None:
        self.holdback = max(params.max_stop_str_len - 1, 0)
        self.num_chars = 0
        self.num_tokens = 0

    def step(self, comp: CompletionOutput) -> tuple[str, int, int]:
        """(new text, first new token index, end token index)."""
        text = comp.text
        end = len(text) if comp.finish_reason is not None else max(len(text) - self.holdback, 0)
        delta = text[self.num_chars : end] if end > self.num_chars else ""
        self.num_chars += len(delta)
        start_tok, end_tok = self.num_tokens, len(comp.token_ids)
        self.num_tokens = end_tok
        return delta, start_tok, end_tok


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage a chunk carries under continuous_usage_stats: the prompt's tokens and the tokens
    of this chunk's choice so far (vLLM's definition); the final usage chunk has the totals."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now_s() -> int:
    return int(time.time())
