"""AsyncEngine: one thread steps the LLMEngine; each request gets an async stream of outputs.

Why a dedicated thread and not an asyncio task: a model step is a blocking torch call (tens
of milliseconds for a decode on CPU, much longer for a big prefill). On the event loop it
would freeze every connection for that long; in a thread, torch releases the GIL inside its
kernels, so the loop keeps accepting, parsing and streaming while the model computes.

Threading contract (the engine is not thread-safe):
- after `start()` only the engine thread touches the LLMEngine;
- the event loop talks to it through a command deque (add / abort) plus a wake-up event;
- the engine thread answers with one `loop.call_soon_threadsafe` per step carrying all of
  that step's outputs, so the loop is woken once per step, not once per request.

Every torch call of the server (loading, warm-up, steps) should run on that one thread: pass
the same single-worker executor to the loading code and to `start`. On CPU, OpenMP keeps a
thread team per calling thread; once two threads have run torch's parallel ops, each step
was measured 25-30% slower than when a single thread does all of them.

Outputs are cumulative (text and token ids so far), so a request's stream keeps only the
latest one: a consumer that falls behind skips intermediate states and loses nothing.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from stoker.core.step import StepShape
from stoker.engine.llm_engine import EngineStats, LLMEngine, StepFailed
from stoker.outputs import RequestOutput
from stoker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# Steps in a row that may fail (each failing only its own requests) before the engine is
# declared dead: a fault that fails every step is the engine's (a broken device, say).
MAX_CONSECUTIVE_STEP_FAILURES = 3


def engine_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that runs the engine's torch work (see the module docstring)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stoker-engine")


class EngineDeadError(RuntimeError):
    """The step loop raised; no request can be served any more."""


class EngineNotAcceptingError(RuntimeError):
    """The engine is shutting down (or not started) and takes no new request."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_waiting_requests` allows."""


class EngineObserver(Protocol):
    """Called on the engine thread; must be quick and must not touch the engine."""

    def on_added(self, request_id: str, params: SamplingParams) -> None: ...

    def on_step(self, num_tokens: int, shape: StepShape | None, seconds: float, request_ids: list[str]) -> None: ...

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_failed(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine figures taken on the engine thread after each step (safe to read anywhere)."""

    stats: EngineStats
    num_free_blocks: int
    num_blocks: int


class RequestStream:
    """The outputs of one request, newest only. Iterate it once; leaving early aborts."""

    def __init__(self, engine: "AsyncEngine", request_id: str, num_seqs: int = 1) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs  # n: what it counts against max_waiting_requests
        self._engine = engine
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False
        self.is_queued = True  # no output yet: counts against max_waiting_requests

    # Called on the event loop by AsyncEngine.
    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                await self._event.wait()
                self._event.clear()
                if self._latest is not None:
                    out, self._latest = self._latest, None
                    if out.finished:
                        self.finished = True
                    yield out
                    if self.finished:
                        return
                if self._error is not None:
                    self.finished = True
                    raise self._error
        finally:
            # Client gone, task cancelled, or consumer stopped early: free the KV blocks.
            self.abort()

    def abort(self) -> None:
        """Abort unless finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        observer: EngineObserver | None = None,
        max_waiting_requests: int | None = None,
    ) -> None:
        self.engine = engine
        self.observer = observer
        self.max_waiting_requests = max_waiting_requests
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._num_queued = 0  # touched on the loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future: concurrent.futures.Future | None = None
        self._stop = False
        self._accepting = False
        self.dead_error: BaseException | None = None
        self._snapshot = self._take_snapshot()

    # ------------------------------------------------------------------ lifecycle
    def start(
        self, loop: asyncio.AbstractEventLoop | None = None, executor: concurrent.futures.ThreadPoolExecutor | None = None
    ) -> None:
        """Run the step loop on `executor`'s single worker (the thread that loaded the model),
        or on a new thread of its own."""
        self._loop = loop or asyncio.get_running_loop()
        executor = executor or engine_executor()
        self._accepting = True
        self._future = executor.submit(self._run)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Stop taking requests, let those in flight finish (up to the timeout), stop the thread."""
        self._accepting = False
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        while self._streams and self.dead_error is None:
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("shutdown: aborting %d requests still in flight", len(self._streams))
                for request_id in list(self._streams):
                    self.abort(request_id)
                break
            await asyncio.sleep(0.05)
        self._stop = True
        self._wake.set()
        if self._future is not None:
            await asyncio.to_thread(concurrent.futures.wait, [self._future], 30)

    @property
    def is_running(self) -> bool:
        return self._future is not None and not self._future.done() and self.dead_error is None

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_queued(self) -> int:
        """Sequences (n per request) admitted whose request has produced no output yet."""
        return self._num_queued

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # ------------------------------------------------------------------ requests (event loop)
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> RequestStream:
        """Admit a request now (raises at once if refused); iterate the stream for outputs."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead_error!r}")
        if not self._accepting:
            raise EngineNotAcceptingError("the server is shutting down")
        limit = self.max_waiting_requests
        if limit is not None and params.n > limit:
            raise ValueError(f"n = {params.n} sequences can never fit the waiting queue of {limit} sequences "
                             f"(--max-waiting-requests); ask for n <= {limit}")
        if limit is not None and self._num_queued + params.n > limit:
            raise QueueFullError(f"{self._num_queued} sequences are already waiting (limit {limit}, counted as vLLM "
                                 f"does: n per prompt); this request adds {params.n}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, params.n)
        self._streams[request_id] = stream
        self._num_queued += params.n
        arrival = time.time() if arrival_time is None else arrival_time
        self._commands.append(("add", (request_id, prompt, params, prompt_token_ids, arrival, lora_name)))
        self._wake.set()
        return stream

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(request_id, prompt_token_ids, params, prompt):
            yield out

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._dequeue(stream)
        if self.dead_error is None:
            self._commands.append(("abort", request_id))
            self._wake.set()

    def _dequeue(self, stream: RequestStream) -> None:
        if stream.is_queued:
            stream.is_queued = False
            self._num_queued -= stream.num_seqs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """On the loop: hand each output to its stream."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            self._dequeue(stream)
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._dequeue(stream)
            stream._fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, exc)

    # ------------------------------------------------------------------ engine thread
    def _take_snapshot(self) -> EngineSnapshot:
        bm = self.engine.block_manager
        return EngineSnapshot(self.engine.stats(), bm.num_free_blocks, bm.num_blocks)

    def _call_loop(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during interpreter shutdown
            pass

    def _drain_commands(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                request_id, prompt, params, prompt_token_ids, arrival, lora_name = payload
                try:
                    self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                                            arrival_time=arrival, lora_name=lora_name)
                except Exception as exc:  # a bad request fails alone
                    self._notify_failed(request_id)
                    self._call_loop(self._fail, request_id, exc)
                else:
                    # The request's parameters (n, max_tokens) are not in its outputs; metrics need them.
                    self._observe("on_added", request_id, params)
            else:
                out = self.engine.abort_request(payload)
                if out is not None:
                    self._notify(([out]))

    def _notify(self, outputs: list[RequestOutput]) -> None:
        if self.observer is None or not outputs:
            return
        try:
            self.observer.on_outputs(outputs, time.time())
        except Exception:  # metrics must never take the engine down
            logger.exception("engine observer failed")

    def _notify_failed(self, request_id: str) -> None:
        self._observe("on_failed", request_id)

    def _observe(self, method: str, *args: Any) -> None:
        if self.observer is not None:
            try:
                getattr(self.observer, method)(*args)
            except Exception:  # metrics must never take the engine down
                logger.exception("engine observer failed")

    def _run(self) -> None:
        engine = self.engine
        consecutive_failures = 0
        try:
            while not self._stop:
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self._snapshot = self._take_snapshot()
                    self._wake.wait(1.0)
                    self._wake.clear()
                    engine.check_health()  # tensor parallelism: a lost rank kills the loop while idle too
                    continue
                before = self._snapshot.stats  # taken after the last step or idle wait: adds and aborts compute no token
                start = time.perf_counter()
                try:
                    outputs = engine.step()
                    consecutive_failures = 0
                    # What the step computed and how long it took: the wall verdict (metrics).
                    step_record = (engine.last_step_shape, time.perf_counter() - start, engine.last_step_request_ids)
                except StepFailed as failed:
                    # Those requests fail alone; the engine is whole. A fault that fails every
                    # step is the engine's, not a request's: then the loop dies as before.
                    consecutive_failures += 1
                    if consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    outputs = failed.outputs
                    step_record = (None, 0.0, [])
                    error = RuntimeError(f"generation failed: {failed}")
                    for request_id in failed.request_ids:
                        self._notify_failed(request_id)
                        self._call_loop(self._fail, request_id, error)
                self._snapshot = self._take_snapshot()
                after = self._snapshot.stats
                # Tokens this step computed (prompt chunks + sampled), vLLM's iteration_tokens_total.
                self._observe("on_step", after.prompt_tokens + after.generation_tokens - before.prompt_tokens - before.generation_tokens,
                              *step_record)
                if outputs:
                    self._call_loop(self._deliver, outputs)
                    self._notify(outputs)
        except BaseException as exc:
            logger.exception("the engine loop died; failing every request in flight")
            self.dead_error = exc
            for request_id in list(engine.requests):
                self._notify_failed(request_id)
            self._call_loop(self._fail_all, EngineDeadError(f"the engine loop has died: {exc!r}"))
