"""POST /v1/responses through the official SDK (`client.responses.create/parse/stream`):
stateless over the chat path, streaming events in the Responses shape, structured output
through text.format, function tools, and clear refusals of what needs storage."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL, LiveServer

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                           "days": {"type": "integer"}},
                          "required": ["city", "days"], "additionalProperties": False}}


def test_create_matches_the_chat_path(client: OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input="Say something", instructions="Be brief", max_output_tokens=5,
                                   temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, messages=[
        {"role": "system", "content": "Be brief"}, {"role": "user", "content": "Say something"}])
    assert resp.object == "response" and resp.id.startswith("resp")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens and resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.instructions == "Be brief" and resp.store is False


def test_input_items_become_the_conversation(client: OpenAI, live_server: LiveServer) -> None:
    items = [{"role": "developer", "content": "Answer in French"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
             {"role": "user", "content": "And goodbye?"}]
    resp = client.responses.create(model=MODEL, input=items, max_output_tokens=4, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": "Answer in French"}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "And goodbye?"}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def test_streaming_events_in_order(client: OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Tell me", max_output_tokens=6, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Tell me", max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") < \
        kinds.index("response.output_text.delta") < kinds.index("response.output_item.done")
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


class Person(BaseModel):
    name: Literal["Ada", "Alan", "Grace"]  # a free string would let a random model write to max tokens
    age: int = Field(ge=0, le=120)


def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    """text.format json_schema: enforced, so even a random-weight model's output parses."""
    resp = client.responses.parse(model=MODEL, input="Who?", text_format=Person, max_output_tokens=200, temperature=1.0)
    assert isinstance(resp.output_parsed, Person) and 0 <= resp.output_parsed.age <= 120


def test_json_schema_text_format_validates(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False}
    resp = client.responses.create(model=MODEL, input="Tags", max_output_tokens=200, temperature=1.0, text={
        "format": {"type": "json_schema", "name": "tags", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_a_named_function_tool_is_called_with_valid_arguments(client: OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=200,
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=200,
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0,
                                          stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args
    # the call and its output go back in as input items: the conversation continues
    # (tool_choice "auto", the default, needs a server started with a tool-call parser: 400 here)
    with pytest.raises(BadRequestError, match="enable-auto-tool-choice"):
        client.responses.create(model=MODEL, tools=[WEATHER], input="Weather?")
    follow = client.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=3, input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete")


@pytest.mark.parametrize("field, value, param", [
    ("store", True, "store"),
    ("previous_response_id", "resp_123", "previous_response_id"),
    ("background", True, "background"),
    ("tools", [{"type": "web_search"}], "tools"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}], "input"),
    ("input", [{"type": "item_reference", "id": "msg_1"}], "input"),
    ("text", {"format": {"type": "xml"}}, "text"),
    ("text", {"verbosity": "low"}, "text"),
    ("reasoning", {"effort": "high", "summary": "auto"}, "reasoning"),
    ("service_tier", "flex", "service_tier"),
    ("include", ["message.output_text.logprobs"], "include"),
])
def test_what_needs_storage_or_is_missing_is_refused(live_server: LiveServer, field: str, value: object, param: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, field: value}
    resp = httpx.post(live_server.url + "/v1/responses", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_the_sdk_raises_on_a_refusal(client: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="stateless"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


def test_reasoning_effort_and_service_tier_are_honoured(live_server: LiveServer) -> None:
    """reasoning.effort reaches the chat template (as chat's reasoning_effort); the one tier is auto/default."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"},
            "service_tier": "default", "parallel_tool_calls": False}
    resp = httpx.post(live_server.url + "/v1/responses", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["reasoning"] == {"effort": "low"} and out["service_tier"] == "default"
    assert out["parallel_tool_calls"] is False
