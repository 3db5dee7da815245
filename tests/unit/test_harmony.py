"""gpt-oss harmony read from text: the `openai` tool parser whole and streamed at every split,
and that openai-harmony cannot serve here (it downloads its vocabulary at run time)."""

from __future__ import annotations

import json

import pytest

from stoker.server.generate.harmony import parse_harmony
from stoker.server.generate.tools.parsers.openai import HarmonyToolParser
from stoker.server.generate.reasoning import PARSERS as REASONING
from stoker.server.generate.tools.parsers import PARSERS, get_parser
from stoker.server.generate.tools.parsers import Extracted, ToolCall

OPENAI = HarmonyToolParser()
ANALYSIS = "<|channel|>analysis<|message|>Need weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Oslo", "days": 2}<|call|>')


def call(name: str, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


CASES = [
    # (text, content, calls)
    (ANALYSIS + CALL, None, [call("get_weather", city="Oslo", days=2)]),
    (ANALYSIS + CALL[:-len("<|call|>")], None, [call("get_weather", city="Oslo", days=2)]),  # <|call|> is a stop token
    # the recipient before the channel, as gpt-oss also writes it
    ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}',
     None, [call("now")]),
    (CALL + CALL, None, [call("get_weather", city="Oslo", days=2)] * 2),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.", "It is sunny.", []),
    ("<|channel|>commentary<|message|>Checking.<|end|>" + CALL, "Checking.", [call("get_weather", city="Oslo", days=2)]),
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": [1<|call|>',
     '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": [1<|call|>', []),  # not JSON: as written
    ("Checking." + CALL, "Checking.", [call("get_weather", city="Oslo", days=2)]),  # a reasoning parser's content
    ("no harmony at all <|x", "no harmony at all <|x", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_text(text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert OPENAI.extract(text) == Extracted(content, calls)


@pytest.mark.parametrize("text,content,calls", CASES)
def test_streamed_at_every_split_equals_whole(text: str, content: str | None, calls: list[ToolCall]) -> None:
    for chunks in [[text], list(text) or [""]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        stream = OPENAI.stream()
        got_content, got_calls = "", []
        for i, chunk in enumerate(chunks):
            found = stream.feed(chunk, final=i == len(chunks) - 1)
            got_content += found.content or ""
            got_calls += found.calls
        assert (got_content, got_calls) == (content or "", calls), chunks


def test_reasoning_then_tool_parser_compose() -> None:
    """gpt_oss leaves a call in its content as written; the openai tool parser finds it there."""
    text = ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>" + CALL
    reasoning, content = REASONING["gpt_oss"].extract(text)
    assert reasoning == "Need weather."
    assert OPENAI.extract(content or "") == Extracted("Let me look.", [call("get_weather", city="Oslo", days=2)])


def test_a_call_streams_once_its_message_ends() -> None:
    stream = OPENAI.stream()
    assert stream.feed(CALL[:-12]) == Extracted("", [])
    assert stream.feed(CALL[-12:]).calls == [call("get_weather", city="Oslo", days=2)]
    assert stream.feed("", final=True) == Extracted("", [])


def test_parse_holds_a_marker_being_written() -> None:
    parsed = parse_harmony("<|channel|>final<|message|>Hi <|en", 0, final=False)
    (piece,) = parsed.pieces
    assert not piece.complete and "<|channel|>final<|message|>Hi <|en"[piece.body_start:piece.body_end] == "Hi "


def test_openai_is_a_tool_call_parser() -> None:
    assert get_parser("openai").name == "openai"
    assert get_parser("hermes").name == "hermes"
    assert {"openai", "hermes", "llama3_json"} <= set(PARSERS)
    with pytest.raises(ValueError, match="openai"):
        get_parser("nope")


def test_openai_harmony_cannot_load_its_encoding_offline() -> None:
    """Why the text is parsed: the package fetches the o200k vocabulary when it loads."""
    harmony = pytest.importorskip("openai_harmony")
    try:
        harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # noqa: BLE001 - HarmonyError, whatever the package version names it
        assert "vocab" in str(exc) or "download" in str(exc)
    else:
        pytest.skip("openai-harmony loaded its encoding (a cached vocabulary): the text parser is still used")


def test_random_texts_stream_as_whole() -> None:
    import random

    atoms = ["<|channel|>", "analysis", "final", "commentary", " to=functions.f", " to=browser.x", " <|constrain|>json",
             "<|message|>", "<|end|>", "<|start|>", "assistant", "<|call|>", "<|return|>", "<|", "|>", "{}",
             '{"a": 1}', "[1]", "hi ", "\n"]
    rng = random.Random(7)
    for _ in range(1500):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        whole = OPENAI.extract(text)
        stream, content, calls = OPENAI.stream(), "", []
        for i, chunk in enumerate(chunks):
            found = stream.feed(chunk, final=i == len(chunks) - 1)
            content, calls = content + (found.content or ""), calls + found.calls
        assert (content, calls) == (whole.content or "", whole.calls), (text, chunks)
