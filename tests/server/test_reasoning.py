"""Reasoning output through the official client (issue 32, part 3): `--reasoning-parser`,
`reasoning_content` / `reasoning` whole and streamed, `include_reasoning`, tool calls parsed
after the thinking only, `chat_template_kwargs`, structured outputs enforced after the thinking,
and the Responses API's reasoning item.

A random-weight model never writes `<think>`. Where a test needs a known text, a regex forces
it; as the server keeps the grammar off until the thinking ends (which a random model never
reaches), such tests swap the plan's end marker for None (the grammar applies from the first
token) so the regex can write the thinking too. The parsers themselves are unit-tested in
tests/unit/test_reasoning_parsers.py and tests/unit/test_harmony.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from stoker.server.generate import reasoning
from stoker.server.generate.reasoning import DeepSeekR1Parser
from stoker.server.generate.reasoning_output import ReasoningPlan
from tests.server.conftest import MODEL, LiveServer, start_server
from tests.server.test_tool_calls import HERMES_TEMPLATE, TOOLS

# The Hermes-style template, closing the thinking in the prompt when told `enable_thinking: false`
# (as Qwen3's template does).
THINKING_TEMPLATE = "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}" + HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _server(ckpt_root: Path, tiny_llama: Path, **settings: Any) -> LiveServer:
    ckpt = ckpt_root / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return start_server(ckpt, {"max_model_len": 1024}, **settings)


@pytest.fixture(scope="module")
def r1_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = _server(tmp_path_factory.mktemp("r1"), tiny_llama, reasoning_parser="deepseek_r1",
                   enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield live
    live.wait_idle(30)
    engine = live.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "a KV block leaked"
    live.stop()


@pytest.fixture
def r1(r1_server: LiveServer) -> OpenAI:
    return OpenAI(base_url=r1_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def grammar_from_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test double: the grammar applies from the first token, so a regex can plant the thinking."""
    monkeypatch.setattr(ReasoningPlan, "end_marker", property(lambda self: None))


def _chat(client: OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw).choices[0]


def _stream(client: OpenAI, **kw: Any) -> tuple[str, str, str, dict[int, dict[str, str]], str | None]:
    """(reasoning_content, reasoning, content, calls by index, finish_reason) put together from the chunks."""
    rc = r = content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            rc += getattr(delta, "reasoning_content", None) or ""
            r += getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return rc, r, content, calls, finish


PLANTED = {"guided_regex": r"<think>abc</think>hello"}


def test_reasoning_split_whole_and_streamed(r1: OpenAI, grammar_from_the_start: None) -> None:
    kw = dict(max_tokens=40, temperature=1.0, seed=1, extra_body=PLANTED)
    choice = _chat(r1, **kw)
    assert choice.message.reasoning_content == "abc" and choice.message.reasoning == "abc"
    assert choice.message.content == "hello" and choice.finish_reason == "stop"
    assert _stream(r1, **kw) == ("abc", "abc", "hello", {}, "stop")


def test_include_reasoning_false_drops_it(r1: OpenAI, grammar_from_the_start: None) -> None:
    kw = dict(max_tokens=40, temperature=1.0, seed=1, extra_body={**PLANTED, "include_reasoning": False})
    choice = _chat(r1, **kw)
    assert choice.message.reasoning_content is None and choice.message.reasoning is None
    assert choice.message.content == "hello"
    assert _stream(r1, **kw) == ("", "", "hello", {}, "stop")


def test_tool_calls_are_parsed_after_the_thinking_only(r1: OpenAI, grammar_from_the_start: None) -> None:
    thought = r'<think>maybe <tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call></think>'
    answer = r'Sure\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 2, "metric": true\}\}</tool_call>'
    kw = dict(tools=TOOLS, max_tokens=200, temperature=1.0, seed=1, extra_body={"guided_regex": thought + answer})
    choice = _chat(r1, **kw)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert choice.message.reasoning_content == 'maybe <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Oslo", "days": 2, "metric": True}
    rc, _, content, calls, finish = _stream(r1, **kw)
    assert (rc, content, finish) == (choice.message.reasoning_content, "Sure.", "tool_calls")
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


def test_unclosed_thinking_is_all_reasoning(r1: OpenAI) -> None:
    """The random model never writes </think>: with deepseek_r1 all of its text is reasoning."""
    kw = dict(max_tokens=12, temperature=1.0, seed=3)
    choice = _chat(r1, **kw)
    assert choice.message.content is None and choice.message.reasoning_content
    assert _stream(r1, **kw) == (choice.message.reasoning_content, choice.message.reasoning_content, "", {},
                                 choice.finish_reason)


def test_chat_template_kwargs_reach_the_template(r1: OpenAI) -> None:
    """enable_thinking false: the template closes the thinking in the prompt, so the text is content."""
    kw = dict(max_tokens=12, temperature=1.0, seed=3)
    thinking = r1.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
    direct = r1.chat.completions.create(model=MODEL, messages=MESSAGES, **kw,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert direct.usage.prompt_tokens > thinking.usage.prompt_tokens  # <think>\n\n</think>\n\n was rendered
    message = direct.choices[0].message
    assert message.content and message.reasoning_content is None and message.reasoning is None


def test_reasoning_effort_reaches_the_template(r1: OpenAI) -> None:
    kw = dict(max_tokens=1, temperature=0)
    plain = r1.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
    high = r1.chat.completions.create(model=MODEL, messages=MESSAGES, reasoning_effort="high", **kw)
    low = r1.chat.completions.create(model=MODEL, messages=MESSAGES, reasoning_effort="high", **kw,
                                     extra_body={"chat_template_kwargs": {"reasoning_effort": "lo"}})
    assert plain.usage.prompt_tokens < low.usage.prompt_tokens < high.usage.prompt_tokens  # chat_template_kwargs win


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tools", "bos_token"])
def test_a_reserved_template_kwarg_is_refused(r1_server: LiveServer, name: str) -> None:
    resp = httpx.post(r1_server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {name: True}})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "chat_template_kwargs" and name in err["message"]


def test_structured_output_waits_for_the_end_of_thinking(r1: OpenAI, r1_server: LiveServer) -> None:
    """The grammar is off while the model thinks: a random model never closes its thinking, so
    its text is the same as without response_format; once the prompt closed the thinking, the
    grammar holds from the first token."""
    kw = dict(max_tokens=12, temperature=1.0, seed=5)
    free = _chat(r1, **kw)
    constrained = _chat(r1, response_format={"type": "json_object"}, **kw)
    assert constrained.message.reasoning_content == free.message.reasoning_content
    direct = _chat(r1, response_format={"type": "json_object"}, max_tokens=60, temperature=1.0, seed=5,
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert direct.message.reasoning_content is None and direct.message.content.startswith("{")


class _OneTokenThink(DeepSeekR1Parser):
    """deepseek_r1 with an end marker the tiny vocabulary holds as one token (`</think>` is six there)."""

    end_marker = "<|begin_of_text|>"


def test_structured_output_holds_after_the_end_marker(r1: OpenAI, r1_server: LiveServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: the end marker's token pushed up by logit_bias, so the model thinks a few
    tokens and writes it; from the next token on the JSON grammar (enforce_after) holds."""
    monkeypatch.setitem(reasoning.PARSERS, "deepseek_r1", _OneTokenThink())
    (marker,) = r1_server.state.tokenizer.encode("<|begin_of_text|>", add_special_tokens=False)
    choice = _chat(r1, response_format={"type": "json_object"}, max_tokens=200, temperature=1.0, seed=2,
                   logit_bias={str(marker): 6})
    message = choice.message
    assert message.reasoning_content and "<|begin_of_text|>" not in message.reasoning_content, message
    assert message.content is not None and message.content.startswith("{"), message
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(message.content), dict)
    # Without the marker's push the model never ends its thinking: nothing is constrained.
    free = _chat(r1, response_format={"type": "json_object"}, max_tokens=30, temperature=1.0, seed=2)
    assert free.message.content is None and free.message.reasoning_content


def test_responses_reasoning_item(r1: OpenAI) -> None:
    """The random model never closes its thinking: its whole text is one reasoning item."""
    resp = r1.responses.create(model=MODEL, input="Hi", max_output_tokens=12, temperature=0)
    chat = r1.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                      temperature=0)
    assert [item.type for item in resp.output] == ["reasoning"]
    item = resp.output[0]
    assert item.summary == [] and item.content[0].type == "reasoning_text"
    assert item.content[0].text == chat.choices[0].message.reasoning_content and resp.output_text == ""


def test_responses_reasoning_item_before_the_message(r1: OpenAI, grammar_from_the_start: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.server.generate import responses_protocol

    original = responses_protocol.ResponsesRequest.chat_body
    monkeypatch.setattr(responses_protocol.ResponsesRequest, "chat_body",
                        lambda self: {**original(self), **PLANTED})
    resp = r1.responses.create(model=MODEL, input="Hi", max_output_tokens=40, temperature=1.0)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "abc" and resp.output_text == "hello"
    events = list(r1.responses.create(model=MODEL, input="Hi", max_output_tokens=40, temperature=1.0, stream=True))
    kinds = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "abc"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "hello"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "abc"


@pytest.fixture(scope="module")
def harmony_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = _server(tmp_path_factory.mktemp("harmony"), tiny_llama, reasoning_parser="gpt_oss",
                   enable_auto_tool_choice=True, tool_call_parser="openai")
    yield live
    live.stop()


def test_gpt_oss_analysis_and_a_harmony_tool_call(harmony_server: LiveServer, grammar_from_the_start: None) -> None:
    """The harmony markers are plain text to the tiny tokenizer: the regex writes them as gpt-oss would."""
    client = OpenAI(base_url=harmony_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    text = (r"<\|channel\|>analysis<\|message\|>Need the weather\.<\|end\|><\|start\|>assistant<\|channel\|>commentary "
            r'to=functions\.get_weather <\|constrain\|>json<\|message\|>\{"city": "Rome", "days": 1, "metric": false\}')
    kw = dict(tools=TOOLS, max_tokens=200, temperature=1.0, seed=1, extra_body={"guided_regex": text})
    choice = _chat(client, **kw)
    assert choice.message.reasoning_content == "Need the weather."
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome", "days": 1, "metric": False}
    rc, _, content, calls, finish = _stream(client, **kw)
    assert (rc, content, finish) == ("Need the weather.", "", "tool_calls")
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
