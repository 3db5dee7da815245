"""POST /v1/messages (Anthropic's Messages API) through the official `anthropic` SDK: stateless
over the chat path, Anthropic's stream events in order, tool_use blocks valid against their
schemas where the choice is enforced, errors in Anthropic's shape, and refusals of what the
server cannot honour."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel

from stoker.server.generate.messages_answer import message_events
from tests.server.conftest import MODEL, LiveServer, start_server
from tests.server.test_tool_calls import HERMES_TEMPLATE

WEATHER_SCHEMA = {"type": "object",
                  "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                 "metric": {"type": "boolean"}},
                  "required": ["city", "days", "metric"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER_SCHEMA},
         {"name": "get_time", "description": "Current time", "input_schema": TIME_SCHEMA}]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
HELLO = [{"role": "user", "content": "Hello there"}]
# This SDK's signature no longer lists temperature / top_p / top_k; the wire format still carries them.
T0 = {"extra_body": {"temperature": 0}}
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
              "message_stop"}


@pytest.fixture
def claude(live_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0, timeout=60)


def _prompt_tokens(live: LiveServer, messages: list[dict[str, Any]]) -> int:
    """The chat path's count for the same conversation (POST /tokenize)."""
    resp = httpx.post(live.url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


def _texts(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ------------------------------------------------------------------------------- plain text
def test_round_trip_matches_the_chat_path(claude: anthropic.Anthropic, client: OpenAI, live_server: LiveServer) -> None:
    msg = claude.messages.create(model=MODEL, max_tokens=8, **T0, messages=HELLO)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=HELLO)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == MODEL
    assert _texts(msg) == chat.choices[0].message.content
    assert all(b.type == "text" for b in msg.content)
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert msg.stop_reason == expected and msg.stop_sequence is None
    assert msg.usage.input_tokens == _prompt_tokens(live_server, HELLO) == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.usage.output_tokens <= 8


def test_max_tokens_stop(claude: anthropic.Anthropic) -> None:
    """One token cannot end a random model's answer by itself (EOS is one token in thousands)."""
    msg = claude.messages.create(model=MODEL, max_tokens=1, **T0, messages=HELLO)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 1


@pytest.mark.parametrize("system", ["Be brief.\nAnswer in French.",
                                    [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in French."}]])
def test_system_as_string_and_as_blocks(claude: anthropic.Anthropic, client: OpenAI, live_server: LiveServer,
                                        system: Any) -> None:
    msg = claude.messages.create(model=MODEL, max_tokens=6, **T0, system=system, messages=HELLO)
    as_chat = [{"role": "system", "content": "Be brief.\nAnswer in French."}, *HELLO]
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=as_chat)
    assert msg.usage.input_tokens == _prompt_tokens(live_server, as_chat) > _prompt_tokens(live_server, HELLO)
    assert _texts(msg) == chat.choices[0].message.content


def test_multi_turn_with_text_blocks(claude: anthropic.Anthropic, client: OpenAI, live_server: LiveServer) -> None:
    turns = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Bonjour"}]},
             {"role": "user", "content": "And goodbye?"}]
    msg = claude.messages.create(model=MODEL, max_tokens=5, **T0, messages=turns)
    as_chat = [{"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": "Bonjour"},
               {"role": "user", "content": "And goodbye?"}]
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, messages=as_chat)
    assert msg.usage.input_tokens == _prompt_tokens(live_server, as_chat)
    assert _texts(msg) == chat.choices[0].message.content


def test_stop_sequences_report_the_one_matched(claude: anthropic.Anthropic) -> None:
    """Greedy, so the text is known in advance: a piece of it, given as a stop sequence, ends the
    output right before its first occurrence and comes back as stop_sequence."""
    free = _texts(claude.messages.create(model=MODEL, max_tokens=24, **T0, messages=HELLO))
    assert len(free) >= 12, free
    seq = free[8:11]
    msg = claude.messages.create(model=MODEL, max_tokens=24, **T0, messages=HELLO,
                                 stop_sequences=["\x07never-generated", seq])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == seq
    assert _texts(msg) == free[:free.index(seq)]
    streamed = _stream(claude, max_tokens=24, **T0, messages=HELLO, stop_sequences=[seq])[1]
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == seq
    assert _texts(streamed) == _texts(msg)


# ------------------------------------------------------------------------------- streaming
def _stream(claude: anthropic.Anthropic, **kw: Any) -> tuple[list[Any], Any]:
    """(the raw events in order, the SDK's final message)."""
    with claude.messages.stream(model=MODEL, **kw) as stream:
        events = [e for e in stream if e.type in RAW_EVENTS]
        return events, stream.get_final_message()


def _check_order(events: list[Any]) -> None:
    """Anthropic's grammar: message_start, (block_start, block_delta*, block_stop)*, message_delta, message_stop."""
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    index, open_ = -1, False
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert not open_ and e.index == index + 1, kinds
            index, open_ = e.index, True
        else:
            assert open_ and e.index == index, kinds
            open_ = e.type != "content_block_stop"
    assert not open_, kinds


def test_stream_events_in_order_and_the_same_message(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=10, **T0, messages=HELLO)
    events, final = _stream(claude, max_tokens=10, **T0, messages=HELLO)
    _check_order(events)
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens == events[-2].usage.input_tokens
    assert [e.delta.type for e in events if e.type == "content_block_delta"] == \
        ["text_delta"] * sum(e.type == "content_block_delta" for e in events)
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == whole.usage.output_tokens
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_stream_is_server_sent_events_with_event_lines(live_server: LiveServer) -> None:
    """Each event as Anthropic writes it: `event: <type>` then `data: {"type": <type>, ...}`; a ping early."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": HELLO, "stream": True}
    with httpx.stream("POST", live_server.url + "/v1/messages", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = "".join(resp.iter_text())
    kinds = []
    for block in raw.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: "), block
        assert json.loads(data_line[6:])["type"] == event_line[7:]
        kinds.append(event_line[7:])
    assert kinds[:2] == ["message_start", "ping"] and kinds[-1] == "message_stop"


def test_a_client_gone_mid_stream_frees_its_request(live_server: LiveServer) -> None:
    """Closing the stream after its first content event aborts the engine request (the
    autouse check then finds every KV block free)."""
    body = {"model": MODEL, "max_tokens": 200, "messages": HELLO, "stream": True}
    with httpx.stream("POST", live_server.url + "/v1/messages", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line == "event: content_block_delta":
                break
    live_server.wait_idle(30)


def _chat_sse(*chunks: dict[str, Any]) -> Any:
    async def body() -> Any:
        for chunk in chunks:
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    return body()


def _events(*chunks: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    async def run() -> list[bytes]:
        return [e async for e in message_events("msg_1", MODEL, 7, _chat_sse(*chunks))]

    out = []
    for raw in asyncio.run(run()):
        event_line, data_line = raw.decode().strip().split("\n")
        out.append((event_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return out


def _choice(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}


def test_stream_translation_of_text_then_calls() -> None:
    """A chat stream with text and two calls: one block each, in order, indices counted."""
    call = lambda i, name: {"tool_calls": [{"index": i, "id": f"chatcmpl-tool-{i}abc", "type": "function",  # noqa: E731
                                            "function": {"name": name, "arguments": ""}}]}
    args = lambda i, text: {"tool_calls": [{"index": i, "function": {"arguments": text}}]}  # noqa: E731
    events = _events(_choice({"role": "assistant", "content": ""}), _choice({"content": "Hi"}), _choice(call(0, "a")),
                     _choice(args(0, '{"x":')), _choice(args(0, "1}")), _choice(call(1, "b")), _choice(args(1, "{}")),
                     _choice({}, "tool_calls"), {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}})
    assert [k for k, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    starts = [d for k, d in events if k == "content_block_start"]
    assert [d["index"] for d in starts] == [0, 1, 2]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "toolu_0abc", "name": "a", "input": {}}
    assert [d["delta"]["partial_json"] for k, d in events if k == "content_block_delta" and d["index"] == 1] == \
        ['{"x":', "1}"]
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 9


def test_stream_translation_of_a_stop_string_and_of_failures() -> None:
    done = _events(_choice({"content": "a"}), _choice({}, "stop", stop_reason="END"))
    assert done[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    eos = _events(_choice({"content": "a"}), _choice({}, "stop", stop_reason=None))
    assert eos[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    failed = _events(_choice({"content": "a"}), {"error": {"message": "generation failed: boom", "code": 500}})
    assert failed[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                               "message": "generation failed: boom"}})
    dead = _events({"error": {"message": "the engine has stopped", "code": 503}})
    assert dead[-1][1]["error"]["type"] == "overloaded_error"
    cut = _events(_choice({"content": "a"}))  # no finish: aborted
    assert [k for k, _ in cut][-2:] == ["content_block_stop", "error"]


# ------------------------------------------------------------------------------- tools
def _tool_uses(message: Any) -> list[Any]:
    return [b for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_gives_a_valid_tool_use(claude: anthropic.Anthropic, stream: bool) -> None:
    kw = dict(max_tokens=120, **T0, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        events, msg = _stream(claude, **kw)
        _check_order(events)
        assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    else:
        msg = claude.messages.create(model=MODEL, **kw)
    (use,) = _tool_uses(msg)
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None


def test_named_tool_stream_equals_the_whole_answer(claude: anthropic.Anthropic) -> None:
    kw = dict(max_tokens=120, **T0, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
              tool_choice={"type": "tool", "name": "get_weather"})
    whole = claude.messages.create(model=MODEL, **kw)
    _, final = _stream(claude, **kw)
    strip = {"id": True, "content": {"__all__": {"id"}}}
    assert final.model_dump(exclude=strip) == whole.model_dump(exclude=strip)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("single", [False, True])
def test_any_gives_valid_tool_uses(claude: anthropic.Anthropic, single: bool, stream: bool) -> None:
    """`any` is enforced: the output is a list of calls, each valid for its tool; with
    disable_parallel_tool_use exactly one (short, so it always ends before max_tokens)."""
    kw = dict(max_tokens=200, extra_body={"temperature": 1.0}, tools=TOOLS,
              messages=[{"role": "user", "content": "Weather or time?"}],
              tool_choice={"type": "any", "disable_parallel_tool_use": single})
    if stream:
        events, msg = _stream(claude, **kw)
        _check_order(events)
    else:
        msg = claude.messages.create(model=MODEL, **kw)
    uses = _tool_uses(msg)
    if single:
        assert msg.stop_reason == "tool_use" and len(uses) == 1
    if msg.stop_reason == "tool_use":
        assert uses and all(b.type == "tool_use" for b in msg.content)
        for use in uses:
            jsonschema.validate(use.input, SCHEMAS[use.name])
            assert use.id.startswith("toolu_")
        assert len({u.id for u in uses}) == len(uses)
    else:  # a long list of calls cut by max_tokens: no complete call to show
        assert msg.stop_reason == "max_tokens"


def test_a_tool_result_turn_is_accepted(claude: anthropic.Anthropic, live_server: LiveServer) -> None:
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                  "input": {"city": "Paris", "days": 2, "metric": True}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                 {"type": "text", "text": "And tomorrow?"}]}]
    msg = claude.messages.create(model=MODEL, max_tokens=3, **T0, messages=turns, tools=TOOLS,
                                 tool_choice={"type": "none"})
    assert not _tool_uses(msg)
    as_chat = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "Let me look.", "tool_calls": [
                   {"id": "toolu_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "metric": true}'}}]},
               {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
               {"role": "user", "content": "And tomorrow?"}]
    # the tools are rendered too (tool_choice none still shows them to the template): count them alike
    counted = claude.messages.count_tokens(model=MODEL, messages=turns, tools=TOOLS, tool_choice={"type": "none"})
    assert msg.usage.input_tokens == counted.input_tokens
    no_tools = claude.messages.count_tokens(model=MODEL, messages=turns)
    assert no_tools.input_tokens == _prompt_tokens(live_server, as_chat)
    failed = json.loads(json.dumps(turns))
    failed[2]["content"][0].update(is_error=True, content="timeout")
    errored = claude.messages.count_tokens(model=MODEL, messages=failed)
    as_chat[2]["content"] = "Error: timeout"
    assert errored.input_tokens == _prompt_tokens(live_server, as_chat)


def test_auto_with_a_parser_renders_the_tools_and_parses_the_text(tiny_llama: Path, tmp_path: Path) -> None:
    """On a server with --tool-call-parser, tools without tool_choice mean auto: the template
    shows the tools to the model, and its free text comes back as text (a random model calls
    nothing by itself; the parsers are unit-tested in tests/unit/test_tool_parsers.py)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    live = start_server(ckpt, {"max_model_len": 1024}, enable_auto_tool_choice=True, tool_call_parser="hermes")
    try:
        claude = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=60)
        plain = claude.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens
        msg = claude.messages.create(model=MODEL, max_tokens=6, messages=HELLO, tools=TOOLS, **T0)
        assert msg.usage.input_tokens > plain + 20  # the tools' JSON is in the prompt
        assert msg.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in msg.content)
        events, final = _stream(claude, max_tokens=6, messages=HELLO, tools=TOOLS, tool_choice={"type": "auto"}, **T0)
        _check_order(events)
        assert final.model_dump(exclude={"id"}) == msg.model_dump(exclude={"id"})
        live.wait_idle(30)
    finally:
        live.stop()


def test_auto_tool_choice_needs_a_parser(claude: anthropic.Anthropic) -> None:
    """tools without tool_choice mean auto, which (as on the chat route) needs --tool-call-parser."""
    with pytest.raises(anthropic.BadRequestError, match="enable-auto-tool-choice"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tools=TOOLS)


# ------------------------------------------------------------------------------- structured output
class Person(BaseModel):
    # Closed choices only: a free string or number would let a random model write to max_tokens
    # (and the SDK moves bounds such as minimum out of the schema it sends, into descriptions).
    name: Literal["Ada", "Alan", "Grace"]
    admin: bool


def test_output_config_format_is_enforced(claude: anthropic.Anthropic) -> None:
    """output_config.format json_schema holds even a random-weight model's text to the schema."""
    msg = claude.messages.parse(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "Who?"}],
                                output_format=Person, extra_body={"temperature": 1.0})
    assert isinstance(msg.parsed_output, Person) and msg.stop_reason == "end_turn"


# ------------------------------------------------------------------------------- count_tokens
def test_count_tokens_matches_the_prompt(claude: anthropic.Anthropic) -> None:
    kw = dict(system="Be brief.", messages=[{"role": "user", "content": "Count me"}])
    counted = claude.messages.count_tokens(model=MODEL, **kw)
    msg = claude.messages.create(model=MODEL, max_tokens=2, **kw)
    assert counted.input_tokens == msg.usage.input_tokens > 0
    with_tools = claude.messages.count_tokens(model=MODEL, tools=TOOLS, tool_choice={"type": "any"}, **kw)
    assert with_tools.input_tokens >= counted.input_tokens


# ------------------------------------------------------------------------------- errors and refusals
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
# (what the 400's message must name, the request's fields)
REFUSED = [
    ("thinking", {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
    ("container", {"container": "container_1"}),
    ("mcp_servers", {"mcp_servers": [{"type": "url", "url": "https://example.com/sse", "name": "x"}]}),
    ("service_tier", {"service_tier": "priority"}),
    ("context_management", {"context_management": {"edits": []}}),
    ("effort", {"output_config": {"effort": "high"}}),
    ("output_config", {"output_config": {"format": {"type": "xml"}}}),
    ("output_config", {"output_config": {"task_budget": 5}}),
    ("speed", {"speed": "fast"}),
    ("diagnostics", {"diagnostics": {"previous_message_id": "msg_1"}}),
    ("inference_geo", {"inference_geo": "eu"}),
    ("metadata", {"metadata": {"user_id": "u1", "session": "s"}}),
    ("unknown_field", {"unknown_field": 1}),
    ("messages", {"messages": [{"role": "user", "content": [IMAGE]}]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                             "content": [IMAGE]}]}]}),
    ("messages", {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                                                                  "signature": "s"}]},
                               {"role": "user", "content": "hi"}]}),
    ("messages", {"messages": [*HELLO, {"role": "assistant", "content": "The answer is"}]}),  # prefill
    ("messages", {"messages": [{"role": "system", "content": "x"}]}),
    ("tools", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}),
    ("tool_choice names tool 'nope'", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}),
    ("tool_choice 'any' needs tools", {"tool_choice": {"type": "any"}}),  # in Anthropic's words, not chat's
    ("output_config.format", {"tools": TOOLS, "tool_choice": {"type": "any"}, "output_config": {
        "format": {"type": "json_schema", "schema": {"type": "object"}}}}),
]


@pytest.mark.parametrize("named, extra", REFUSED, ids=[f"{n.split()[0]}-{i}" for i, (n, _) in enumerate(REFUSED)])
def test_what_cannot_be_honoured_is_refused(claude: anthropic.Anthropic, named: str, extra: dict[str, Any]) -> None:
    body = {"max_tokens": 2, "messages": HELLO, **extra}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, messages=body.pop("messages"), max_tokens=body.pop("max_tokens"),
                               extra_body=body)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert named in info.value.body["error"]["message"], info.value.body
    assert set(info.value.body) == {"type", "error"} and set(info.value.body["error"]) == {"type", "message"}


def test_no_op_values_are_accepted(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model=MODEL, max_tokens=2, messages=HELLO, thinking={"type": "disabled"},
                                 service_tier="standard_only", metadata={"user_id": "u1"}, cache_control={"type": "ephemeral"},
                                 speed="standard", extra_body={"top_k": 5, "top_p": 0.9, "temperature": 0.5})
    assert msg.usage.output_tokens <= 2


def test_max_tokens_is_required(live_server: LiveServer) -> None:
    resp = httpx.post(live_server.url + "/v1/messages", json={"model": MODEL, "messages": HELLO}, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in resp.json()["error"]["message"]


def test_unknown_model_is_a_404_in_anthropics_shape(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="claude-nonexistent", max_tokens=2, messages=HELLO)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    assert "claude-nonexistent" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="claude-nonexistent", messages=HELLO)


def test_openai_routes_keep_openais_error_shape(live_server: LiveServer) -> None:
    resp = httpx.post(live_server.url + "/v1/chat/completions", json={"model": "nope", "messages": HELLO}, timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == 404 and "type" not in resp.json()


def test_the_api_key_through_x_api_key(server_factory: Callable[..., LiveServer]) -> None:
    live = server_factory(api_key="sekret")
    good = anthropic.Anthropic(base_url=live.url, api_key="sekret", max_retries=0, timeout=60)
    assert good.messages.create(model=MODEL, max_tokens=2, messages=HELLO).type == "message"
    assert good.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    bad = anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        with bad.messages.stream(model=MODEL, max_tokens=2, messages=HELLO) as stream:
            stream.get_final_message()
    # the OpenAI routes answer in OpenAI's shape, with the key in either header
    assert httpx.post(live.url + "/v1/chat/completions", headers={"x-api-key": "sekret"}, timeout=30,
                      json={"model": MODEL, "messages": HELLO, "max_tokens": 2}).status_code == 200
    denied = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": HELLO}, timeout=30)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == 401
