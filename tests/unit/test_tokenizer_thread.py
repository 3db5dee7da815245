"""The pooling tokenizer thread: concurrent requests' texts coalesced into one tokenizer call,
each request getting exactly its own ids, errors kept to their own request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from stoker.server.tokenizer_thread import TokenizerThread


class FakeTokenizer:
    """HF's call shape: tok(texts, add_special_tokens=, truncation=, max_length=) -> {"input_ids": ...}.
    A word's id is its length; [CLS]=101 and [SEP]=102 around it when add_special_tokens."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.threads: set[str] = set()

    def __call__(self, texts, add_special_tokens=True, truncation=False, max_length=None):
        self.calls.append(list(texts))
        self.threads.add(threading.current_thread().name)
        out = []
        for t in texts:
            if "BOOM" in t:
                raise ValueError(f"cannot tokenize {t!r}")
            ids = [len(w) for w in t.split()]
            if add_special_tokens:
                ids = [101, *ids, 102]
            if truncation and max_length:
                ids = ids[:max_length]
            out.append(ids)
        return {"input_ids": out}


def alone(texts, add_special=True, max_length=None):
    return FakeTokenizer()(texts, add_special, bool(max_length), max_length)["input_ids"]


async def _blocked(thread: TokenizerThread) -> tuple[threading.Event, asyncio.Task]:
    """Occupy the thread until the event is set, so that what is submitted meanwhile queues."""
    gate, started = threading.Event(), threading.Event()

    def hold(tok):
        started.set()
        gate.wait(10)
        return "held"

    task = asyncio.ensure_future(thread.call(hold))
    while not started.is_set():
        await asyncio.sleep(0.001)
    return gate, task


def test_concurrent_requests_share_one_call_and_each_gets_its_own_ids():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok, "tok-test")

    async def main():
        gate, held = await _blocked(thread)
        texts = [[f"{'w' * (i % 7 + 1)} x{'y' * i}"] for i in range(40)] + [["a bb", "ccc dddd eeeee"]]
        tasks = [asyncio.ensure_future(thread.encode(t)) for t in texts]
        await asyncio.sleep(0.01)
        gate.set()
        assert await held == "held"
        return texts, await asyncio.gather(*tasks)

    texts, results = asyncio.run(main())
    thread.stop()
    for t, ids in zip(texts, results):
        assert ids == alone(t)
    assert len(tok.calls) == 1 and len(tok.calls[0]) == 42  # 41 requests' texts, one tokenizer call
    assert tok.threads == {"tok-test"}


def test_requests_with_different_options_are_not_merged():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok)

    async def main():
        gate, held = await _blocked(thread)
        a = asyncio.ensure_future(thread.encode(["one two three four"], True, None))
        b = asyncio.ensure_future(thread.encode(["one two three four"], True, 3))
        c = asyncio.ensure_future(thread.encode(["one two three four"], False, None))
        d = asyncio.ensure_future(thread.encode(["five six"], True, None))
        await asyncio.sleep(0.01)
        gate.set()
        await held
        return await asyncio.gather(a, b, c, d)

    a, b, c, d = asyncio.run(main())
    thread.stop()
    assert a == [[101, 3, 3, 5, 4, 102]]
    assert b == [[101, 3, 3]]
    assert c == [[3, 3, 5, 4]]
    assert d == [[101, 4, 3, 102]]
    assert len(tok.calls) == 4  # consecutive runs with the same options only


def test_an_error_fails_only_its_own_request():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok)

    async def main():
        gate, held = await _blocked(thread)
        ok1 = asyncio.ensure_future(thread.encode(["fine text"]))
        bad = asyncio.ensure_future(thread.encode(["a BOOM here"]))
        ok2 = asyncio.ensure_future(thread.encode(["also fine"]))
        await asyncio.sleep(0.01)
        gate.set()
        await held
        return await asyncio.gather(ok1, bad, ok2, return_exceptions=True)

    ok1, bad, ok2 = asyncio.run(main())
    thread.stop()
    assert ok1 == alone(["fine text"]) and ok2 == alone(["also fine"])
    assert isinstance(bad, ValueError) and "BOOM" in str(bad)


def test_a_cancelled_request_does_not_disturb_the_rest():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok)

    async def main():
        gate, held = await _blocked(thread)
        gone = asyncio.ensure_future(thread.encode(["client left"]))
        kept = asyncio.ensure_future(thread.encode(["client stayed"]))
        await asyncio.sleep(0.01)
        gone.cancel()
        gate.set()
        await held
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await kept

    assert asyncio.run(main()) == alone(["client stayed"])
    thread.stop()


def test_call_runs_on_the_thread_and_stop_refuses_later_work():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok, "tok-stop")

    async def main():
        name = await thread.call(lambda t, x: (t is tok, threading.current_thread().name, x), 7)
        queued = asyncio.ensure_future(thread.encode(["before stop"]))
        await asyncio.sleep(0)
        thread.stop()
        done = await queued  # queued before stop: still answered
        with pytest.raises(RuntimeError, match="shutting down"):
            await thread.encode(["after stop"])
        return name, done

    name, done = asyncio.run(main())
    assert name == (True, "tok-stop", 7)
    assert done == alone(["before stop"])
    thread._thread.join(5)
    assert not thread._thread.is_alive()
