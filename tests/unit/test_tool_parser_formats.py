"""The vLLM-named tool-call formats (issue 32, part 4): mistral, pythonic, qwen3_coder,
deepseek_v3, glm45, kimi_k2. For each, planted outputs (one call, several, text around, malformed
blocks, unicode, nested JSON) give the calls and content expected, and streaming the same text,
split at every point and in random chunks, gives exactly what the whole text gives."""

from __future__ import annotations

import json
import random

import pytest

from stoker.server.generate.tools.parsers import PARSERS, Extracted, ToolCall, ToolParser, get_parser


def call(name: str, _id: str | None = None, **args: object) -> ToolCall:
    return ToolCall(name, json.dumps(args, ensure_ascii=False), id=_id)


NESTED = {"a": [1, {"b": None, "c": [True, 2.5]}], "d": {"e": "}{]["}}
NESTED_JSON = json.dumps(NESTED)
PARIS = json.dumps({"city": "Paris"})
TWO_LINES = "line one\nline two\n"

# ------------------------------------------------------------------------------- mistral
MISTRAL = [
    # (text, content, calls)
    ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Sure.",
     [call("get_weather", city="Paris")]),
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}, "id": "abc123XYZ"}]', None,
     [call("f", a=1), call("g", "abc123XYZ")]),
    (f'[TOOL_CALLS]get_weather[ARGS]{{"city": "Zürich", "n": {NESTED_JSON}}}[TOOL_CALLS]get_time[ARGS]{{}}', None,
     [call("get_weather", city="Zürich", n=NESTED), call("get_time")]),
    ('Checking.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "東京"}', "Checking.",
     [call("get_weather", "a1b2c3d4e", city="東京")]),
    ('[TOOL_CALLS]f{"x": "}{"}', None, [call("f", x="}{")]),  # no [ARGS]: the name runs to the `{`
    ('[TOOL_CALLS]f[ARGS]{"a": 1} and more', " and more", [call("f", a=1)]),
    ('[TOOL_CALLS]f[ARGS]{oops}[TOOL_CALLS]g[ARGS]{"b": true}', "[TOOL_CALLS]f[ARGS]{oops}", [call("g", b=True)]),
    ('Hi [TOOL_CALLS]f[ARGS]{"a": ', 'Hi [TOOL_CALLS]f[ARGS]{"a": ', []),  # cut: no call, the text as is
    ("[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    ('[TOOL_CALLS]f[ARGS]["a"]', '[TOOL_CALLS]f[ARGS]["a"]', []),  # arguments must be an object
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    # a JSON never runs across the next [TOOL_CALLS] (a control token, never inside a string):
    # were it allowed to, a stream cut there would decide otherwise than the whole text
    ('[TOOL_CALLS]f[ARGS]{"s": "[TOOL_CALLS]"}', '[TOOL_CALLS]f[ARGS]{"s": "[TOOL_CALLS]"}', []),
    ("No tools needed.\n", "No tools needed.\n", []),
    ("ends with [TOOL_CA", "ends with [TOOL_CA", []),
]

# ------------------------------------------------------------------------------- pythonic
PYTHONIC = [
    ('[get_weather(city="Paris", days=3), get_time(zone="UTC")]', None,
     [call("get_weather", city="Paris", days=3), call("get_time", zone="UTC")]),
    ("<|python_start|>[f(s='naïve \"q\" ]', n=-1.5, ok=True, no=None, xs=[1, (2, 3)], "
     "d={'k': {'z': [False]}})]<|python_end|>", None,
     [call("f", s='naïve "q" ]', n=-1.5, ok=True, no=None, xs=[1, [2, 3]], d={"k": {"z": [False]}})]),
    ("  [f()]\n\nThat is all.", "That is all.", [call("f")]),
    ("[f(a=1)]<|python_end|>\n", None, [call("f", a=1)]),
    ("<|python_start|> [f()] <|python_end|>\n\nThe end <|python_end|>", "The end <|python_end|>", [call("f")]),
    ("[f()] <|python_en", "<|python_en", [call("f")]),
    ('[f(s="""multi\nline ]""", t=\'x\\\'y\')]', None, [call("f", s="multi\nline ]", t="x'y")]),
    ("[f(a='東京')]", None, [call("f", a="東京")]),
    ("Let me check: [f(a=1)]", "Let me check: [f(a=1)]", []),  # text first: plain content
    ("[1, 2]", "[1, 2]", []),
    ("[]", "[]", []),
    ("[f(1)]", "[f(1)]", []),  # positional
    ("[f(a=g())]", "[f(a=g())]", []),  # computed: never evaluated
    ("[os.system(cmd='ls')]", "[os.system(cmd='ls')]", []),
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(a=1e400)]", "[f(a=1e400)]", []),  # infinity is no JSON
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set is no JSON
    ("[f(a=1), ", "[f(a=1), ", []),  # unclosed
    ("[f(a=1]", "[f(a=1]", []),
    ("<|python_start|>", "<|python_start|>", []),
    ("<|python", "<|python", []),
    ("   ", "   ", []),
    ("", "", []),
]

# ------------------------------------------------------------------------------- qwen3_coder
WEATHER_PROPS = {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                 "ratio": {"type": "number"}, "opts": {"type": "object"}, "hours": {"type": "array"},
                 "note": {"type": ["string", "null"]}, "code": {"type": "string"},
                 "maybe": {"anyOf": [{"type": "null"}, {"type": "integer"}]}}
TOOLS = {"get_weather": {"type": "object", "properties": WEATHER_PROPS}, "get_time": None}


def qwen_fn(name: str, **params: str) -> str:
    return f"<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) + "</function>"


QWEN = [
    (f"I'll check.\n<tool_call>\n{qwen_fn('get_weather', city='Paris', days='3')}\n</tool_call>", "I'll check.",
     [call("get_weather", city="Paris", days=3)]),
    (f"<tool_call>\n{qwen_fn('get_weather', metric='True', ratio='0.5', opts=NESTED_JSON, hours='[9, 12]', note='null', code='007', maybe='None', x='7')}\n</tool_call>\n"
     f"<tool_call>\n{qwen_fn('get_time')}\n</tool_call>", None,
     [call("get_weather", metric=True, ratio=0.5, opts=NESTED, hours=[9, 12], note=None, code="007", maybe=None, x="7"),
      call("get_time")]),
    (f"<tool_call>\n{qwen_fn('get_weather', city='Zürich 東京', days='three')}\n{qwen_fn('get_time')}\n</tool_call> Done.",
     " Done.", [call("get_weather", city="Zürich 東京", days="three"), call("get_time")]),  # two in one block
    (f"<tool_call>\n{qwen_fn('get_weather', city=TWO_LINES)}\n</tool_call>", None,
     [call("get_weather", city="line one\nline two\n")]),  # one newline trimmed on each side, no more
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call> tail",
     "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call> tail", []),  # no </parameter>
    (f"<tool_call>\n<function=f>oops</function>\n</tool_call>\n<tool_call>\n{qwen_fn('get_time')}\n</tool_call>",
     "<tool_call>\n<function=f>oops</function>\n</tool_call>", [call("get_time")]),
    ("<tool_call>\n<function=get_time>\n</function>", None, [call("get_time")]),  # unclosed block, complete at the end
    ("<tool_call>\n<function=get_time>\n", "<tool_call>\n<function=get_time>\n", []),
    ("<tool_call>{\"name\": \"f\"}</tool_call>", "<tool_call>{\"name\": \"f\"}</tool_call>", []),
    ("Plain text <tool", "Plain text <tool", []),
]

# ------------------------------------------------------------------------------- deepseek_v3
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_v3(name: str, args: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}"


def ds_v31(name: str, args: str) -> str:
    return f"{CB}{name}{SEP}{args}{CE}"


DEEPSEEK = [
    (f'Let me look.{B}{ds_v3("get_weather", json.dumps({"city": "Paris"}))}{E}', "Let me look.",
     [call("get_weather", city="Paris")]),
    (f'{B}{ds_v3("get_weather", json.dumps({"city": "東京", "n": NESTED}, ensure_ascii=False))}\n{ds_v3("get_time", "{}")}{E}',
     None, [call("get_weather", city="東京", n=NESTED), call("get_time")]),
    (f'{B}{ds_v31("get_weather", PARIS)}{ds_v31("get_time", "{}")}{E}', None,
     [call("get_weather", city="Paris"), call("get_time")]),
    (f'{B}{ds_v31("get_time", "{}")}{E} Done.', " Done.", [call("get_time")]),
    (f'{B}{ds_v31("get_time", "{}")}', None, [call("get_time")]),  # the section left open at the end
    (f'{B}{ds_v31("get_time", "{oops}")}{E}', f'{B}{ds_v31("get_time", "{oops}")}{E}', []),
    (f'{B}{ds_v31("get_time", "{}")}junk{E} after', f'{B}{ds_v31("get_time", "{}")}junk{E} after', []),
    (f'{B}{CB}other{SEP}get_time\n```json\n{{}}\n```{CE}{E}', f'{B}{CB}other{SEP}get_time\n```json\n{{}}\n```{CE}{E}', []),
    (f'{B}{ds_v31("f", "{}")}{E}{B}oops{E}', f"{B}oops{E}", [call("f")]),
    (f"{B}", f"{B}", []),
    ("Just text.", "Just text.", []),
]

# ------------------------------------------------------------------------------- glm45
GLM_TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                                "code": {"type": "string"}}}}


def glm(name: str, **args: str) -> str:
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items()) + "</tool_call>"


GLM = [
    (f"Let me check.\n{glm('get_weather', city='Paris', days='3')}", "Let me check.", [call("get_weather", city="Paris", days=3)]),
    (f"{glm('get_weather', city='Zürich', code='007', opts=NESTED_JSON, flag='true', words='two words')}\n{glm('get_time')}",
     None, [call("get_weather", city="Zürich", code="007", opts=NESTED, flag=True, words="two words"), call("get_time")]),
    ("<tool_call>get_time</tool_call> ok", " ok", [call("get_time")]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", []),
    (f"<tool_call>\n</tool_call>{glm('get_time')}", "<tool_call>\n</tool_call>", [call("get_time")]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", []),
]

# ------------------------------------------------------------------------------- kimi_k2
SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def kimi(call_id: str, args: str) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


KIMI = [
    (f'Checking.{SB}{kimi("functions.get_weather:0", PARIS)}{SE}', "Checking.",
     [call("get_weather", "functions.get_weather:0", city="Paris")]),
    (f'{SB}\n{kimi("functions.get_weather:0", json.dumps({"city": "東京", "n": NESTED}, ensure_ascii=False))}\n'
     f'{kimi("functions.get_time:1", "{}")}\n{SE}', None,
     [call("get_weather", "functions.get_weather:0", city="東京", n=NESTED), call("get_time", "functions.get_time:1")]),
    (f'{SB}{kimi("get_time:3", "{}")}{SE} Done.', " Done.", [call("get_time", "get_time:3")]),
    (f'{SB}{kimi("functions.get_time", "{}")}{SE}', f'{SB}{kimi("functions.get_time", "{}")}{SE}', []),  # no index
    (f'{SB}{kimi("functions.f:0", "{oops")}{SE}', f'{SB}{kimi("functions.f:0", "{oops")}{SE}', []),
    (f'{SB}{kimi("functions.f:0", "{}")}', None, [call("f", "functions.f:0")]),  # the section left open at the end
    (f"{SB}", f"{SB}", []),
    ("Plain.", "Plain.", []),
]

ALL = ([(PARSERS["mistral"], *c) for c in MISTRAL] + [(PARSERS["pythonic"], *c) for c in PYTHONIC]
       + [(get_parser("qwen3_coder", TOOLS), *c) for c in QWEN] + [(PARSERS["deepseek_v3"], *c) for c in DEEPSEEK]
       + [(get_parser("glm45", GLM_TOOLS), *c) for c in GLM] + [(PARSERS["kimi_k2"], *c) for c in KIMI])


def _id(case: tuple) -> str:
    return f"{case[0].name}:{case[1][:40]!r}"


@pytest.mark.parametrize("parser, text, content, calls", ALL, ids=[_id(c) for c in ALL])
def test_whole_text(parser: ToolParser, text: str, content: str | None, calls: list[ToolCall]) -> None:
    assert parser.extract(text) == Extracted(content, calls)


def _streamed(parser: ToolParser, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    stream = parser.stream()
    content, calls = [], []
    for k, chunk in enumerate(chunks):
        got = stream.feed(chunk, final=k == len(chunks) - 1)
        content.append(got.content or "")
        calls += got.calls
    return "".join(content), calls


def _chunkings(text: str, seed: int) -> list[list[str]]:
    """Every split in two, one character at a time, and random chunkings (some ending in "")."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text) or [""])
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out.append(pieces + [""] if rng.random() < 0.3 else pieces)
    return out


@pytest.mark.parametrize("parser, text, content, calls", ALL, ids=[_id(c) for c in ALL])
def test_streaming_in_any_chunks_gives_the_whole_text_result(parser: ToolParser, text: str, content: str | None,
                                                             calls: list[ToolCall]) -> None:
    whole = parser.extract(text)
    for chunks in _chunkings(text, seed=len(text)):
        got_content, got_calls = _streamed(parser, chunks)
        assert got_calls == whole.calls, chunks
        assert got_content == (whole.content or ""), chunks


def test_calls_go_out_only_once_complete() -> None:
    stream = PARSERS["mistral"].stream()
    assert stream.feed("Sure.[TOOL_CALLS]f[ARGS]{\"a\": ").calls == []
    got = stream.feed('1}[TOOL_CALLS]g[ARGS]{"b"')
    assert got.calls == [call("f", a=1)] and got.content == ""
    assert stream.feed(": 2}", final=True).calls == [call("g", b=2)]
    pythonic = PARSERS["pythonic"].stream()
    assert pythonic.feed('[f(a=1), g(b="])"').calls == []
    assert pythonic.feed(")]").calls == [call("f", a=1), call("g", b="])")]


def test_plain_text_streams_as_it_comes() -> None:
    for name, marker in (("qwen3_coder", "<tool_call>"), ("kimi_k2", SB), ("deepseek_v3", B), ("mistral", "[TOOL_CALLS]")):
        stream = PARSERS[name].stream()
        assert stream.feed("Hello there" + marker[:3]).content == "Hello there", name  # a possible marker is held
        assert stream.feed("x").content == marker[:3] + "x", name
    pythonic = PARSERS["pythonic"].stream()
    assert pythonic.feed(" ").content == ""  # undecided
    assert pythonic.feed("Hi").content == " Hi"


def test_schema_typing_needs_the_request_tools() -> None:
    text = f"<tool_call>\n{qwen_fn('get_weather', days='3', metric='false')}\n</tool_call>"
    assert PARSERS["qwen3_coder"].extract(text).calls == [call("get_weather", days="3", metric="false")]
    assert get_parser("qwen3_coder", TOOLS).extract(text).calls == [call("get_weather", days=3, metric=False)]
    glm_text = glm("get_weather", city="123", days="4")
    assert PARSERS["glm45"].extract(glm_text).calls == [call("get_weather", city=123, days=4)]
    assert get_parser("glm45", GLM_TOOLS).extract(glm_text).calls == [call("get_weather", city="123", days=4)]


def test_mistral_makes_nine_character_ids_its_templates_accept() -> None:
    ids = {PARSERS["mistral"].new_call_id() for _ in range(20)}
    assert len(ids) > 1 and all(i is not None and len(i) == 9 and i.isalnum() for i in ids)
    assert PARSERS["hermes"].new_call_id() is None  # the server's chatcmpl-tool-... ids


@pytest.mark.parametrize("depth", [50, 995, 5000])
def test_deeply_nested_arguments_never_fail_the_request(depth: int) -> None:
    """JSON deeper than Python's stack makes the decoder raise RecursionError: such a call is
    content (or, where values are text, the text), never an error."""
    deep = "[" * depth + "]" * depth
    texts = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>',
        "llama3_json": f'{{"name": "f", "parameters": {{"a": {deep}}}}}',
        "mistral": f'[TOOL_CALLS]f[ARGS]{{"a": {deep}}}',
        "pythonic": f"[f(a={deep})]",
        "deepseek_v3": f'{B}{ds_v31("f", "{" + chr(34) + "a" + chr(34) + ": " + deep + "}")}{E}',
        "kimi_k2": f'{SB}{kimi("functions.f:0", "{" + chr(34) + "a" + chr(34) + ": " + deep + "}")}{SE}',
        "glm45": f"<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>{deep}</arg_value>\n</tool_call>",
        "qwen3_coder": f"<tool_call>\n<function=f>\n<parameter=a>\n{deep}\n</parameter>\n</function>\n</tool_call>",
        "openai": f'<|channel|>commentary to=functions.f <|constrain|>json<|message|>{{"a": {deep}}}<|call|>',
    }
    assert set(texts) == set(PARSERS)
    for name, text in texts.items():
        parser = get_parser(name, {"f": {"type": "object", "properties": {"a": {"type": "array"}}}})
        whole = parser.extract(text)
        assert len(whole.calls) <= 1 and (whole.calls or whole.content == text), name
        assert _streamed(parser, [text[:len(text) // 2], text[len(text) // 2:]]) == (whole.content or "", whole.calls)
