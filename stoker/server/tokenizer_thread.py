"""A pooling model's tokenizer thread, coalescing concurrent requests' texts into one call.

An embeddings server at high request rates tokenizes one short text per request. Handing
each to a thread pool costs more than the tokenization itself (a concurrent Future and its
Condition, an executor submit, and a self-pipe write to wake the event loop, per request:
about 130 us of the thread's CPU and 75 us of the event loop's for a 9-token query, against
35 us for the tokenizer call; docs/benchmarks.md, "Embeddings on CPU"). Here the event loop
only puts (texts, future) on a queue; the thread takes everything that waits, tokenizes
consecutive text requests with the same options in one call (the Rust tokenizer encodes a
list in one go), and hands all the results back with one wake-up. vLLM's API server
coalesces tokenizer calls for the same reason (its AsyncMicrobatchTokenizer).

One thread owns the tokenizer: Hugging Face fast tokenizers keep truncation and padding
state on the object, so they must not be called from two threads at once. Other tokenizer
work (`call`: text pairs for rerankers) runs on the same thread, one call at a time.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# At most this many texts in one tokenizer call: bounds how long the first request of a
# burst waits for the others' texts.
MAX_TEXTS_PER_CALL = 256


@dataclass(eq=False)
class _Encode:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    texts: list[str]
    key: tuple[bool, int | None]  # (add_special_tokens, max_length or None: no truncation)


@dataclass(eq=False)
class _Call:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    fn: Callable[..., Any]
    args: tuple[Any, ...]


_STOP = object()


def _encode(tokenizer: Any, texts: list[str], key: tuple[bool, int | None]) -> list[list[int]]:
    add_special, max_length = key
    kw: dict[str, Any] = {"truncation": True, "max_length": max_length} if max_length else {}
    return tokenizer(texts, add_special_tokens=add_special, **kw)["input_ids"]


class TokenizerThread:
    def __init__(self, tokenizer: Any, name: str = "stoker-tokenize") -> None:
        self.tokenizer = tokenizer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ on the event loop
    async def encode(self, texts: list[str], add_special_tokens: bool = True,
                     max_length: int | None = None) -> list[list[int]]:
        """Token ids of each text; `max_length` truncates (None: no truncation)."""
        return await self._submit(lambda loop, fut: _Encode(loop, fut, list(texts), (add_special_tokens, max_length)))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(tokenizer, *args) on the tokenizer thread, alone."""
        return await self._submit(lambda loop, fut: _Call(loop, fut, fn, args))

    async def _submit(self, make: Callable[[asyncio.AbstractEventLoop, asyncio.Future], Any]) -> Any:
        if self._stopped:
            raise RuntimeError("the server is shutting down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(make(loop, future))
        return await future

    def stop(self) -> None:
        """Ends the thread after the work already queued; later calls raise."""
        self._stopped = True
        self._queue.put(_STOP)

    # ------------------------------------------------------------------ on the thread
    def _serve(self) -> None:
        try:
            self._serve_until_stop()
        finally:
            self._fail_rest()

    def _serve_until_stop(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            work, stop = [first], False
            num_texts = len(first.texts) if isinstance(first, _Encode) else 0
            while num_texts < MAX_TEXTS_PER_CALL:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                work.append(item)
                num_texts += len(item.texts) if isinstance(item, _Encode) else 0
            self._deliver(self._run(work))
            if stop:
                return

    def _fail_rest(self) -> None:
        """After _STOP: what was queued behind it (a request racing the shutdown) fails."""
        rest = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                rest.append((item, False, RuntimeError("the server is shutting down")))
        self._deliver(rest)

    def _run(self, work: list[Any]) -> list[tuple[Any, bool, Any]]:
        """(item, ok, result or exception) for each item, in order: runs of _Encode items with
        the same options go to the tokenizer as one list."""
        done: list[tuple[Any, bool, Any]] = []
        i = 0
        while i < len(work):
            item = work[i]
            if isinstance(item, _Call):
                done.append(self._one(item, lambda it=item: it.fn(self.tokenizer, *it.args)))
                i += 1
                continue
            j = i + 1
            while j < len(work) and isinstance(work[j], _Encode) and work[j].key == item.key:
                j += 1
            group = work[i:j]
            try:
                ids = _encode(self.tokenizer, [t for g in group for t in g.texts], item.key)
            except Exception:  # noqa: BLE001 - one bad request must not fail the others: each alone
                done.extend(self._one(g, lambda g=g: _encode(self.tokenizer, g.texts, g.key)) for g in group)
            else:
                start = 0
                for g in group:
                    done.append((g, True, ids[start:start + len(g.texts)]))
                    start += len(g.texts)
            i = j
        return done

    @staticmethod
    def _one(item: Any, fn: Callable[[], Any]) -> tuple[Any, bool, Any]:
        try:
            return item, True, fn()
        except Exception as exc:  # noqa: BLE001 - the request's own error, raised on the event loop
            return item, False, exc

    @staticmethod
    def _deliver(done: list[tuple[Any, bool, Any]]) -> None:
        """One wake-up per event loop for the whole group (a server has one loop; tests may have more)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, bool, Any]]] = {}
        for entry in done:
            by_loop.setdefault(entry[0].loop, []).append(entry)
        for loop, entries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, entries)
            except RuntimeError:  # that loop has closed: nobody waits for these
                pass


def _resolve(entries: list[tuple[Any, bool, Any]]) -> None:
    for item, ok, value in entries:
        if item.future.done():  # the request was cancelled (client gone)
            continue
        if ok:
            item.future.set_result(value)
        else:
            item.future.set_exception(value)
