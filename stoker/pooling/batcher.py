"""A dynamic batcher with Triton Inference Server's knobs and names, one per served model.

Requests (each one sequence; a request with several inputs submits several items) wait in a
queue per priority level; one task forms batches and runs each on one of the model's
`num_instances` worker threads (Triton's instance_group count), so the forward never blocks the
event loop. A batch is formed when an instance is free, so with N instances up to N batches run
at once, each formed from what waits when its instance frees. Triton's rules
(docs: user_guide/model_configuration.md#dynamic-batcher):

  * a batch holds at most `max_batch_size` items;
  * it is sent at once when the queue can fill a preferred size: the largest of
    `preferred_batch_size` the queue holds (with none given, `max_batch_size`), or, Stoker's
    roofline default, once the queued tokens reach `preferred_batch_tokens` (where a step
    stops being weight-bound, batch_defaults.py);
  * otherwise it waits until the oldest item has waited `max_queue_delay_microseconds`, then
    sends what is there; an item that already waited that long (the model was busy) goes at once;
  * higher priority first: level 1 is the highest, `priority_levels` the lowest, FIFO within
    a level; priority 0 means `default_priority_level`;
  * `max_queue_size` items at most wait (0: no limit); beyond it `QueueFullError` (HTTP 503);
  * an item still queued after its timeout (`default_timeout_microseconds`, or the request's
    own) fails with `QueueTimeoutError`; a cancelled item (client gone) is dropped.

Pure asyncio: the model call is `run_batch(list of inputs) -> list of results`, any types.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any


class QueueFullError(Exception):
    pass


class QueueTimeoutError(Exception):
    pass


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 32
    preferred_batch_size: tuple[int, ...] = ()
    preferred_batch_tokens: int | None = None
    max_queue_delay_microseconds: int = 0
    priority_levels: int = 0  # 0: one level, requests may not ask for a priority
    default_priority_level: int = 0
    max_queue_size: int = 0  # 0: unbounded
    default_timeout_microseconds: int = 0  # 0: no timeout

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        bad = [p for p in self.preferred_batch_size if not 1 <= p <= self.max_batch_size]
        if bad:
            raise ValueError(f"--preferred-batch-size {bad} must be in [1, --max-batch-size {self.max_batch_size}]")
        for name in ("max_queue_delay_microseconds", "priority_levels", "max_queue_size", "default_timeout_microseconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(f"--default-priority-level must be in [1, --priority-levels {self.priority_levels}], "
                             f"got {self.default_priority_level}")

    def level_of(self, priority: int) -> int:
        """The queue index (0 = highest) for a request's priority; ValueError if out of range."""
        if not self.priority_levels:
            if priority != 0:
                raise ValueError(f"priority {priority}: this model has no priority levels (--priority-levels 0); send 0")
            return 0
        if not 0 <= priority <= self.priority_levels:
            raise ValueError(f"priority must be in [0, {self.priority_levels}] (1 highest, 0: the default "
                             f"{self.default_priority_level}), got {priority}")
        return (priority or self.default_priority_level) - 1


@dataclass(eq=False)
class _Item:
    value: Any
    num_tokens: int
    future: asyncio.Future
    arrival: float  # time.monotonic()
    level: int
    timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True)
class BatchRecord:
    """One batch as it ran: for metrics and tests."""

    size: int
    num_tokens: int
    dispatched: float  # monotonic seconds
    finished: float
    oldest_arrival: float
    levels: tuple[int, ...] = field(default=())


class DynamicBatcher:
    def __init__(self, run_batch: Callable[[list[Any]], Sequence[Any]], config: BatcherConfig, executor: Executor,
                 on_batch: Callable[[BatchRecord], None] | None = None, num_instances: int = 1) -> None:
        """`executor` must have at least `num_instances` threads: each batch in flight holds one."""
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.run_batch, self.config, self.executor, self.on_batch = run_batch, config, executor, on_batch
        self.num_instances = num_instances
        self.queues: list[collections.deque[_Item]] = [collections.deque() for _ in range(max(1, config.priority_levels))]
        self.num_queued = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._free: asyncio.Semaphore | None = None  # instances not running a batch
        self._running: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._free = asyncio.Semaphore(self.num_instances)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        for q in self.queues:
            while q:
                self._fail(q.popleft(), RuntimeError("the server is shutting down"))

    # ------------------------------------------------------------------ admission
    def can_admit(self, count: int) -> bool:
        limit = self.config.max_queue_size
        return not limit or self.num_queued + count <= limit

    def submit_many(self, values: list[Any], num_tokens: list[int], priority: int = 0,
                    timeout_microseconds: int | None = None) -> list[asyncio.Future]:
        """Queue all of a request's items or none (QueueFullError); ValueError for a bad priority."""
        level = self.config.level_of(priority)
        if not self.can_admit(len(values)):
            raise QueueFullError(f"the queue holds {self.num_queued} of --max-queue-size {self.config.max_queue_size} items")
        loop = asyncio.get_running_loop()
        timeout = self.config.default_timeout_microseconds if timeout_microseconds is None else timeout_microseconds
        now = time.monotonic()
        futures = []
        for value, n in zip(values, num_tokens):
            item = _Item(value, n, loop.create_future(), now, level)
            if timeout:
                item.timer = loop.call_later(timeout / 1e6, self._expire, item)
            self.queues[level].append(item)
            futures.append(item.future)
        self.num_queued += len(values)
        assert self._wake is not None, "start() the batcher first"
        self._wake.set()
        return futures

    async def submit(self, value: Any, num_tokens: int = 1, priority: int = 0) -> Any:
        return await self.submit_many([value], [num_tokens], priority)[0]

    def _expire(self, item: _Item) -> None:
        queue = self.queues[item.level]
        if item in queue:
            queue.remove(item)
            self.num_queued -= 1
            self._fail(item, QueueTimeoutError(f"waited {time.monotonic() - item.arrival:.3f} s in the queue, past its timeout"))

    @staticmethod
    def _fail(item: _Item, exc: BaseException) -> None:
        if item.timer is not None:
            item.timer.cancel()
        if not item.future.done():
            item.future.set_exception(exc)

    # ------------------------------------------------------------------ batch formation
    def _oldest_arrival(self) -> float | None:
        heads = [q[0].arrival for q in self.queues if q]
        return min(heads) if heads else None

    def _ready_size(self) -> int | None:
        """How many to send now without waiting (Triton's preferred-size rule), or None: wait."""
        cfg, n = self.config, self.num_queued
        if n >= cfg.max_batch_size:
            return cfg.max_batch_size
        fits = [p for p in cfg.preferred_batch_size if p <= n]
        if fits:
            return max(fits)
        if cfg.preferred_batch_tokens is not None and not cfg.preferred_batch_size:
            tokens = 0
            for item in (i for q in self.queues for i in q):
                tokens += item.num_tokens
                if tokens >= cfg.preferred_batch_tokens:
                    return n  # enough work to leave the weight-bound regime: send all that waits
        return None

    def _take(self, size: int) -> list[_Item]:
        batch: list[_Item] = []
        for q in self.queues:  # level 0 (highest priority) first, FIFO within a level
            while q and len(batch) < size:
                item = q.popleft()
                self.num_queued -= 1
                if item.timer is not None:
                    item.timer.cancel()
                if not item.future.done():  # a cancelled (client gone) item is dropped
                    batch.append(item)
        return batch

    async def _loop(self) -> None:
        assert self._wake is not None and self._free is not None
        delay = self.config.max_queue_delay_microseconds / 1e6
        while True:
            await self._free.acquire()  # form a batch only when an instance can run it
            try:
                batch = await self._next_batch(delay)
            except BaseException:
                self._free.release()
                raise
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        assert self._free is not None
        self._free.release()

    async def _next_batch(self, delay: float) -> list[_Item]:
        """Wait for items, then for Triton's rule to send them (a preferred size, or the delay)."""
        assert self._wake is not None
        while True:
            while self.num_queued == 0:
                self._wake.clear()
                await self._wake.wait()
            size = self._ready_size()
            if size is None:
                oldest = self._oldest_arrival()
                wait = (oldest or 0.0) + delay - time.monotonic()
                if wait > 0:
                    # one timer, not asyncio.wait_for: that wraps the wait in a new task, and
                    # this runs on every arrival while a batch waits for its delay
                    self._wake.clear()
                    timer = asyncio.get_running_loop().call_later(wait, self._wake.set)
                    try:
                        await self._wake.wait()
                    finally:
                        timer.cancel()
                    continue  # re-check: more arrived, or the delay ran out
                size = min(self.num_queued, self.config.max_batch_size)
            batch = self._take(size)
            if batch:
                return batch

    async def _run(self, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        try:
            results = await loop.run_in_executor(self.executor, self.run_batch, [i.value for i in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} inputs")
        except asyncio.CancelledError:  # stop(): the forward finishes on its thread; its requests fail now
            for item in batch:
                self._fail(item, RuntimeError("the server is shutting down"))
            raise
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the batcher carries on
            for item in batch:
                self._fail(item, exc)
            return
        finally:
            if self.on_batch is not None:
                self.on_batch(BatchRecord(len(batch), sum(i.num_tokens for i in batch), start, time.monotonic(),
                                          min(i.arrival for i in batch), tuple(i.level for i in batch)))
        for item, result in zip(batch, results):
            if not item.future.done():
                item.future.set_result(result)
