"""The per-step streaming path: a request's output stream (newest output only, errors after
outputs, abort on early exit) and the SSE encoder's short path for text-only chunks."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from stoker.engine.async_engine import RequestStream
from stoker.outputs import CompletionOutput, RequestOutput
from stoker.server.generate.serving import ChunkEncoder


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _out(text: str, finished: bool = False) -> RequestOutput:
    comp = CompletionOutput(0, text, [1] * len(text), 0.0, None, "length" if finished else None)
    return RequestOutput("r", None, [1], [comp], finished)


def test_stream_yields_the_newest_output_and_ends_at_the_finished_one() -> None:
    async def run() -> tuple[list[str], list[str]]:
        engine = _Engine()
        stream = RequestStream(engine, "r")  # type: ignore[arg-type]
        seen: list[str] = []

        async def consume() -> None:
            async for out in stream:
                seen.append(out.outputs[0].text)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # the consumer waits
        stream._put(_out("a"))
        await asyncio.sleep(0)
        stream._put(_out("ab"))  # two outputs before the consumer runs: only the newest is seen
        stream._put(_out("abc"))
        await asyncio.sleep(0)
        stream._put(_out("abcd", finished=True))
        await asyncio.wait_for(task, 5)
        return seen, engine.aborted

    seen, aborted = asyncio.run(run())
    assert seen == ["a", "abc", "abcd"]
    assert aborted == []  # finished: nothing to abort


def test_stream_raises_a_failure_after_the_output_before_it() -> None:
    async def run() -> tuple[list[str], BaseException | None]:
        stream = RequestStream(_Engine(), "r")  # type: ignore[arg-type]
        stream._put(_out("a"))  # before the consumer starts: no wait at all
        stream._fail(RuntimeError("boom"))
        seen: list[str] = []
        try:
            async for out in stream:
                seen.append(out.outputs[0].text)
        except RuntimeError as exc:
            return seen, exc
        return seen, None

    seen, exc = asyncio.run(run())
    assert seen == ["a"] and str(exc) == "boom"


def test_a_cancelled_consumer_aborts_and_a_later_output_is_harmless() -> None:
    async def run() -> list[str]:
        engine = _Engine()
        stream = RequestStream(engine, "r")  # type: ignore[arg-type]

        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        stream._put(_out("late"))  # the engine's output raced the abort: no waiter to wake
        return engine.aborted

    assert asyncio.run(run()) == ["r"]


@pytest.mark.parametrize("seed", [0, 1])
def test_running_text_is_the_bytes_of_the_full_choice(seed: int) -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m\u00e9", "system_fingerprint": "f"}
    enc = ChunkEncoder(head)
    rng = random.Random(seed)
    # quotes, escapes, control characters, non-ASCII, astral, a lone surrogate, U+2028
    alphabet = ["a", " ", '"', "\\", "\n", "\t", "\x00", "\x1f", "\u00e9", "\u4e2d", "\U0001f600", "\ud800", "\u2028", "/"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        index = rng.randint(0, 300)
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        expected = b"data: " + json.dumps({**head, "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"
        assert enc.running_text(index, text) == expected
        assert enc.choice(choice) == expected


@pytest.mark.parametrize("seed", [0, 1])
def test_running_content_is_the_bytes_of_the_full_chat_choice(seed: int) -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m", "system_fingerprint": "f"}
    enc = ChunkEncoder(head)
    rng = random.Random(seed)
    alphabet = ["a", " ", '"', "\\", "\n", "\x01", "\u00e9", "\U0001f600", "\udfff", "\u2029"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        index = rng.randint(0, 9)
        choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        expected = b"data: " + json.dumps({**head, "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"
        assert enc.running_content(index, text) == expected
