"""Tool-call parsers (issue 15, item 2): what each finds in a whole text, and that streaming the
same text in any chunks gives the same calls and content (never garbled arguments)."""

from __future__ import annotations

import json
import random

import pytest

from stoker.server.generate.tools.parsers import PARSERS, REQUIRED, Extracted, ToolCall, ToolParser, get_parser

HERMES = PARSERS["hermes"]
LLAMA = PARSERS["llama3_json"]


def call(name: str, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
HERMES_CASES = [
    # (text, content, calls)
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.", [call("get_weather", city="Paris", unit="c")]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" '{"name": "now", "arguments": {}}\n</tool_call>\n', None,
     [call("get_weather", city="Paris", unit="c"), call("now")]),
    ('<tool_call>{"name": "q", "arguments": {"text": "naïve {x} \\"quoted\\""}}</tool_call> Done.  ', " Done.",
     [call("q", text='naïve {x} "quoted"')]),
    ("<tool_call>{not json}</tool_call> fine", "<tool_call>{not json}</tool_call> fine", []),  # no call: text as is
    (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>oops</tool_call>", "\n<tool_call>oops</tool_call>",
     [call("get_weather", city="Paris", unit="c")]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [call("f", a=1)]),  # unclosed at the end
    ('<tool_call>{"name": "f", "arguments": {"a": 1', '<tool_call>{"name": "f", "arguments": {"a": 1', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "f", "parameters": {"b": true}}</tool_call>', None, [call("f", b=True)]),
    ("Just text, ending in <tool", "Just text, ending in <tool", []),
    ("  spaced reply \n\n", "  spaced reply \n\n", []),
    ("", "", []),
]

LLAMA_CASES = [
    ('{"name": "f", "parameters": {"a": 1}}', None, [call("f", a=1)]),
    ('<|python_tag|>{"name": "f", "arguments": {"a": [1, 2]}}; {"name": "g", "parameters": {}}', None,
     [call("f", a=[1, 2]), call("g")]),
    ('\n {"name": "f", "parameters": {"s": "}{;"}} ;\n{"name": "g", "parameters": {"x": null}}', None,
     [call("f", s="}{;"), call("g", x=None)]),
    ('{"name": "f", "parameters": {"a": 1}} and that is all', "and that is all", [call("f", a=1)]),
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": ', '{"name": "g", "parameters": ', [call("f", a=1)]),
    ('{"name": "f", "parameters": {"a": 1}}; {"oops": 1}', '{"oops": 1}', [call("f", a=1)]),
    ('Hello {"name": "f", "parameters": {}}', 'Hello {"name": "f", "parameters": {}}', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "f", "parameters": {"a": 1}, "arguments": {}}', '{"name": "f", "parameters": {"a": 1}, "arguments": {}}', []),
    ('{"name": "f", "parameters"', '{"name": "f", "parameters"', []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ("<|python", "<|python", []),
    ("   ", "   ", []),
]

REQUIRED_CASES = [
    ('[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]', None, [call("f", a=1), call("g")]),
    ('[{"name":"f","parameters":{"a":"x]"}}]', None, [call("f", a="x]")]),
    ('[{"name":"f","parameters":{"a":1}},{"name":"g","param', '{"name":"g","param', [call("f", a=1)]),  # cut by max_tokens
    ("[", None, []),
]

ALL = ([(HERMES, *c) for c in HERMES_CASES] + [(LLAMA, *c) for c in LLAMA_CASES]
       + [(REQUIRED, *c) for c in REQUIRED_CASES])


def _id(case: tuple) -> str:
    return f"{case[0].name}:{case[1][:30]!r}"


@pytest.mark.parametrize("parser, text, content, calls", ALL, ids=[_id(c) for c in ALL])
def test_whole_text(parser: ToolParser, text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parser.extract(text) == Extracted(content, calls)


def _streamed(parser: ToolParser, chunks: list[str]) -> tuple[str | None, list[ToolCall]]:
    stream = parser.stream()
    content, calls = [], []
    for k, chunk in enumerate(chunks):
        got = stream.feed(chunk, final=k == len(chunks) - 1)
        content.append(got.content or "")
        calls += got.calls
    return "".join(content), calls


@pytest.mark.parametrize("parser, text, content, calls", ALL, ids=[_id(c) for c in ALL])
def test_streaming_in_any_chunks_gives_the_whole_text_result(parser: ToolParser, text: str, content: str | None,
                                                             calls: list[ToolCall]) -> None:
    whole = parser.extract(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text) or [""])  # one character at a time
    splits += [[*(text[i:i + 3] for i in range(0, len(text), 3)), ""]]  # ends with an empty final delta
    rng = random.Random(len(text))
    for _ in range(20):  # random chunkings
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for chunks in splits:
        got_content, got_calls = _streamed(parser, chunks)
        assert got_calls == whole.calls, chunks
        # streamed content, put together, is the whole text's (None there: nothing streamed)
        assert got_content == (whole.content or ""), chunks


def test_a_call_goes_out_only_once_its_json_is_complete() -> None:
    stream = HERMES.stream()
    assert stream.feed("Checking.\n<tool_call>\n").calls == []
    half = stream.feed('{"name": "f", "arguments": {"a": ')
    assert half.calls == [] and half.content == ""
    assert stream.feed('1}}\n</tool').calls == []
    done = stream.feed("_call>")
    assert done.calls == [call("f", a=1)]
    llama = LLAMA.stream()
    assert llama.feed('{"name": "f", "parameters": {"a": 1}').calls == []
    assert llama.feed("}").calls == [call("f", a=1)]


def test_plain_text_streams_as_it_comes_and_holds_back_only_a_possible_marker() -> None:
    stream = HERMES.stream()
    assert stream.feed("Hello <tool").content == "Hello"  # " <tool" could open a call
    assert stream.feed("box> there").content == " <toolbox> there"
    llama = LLAMA.stream()
    assert llama.feed("  ").content == ""  # undecided: whitespace only
    assert llama.feed("Hi").content == "  Hi"
    assert llama.feed(" {").content == " {"


def test_an_unknown_parser_lists_the_known_names() -> None:
    with pytest.raises(ValueError, match="nope") as err:
        get_parser("nope")
    for name in ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "glm45", "kimi_k2"):
        assert repr(name) in str(err.value)
