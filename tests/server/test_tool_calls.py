"""Tool calling through the official client (issue 15, item 2).

A random-weight model never calls a tool by itself, so: named and required calls are checked
against their schemas (only enforcement can make them valid); auto is checked with a Hermes-style
template that renders tools, with the model's text forced into a `<tool_call>` by a regex (the
parser then has something to find) and left free (plain content comes back). The parsers
themselves are unit-tested in tests/unit/test_tool_parsers.py.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.server.conftest import MODEL, LiveServer, start_server

# A small Hermes/Qwen-style template: tools in a system turn, past calls as <tool_call> blocks
# (arguments written with tojson, so they must reach it as an object), tool results by call id.
HERMES_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Functions you may call:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|eot_id|>
{%- endif %}
{%- for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message['content'] %}{{ message['content'] | trim }}{% endif %}
{%- if message.tool_calls is defined %}{% for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}{% endif %}
{%- if message.role == 'tool' %} (result of {{ message.tool_call_id }}){% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "metric": {"type": "boolean"}},
           "required": ["city", "days", "metric"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def hermes_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The tiny checkpoint with the Hermes-style template, served with auto tool choice."""
    ckpt = tmp_path_factory.mktemp("hermes") / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    live = start_server(ckpt, {"max_model_len": 1024}, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield live
    live.wait_idle(30)
    engine = live.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "a KV block leaked"
    live.stop()


@pytest.fixture
def hermes(hermes_server: LiveServer) -> OpenAI:
    return OpenAI(base_url=hermes_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(live: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body}, timeout=60)


def _stream(client: OpenAI, **kw: Any) -> tuple[dict[int, dict[str, Any]], str, str | None, list[Any]]:
    """(calls by index {id, name, arguments}, content, finish_reason, the tool-call deltas in order)."""
    calls: dict[int, dict[str, Any]] = {}
    content, finish, deltas = "", None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                deltas.append(tc)
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    assert call["name"] is None, "a call's name comes once"
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    assert call["name"] is not None, "the name comes before the arguments"
                    call["arguments"] += tc.function.arguments
    return calls, content, finish, deltas


# ------------------------------------------------------------------------------- named / required
@pytest.mark.parametrize("seed", range(3))
def test_named_tool_choice_gives_valid_arguments(hermes: OpenAI, seed: int) -> None:
    out = hermes.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                         max_tokens=120, temperature=1.0, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) for a forced function
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_named_tool_call_streams_its_arguments(hermes: OpenAI) -> None:
    kw = dict(tools=TOOLS, tool_choice=NAMED, max_tokens=120, temperature=1.0, seed=7)
    whole = hermes.chat.completions.create(model=MODEL, messages=MESSAGES, **kw).choices[0]
    calls, content, finish, deltas = _stream(hermes, **kw)
    assert list(calls) == [0] and content == "" and finish == "stop"
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2, "arguments stream in pieces, as generated"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert calls[0]["arguments"] == whole.message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("seed", range(3))
def test_required_gives_at_least_one_valid_call(hermes: OpenAI, seed: int) -> None:
    out = hermes.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=250, temperature=1.0, seed=seed)
    choice = out.choices[0]
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert choice.finish_reason in ("tool_calls", "length")  # length: more calls were cut off
    if choice.finish_reason == "tool_calls":
        assert not choice.message.content


def test_required_with_parallel_tool_calls_false_streams_one_call(hermes: OpenAI) -> None:
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=3)
    whole = hermes.chat.completions.create(model=MODEL, messages=MESSAGES, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    calls, content, finish, _ = _stream(hermes, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())


# ------------------------------------------------------------------------------- auto
# The text a Hermes model writes to call a tool; forced here by a regex, since random weights never would.
FORCED_CALL = r'Sure\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7], "metric": (true|false)\}\}</tool_call>'


def test_auto_parses_a_hermes_tool_call(hermes: OpenAI) -> None:
    kw = dict(tools=TOOLS, max_tokens=120, temperature=1.0, seed=1, extra_body={"guided_regex": FORCED_CALL})
    choice = hermes.chat.completions.create(model=MODEL, messages=MESSAGES, **kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, content, finish, _ = _stream(hermes, **kw)
    assert finish == "tool_calls" and content == "Sure."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_auto_without_a_call_returns_the_text_as_content(hermes: OpenAI) -> None:
    kw = dict(tools=TOOLS, max_tokens=30, temperature=1.0, seed=2)
    auto = hermes.chat.completions.create(model=MODEL, messages=MESSAGES, **kw).choices[0]
    plain = hermes.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice="none", **kw).choices[0]
    assert auto.message.tool_calls is None and auto.finish_reason in ("stop", "length")
    assert auto.message.content and auto.message.content == plain.message.content  # same prompt, same seed
    calls, content, finish, _ = _stream(hermes, **kw)
    assert calls == {} and content == auto.message.content and finish == auto.finish_reason


def test_auto_needs_enable_auto_tool_choice(live_server: LiveServer) -> None:
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        resp = _post(live_server, {"max_tokens": 2, **body})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]
    # named, required and none need no parser
    for choice in (NAMED, "required", "none"):
        assert _post(live_server, {"tools": TOOLS, "tool_choice": choice, "max_tokens": 60}).status_code == 200


# ------------------------------------------------------------------------------- the prompt
def _prompt_tokens(live: LiveServer, **body: Any) -> int:
    resp = _post(live, {"max_tokens": 1, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"]


def test_tools_reach_the_chat_template(hermes_server: LiveServer) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hermes_server.state.settings.model_path)
    expected = len(tok.encode(tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False))
    bare = _prompt_tokens(hermes_server)
    assert expected > bare + 50
    assert _prompt_tokens(hermes_server, tools=TOOLS, tool_choice=NAMED) == expected
    # tool_choice "none" still shows the model its tools, as vLLM renders them
    assert _prompt_tokens(hermes_server, tools=TOOLS, tool_choice="none") == expected


def test_tool_calls_and_tool_turns_are_rendered(hermes_server: LiveServer) -> None:
    msgs = [*MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"}]
    resp = httpx.post(hermes_server.url + "/tokenize", json={"model": MODEL, "messages": msgs}, timeout=30)
    assert resp.status_code == 200, resp.text
    req = urllib.request.Request(hermes_server.url + "/detokenize", data=json.dumps(
        {"model": MODEL, "tokens": resp.json()["tokens"]}).encode(), headers={"Content-Type": "application/json"})
    text = json.loads(urllib.request.urlopen(req, timeout=30).read())["prompt"]
    # arguments reached the template as an object (tojson of the JSON text would quote it)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "22 C and sunny (result of call_1)" in text
    out = _post(hermes_server, {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3})
    assert out.status_code == 200, out.text


# ------------------------------------------------------------------------------- refused
BAD_TOOL = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}}}]


@pytest.mark.parametrize("body, param, words", [
    ({"tools": BAD_TOOL, "tool_choice": "required"}, "tools", ["tools[0]", "not"]),
    ({"tools": BAD_TOOL, "tool_choice": {"type": "function", "function": {"name": "pick"}}}, "tools", ["pick", "not"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", ["nope"]),
    ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice", ["response_format"]),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", []),
    ({"functions": [{"name": "f"}], "function_call": "auto"}, "functions", ["tools"]),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", ["arguments", "JSON"]),
])
def test_what_cannot_be_served_is_refused_by_name(live_server: LiveServer, body: dict, param: str, words: list[str]) -> None:
    resp = _post(live_server, {"max_tokens": 5, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert all(w in err["message"] for w in words), err


def test_unenforceable_parameters_are_fine_where_nothing_is_enforced(live_server: LiveServer) -> None:
    assert _post(live_server, {"tools": BAD_TOOL, "tool_choice": "none", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------- other formats
# What a Llama 3.2/4 model (pythonic) and a Qwen3-Coder model (qwen3_coder) write to call tools,
# forced by a regex. The prompt shape does not matter here: the Hermes-style template only shows
# the tools; the parser is what is under test, through the whole server.
FORCED = {
    "pythonic": (r'\[get_weather\(city="(Paris|Rome)", days=[1-7], metric=(True|False)\), get_time\(zone="(UTC|CET)"\)\]',
                 None, ["get_weather", "get_time"]),
    # values are text: days and metric reach the client as an integer and a boolean only if the
    # parser typed them by the request's tool schema
    "qwen3_coder": (r"Sure\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n"
                    r"<parameter=days>\n[1-7]\n</parameter>\n<parameter=metric>\n(true|false)\n</parameter>\n</function>\n"
                    r"</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n</parameter>\n"
                    r"</function>\n</tool_call>", "Sure.", ["get_weather", "get_time"]),
}


@pytest.fixture(scope="module", params=sorted(FORCED))
def format_server(request: pytest.FixtureRequest, tiny_llama: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, OpenAI]]:
    ckpt = tmp_path_factory.mktemp(request.param) / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    live = start_server(ckpt, {"max_model_len": 1024}, enable_auto_tool_choice=True, tool_call_parser=request.param)
    yield request.param, OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    live.wait_idle(30)
    engine = live.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "a KV block leaked"
    live.stop()


def test_auto_parses_other_formats_whole_and_streamed(format_server: tuple[str, OpenAI]) -> None:
    parser, client = format_server
    regex, content, names = FORCED[parser]
    kw = dict(tools=TOOLS, max_tokens=300, temperature=1.0, seed=4, extra_body={"guided_regex": regex})
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == content
    assert [c.function.name for c in choice.message.tool_calls] == names
    for call in choice.message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, streamed, finish, _ = _stream(client, **kw)
    assert finish == "tool_calls" and streamed == (content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # parallel_tool_calls false: the first call only, whole and streamed (as vLLM filters them)
    one = client.chat.completions.create(model=MODEL, messages=MESSAGES, parallel_tool_calls=False, **kw).choices[0]
    assert one.finish_reason == "tool_calls" and one.message.content == content
    assert [(c.function.name, c.function.arguments) for c in one.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls[:1]]
    calls, streamed, finish, _ = _stream(client, parallel_tool_calls=False, **kw)
    assert list(calls) == [0] and finish == "tool_calls" and streamed == (content or "")
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments
