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


def queued_together(thread: TokenizerThread, *submissions, cancel=()) -> list:
    """Run the submissions (coroutine functions of no argument) while the thread is held busy,
    so that all of them wait in its queue at once, then let it go; results (or exceptions) in
    order. The indices in `cancel` are cancelled before the thread is let go."""

    async def main() -> list:
        gate, started = threading.Event(), threading.Event()

        def hold(tok):
            started.set()
            gate.wait(10)
            return "held"

        held = asyncio.ensure_future(thread.call(hold))
        while not started.is_set():
            await asyncio.sleep(0.001)
        tasks = [asyncio.ensure_future(submit()) for submit in submissions]
        await asyncio.sleep(0.01)
        for i in cancel:
            tasks[i].cancel()
        gate.set()
        assert await held == "held"
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


def test_concurrent_requests_share_one_call_and_each_gets_its_own_ids():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok, "tok-test")
    texts = [[f"{'w' * (i % 7 + 1)} x{'y' * i}"] for i in range(40)] + [["a bb", "ccc dddd eeeee"]]
    results = queued_together(thread, *[lambda t=t: thread.encode(t) for t in texts])
    thread.stop()
    for t, ids in zip(texts, results):
        assert ids == alone(t)
    assert len(tok.calls) == 1 and len(tok.calls[0]) == 42  # 41 requests' texts, one tokenizer call
    assert tok.threads == {"tok-test"}


def test_requests_with_different_options_are_not_merged():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok)
    a, b, c, d = queued_together(thread, lambda: thread.encode(["one two three four"], True, None),
                                 lambda: thread.encode(["one two three four"], True, 3),
                                 lambda: thread.encode(["one two three four"], False, None),
                                 lambda: thread.encode(["five six"], True, None))
    thread.stop()
    assert a == [[101, 3, 3, 5, 4, 102]]
    assert b == [[101, 3, 3]]
    assert c == [[3, 3, 5, 4]]
    assert d == [[101, 4, 3, 102]]
    assert len(tok.calls) == 4  # consecutive runs with the same options only


def test_an_error_fails_only_its_own_request():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok)
    ok1, bad, ok2 = queued_together(thread, lambda: thread.encode(["fine text"]), lambda: thread.encode(["a BOOM here"]),
                                    lambda: thread.encode(["also fine"]))
    thread.stop()
    assert ok1 == alone(["fine text"]) and ok2 == alone(["also fine"])
    assert isinstance(bad, ValueError) and "BOOM" in str(bad)


def test_a_cancelled_request_does_not_disturb_the_rest():
    tok = FakeTokenizer()
    thread = TokenizerThread(tok)
    gone, kept = queued_together(thread, lambda: thread.encode(["client left"]), lambda: thread.encode(["client stayed"]),
                                 cancel=[0])
    thread.stop()
    assert isinstance(gone, asyncio.CancelledError)
    assert kept == alone(["client stayed"])


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
