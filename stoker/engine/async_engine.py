"""AsyncEngine: one thread steps the LLMEngine; each request gets an async stream of outputs.

Why a dedicated thread and not an asyncio task: a model step is a blocking torch call (tens
of milliseconds for a decode on CPU, much longer for a big prefill). On the event loop it
would freeze every connection for that long; in a thread, torch releases the GIL inside its
kernels, so the loop keeps accepting, parsing and streaming while the model computes.

Threading contract (the engine is not thread-safe):
- after `start()` only the engine thread touches the LLMEngine;
- the event loop talks to it through a deque of typed commands (`AddRequest` carrying a
  checked `EngineRequest`, `AbortRequest`, `CollectUnloadedLoRAs`) plus a wake-up event;
- the engine thread answers with one `loop.call_soon_threadsafe` per step carrying all of
  that step's outputs, so the loop is woken once per step, not once per request.

This is the server's whole view of the engine: it builds requests with `input_processor`, reads
the engine's fixed facts from `info`, manages LoRA adapters and health through the methods
here, and never reaches the LLMEngine behind it.

Every torch call of the server (loading, warm-up, steps) runs on one thread, the engine
thread (`build` loads the model there). On CPU, OpenMP keeps a thread team per calling
thread; once two threads have run torch's parallel ops, each step was measured 25-30% slower
than when a single thread does all of them.

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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stoker.core.expert_load import ExpertLoad
from stoker.core.step import StepShape
from stoker.engine.input_processor import EngineRequest, InputProcessor
from stoker.engine.llm_engine import EngineStats, LLMEngine, StepFailed
from stoker.engine.info import EngineInfo
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
class AddRequest:
    request: EngineRequest


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class CollectUnloadedLoRAs:
    """An adapter was unloaded: drop it from its slot once no running sequence uses it."""


Command = AddRequest | AbortRequest | CollectUnloadedLoRAs


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
        # The consumer's pending wait, if it is waiting: a bare future, not an asyncio.Event
        # (whose wait makes a future, queues and unqueues it, for every output of every request).
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False
        self.is_queued = True  # no output yet: counts against max_waiting_requests

    # Called on the event loop by AsyncEngine.
    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a cancelled consumer's future is done already
                waiter.set_result(None)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                if self._latest is None and self._error is None:
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
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
        thread: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        """thread: the single-worker executor the engine was built on (see `build`); a new one
        when None."""
        self._engine = engine
        self.observer = observer
        self.max_waiting_requests = max_waiting_requests
        self._thread = thread or engine_executor()
        self._commands: collections.deque[Command] = collections.deque()
        self._wake = threading.Event()
        engine.transfer_poll_wait = self._wait_for_command  # KV transfer polls end early when a request arrives
        self._streams: dict[str, RequestStream] = {}
        self._num_queued = 0  # touched on the loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future: concurrent.futures.Future | None = None
        self._stop = False
        self._accepting = False
        self._closed = False
        self.dead_error: BaseException | None = None
        cfg = engine.config
        self.info = EngineInfo(
            model_path=cfg.model_config.model, hf_config=engine.hf_config, max_model_len=engine.max_model_len,
            vocab_size=engine.input_limits.vocab_size, max_num_seqs=cfg.scheduler_config.max_num_seqs,
            max_loras=cfg.lora_config.max_loras if cfg.lora_config is not None else None,
            cache_config=cfg.cache_config, tensor_parallel_size=cfg.parallel_config.tensor_parallel_size,
            runner=engine.runner_info,
        )
        self._snapshot = self._take_snapshot()

    @classmethod
    async def build(cls, factory: Callable[[], LLMEngine], **kwargs: Any) -> AsyncEngine:
        """Build the LLMEngine on a new engine thread (every later torch call runs there too)."""
        thread = engine_executor()
        try:
            engine = await asyncio.get_running_loop().run_in_executor(thread, factory)
        except BaseException:
            thread.shutdown(wait=False)
            raise
        return cls(engine, thread=thread, **kwargs)

    # ------------------------------------------------------------------ lifecycle
    async def warm_up(self) -> None:
        """Before `start`: two greedy tokens through the whole path (prefill, decode, sampler) on
        the engine thread, then check the KV cache is whole. A server is ready once it has generated."""
        assert self._future is None, "warm up before the step loop starts"
        await asyncio.get_running_loop().run_in_executor(self._thread, self._warm_up)

    def _warm_up(self) -> None:
        engine = self._engine
        ids = engine.tokenizer.encode("Hello") or [0]
        request = engine.input_processor.process("stoker-warmup", None, SamplingParams(max_tokens=2, temperature=0.0), ids)
        engine.add_request(request)
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run the step loop on the engine thread."""
        self._loop = loop or asyncio.get_running_loop()
        self._accepting = True
        self._future = self._thread.submit(self._run)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Stop taking requests, let those in flight finish (up to the timeout), stop the loop,
        then the engine's executor (tensor-parallel workers); safe to call more than once."""
        self._accepting = False
        if self._closed:
            return
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        while self._streams and self.dead_error is None and self._future is not None:
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
        self._closed = True
        await asyncio.to_thread(self._engine.shutdown)
        self._thread.shutdown(wait=False)

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

    def collective_summary(self) -> str | None:
        """A line on the all-reduces since the last call (tensor parallelism; None otherwise)."""
        return self._engine.executor.collective_summary()

    def expert_load(self) -> ExpertLoad | None:
        """Tokens per expert per MoE layer since start (None for a dense model), read from rank
        0's device counters off the engine thread: a racy read is off by a step at most, and it
        costs one device-to-host copy, so it is read at the log interval and on a scrape only."""
        return self._engine.expert_load()

    # ------------------------------------------------------------------ inputs (any thread)
    def input_processor(self, tokenizer: Any) -> InputProcessor:
        """A request builder for this engine using `tokenizer`; run it off the event loop, on
        the thread that owns that tokenizer."""
        return self._engine.make_input_processor(tokenizer)

    # ------------------------------------------------------------------ LoRA adapters
    @property
    def lora_enabled(self) -> bool:
        return self._engine.lora is not None

    def has_lora(self, name: str) -> bool:
        lora = self._engine.lora
        return lora is not None and lora.has(name)

    def lora_names(self) -> list[str]:
        lora = self._engine.lora
        return lora.names() if lora is not None else []

    def lora_path(self, name: str) -> str:
        assert self._engine.lora is not None
        return self._engine.lora.path_of(name)

    async def load_lora(self, name: str, path: str) -> None:
        """Read, check and register a PEFT adapter (LoRAError naming what is wrong): on the
        engine thread before the loop starts (start-up adapters), on a worker thread after
        (the registry is locked; slots are filled by the engine thread when a step needs one)."""
        if self._future is None:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._engine.load_lora, name, path)
        else:
            await asyncio.to_thread(self._engine.load_lora, name, path)

    def unload_lora(self, name: str) -> None:
        """New requests may no longer name it (LoRAError if it is not loaded); the engine thread
        drops it from its slot once its requests in flight have finished."""
        lora = self._engine.lora
        if lora is None:
            raise ValueError("LoRA is off")
        lora.remove(name)
        self._commands.append(CollectUnloadedLoRAs())
        self._wake.set()

    # ------------------------------------------------------------------ requests (event loop)
    def add_request(self, request: EngineRequest) -> RequestStream:
        """Admit a checked request now (raises at once if refused); iterate the stream for outputs."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has died: {self.dead_error!r}")
        if not self._accepting:
            raise EngineNotAcceptingError("the server is shutting down")
        n = request.params.n
        limit = self.max_waiting_requests
        if limit is not None and n > limit:
            raise ValueError(f"n = {n} sequences can never fit the waiting queue of {limit} sequences "
                             f"(--max-waiting-requests); ask for n <= {limit}")
        if limit is not None and self._num_queued + n > limit:
            raise QueueFullError(f"{self._num_queued} sequences are already waiting (limit {limit}, counted as vLLM "
                                 f"does: n per prompt); this request adds {n}")
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, n)
        self._streams[request_id] = stream
        self._num_queued += n
        self._commands.append(AddRequest(request))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._dequeue(stream)
        if self.dead_error is None:
            self._commands.append(AbortRequest(request_id))
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
        bm = self._engine.block_manager
        return EngineSnapshot(self._engine.stats(), bm.num_free_blocks, bm.num_blocks)

    def _call_loop(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during interpreter shutdown
            pass

    def _drain_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, AddRequest):
                request = command.request
                try:
                    self._engine.add_request(request)
                except Exception as exc:  # a bad request fails alone
                    self._notify_failed(request.request_id)
                    self._call_loop(self._fail, request.request_id, exc)
                else:
                    # The request's parameters (n, max_tokens) are not in its outputs; metrics need them.
                    self._observe("on_added", request.request_id, request.params)
            elif isinstance(command, AbortRequest):
                out = self._engine.abort_request(command.request_id)
                if out is not None:
                    self._notify([out])
            else:
                self._engine.collect_unloaded_loras()

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

    def _wait_for_command(self, timeout_s: float) -> None:
        """Between two KV transfer polls (blocks leased, reads in flight): up to timeout_s, but
        no longer than until a request, an abort or a stop arrives (the next loop turn takes it)."""
        if self._wake.wait(timeout_s):
            self._wake.clear()

    def _run(self) -> None:
        engine = self._engine
        consecutive_failures = 0
        try:
            while not self._stop:
                self._drain_commands()
                if not engine.has_unfinished_requests() and not engine.has_pending_kv_transfers():
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
                    consecutive_failures += 1 if failed.engine_fault else 0
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
