"""Structured outputs through the official client (issue 15, item 1): only enforcement can make
a random-weight model write JSON that validates, so these tests cannot pass by luck."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI
from typing import Literal

from pydantic import BaseModel, Field

from tests.server.conftest import MODEL, LiveServer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "address", "tags", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_always_validates(client: OpenAI, seed: int) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_json_object_and_streaming(client: OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0.7, seed=5,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    pieces = []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=6, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}):
        pieces += [c.delta.content or "" for c in chunk.choices]
    jsonschema.validate(json.loads("".join(pieces)), SCHEMA)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]  # a free string would let a random model write forever
    legs: int = Field(ge=0, le=8)


def test_sdk_parse_with_a_pydantic_model(client: OpenAI) -> None:
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=200, temperature=0.0)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet)


def test_vllm_extras_choice_regex_grammar_on_completions(client: OpenAI) -> None:
    for seed in range(3):
        choice = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, temperature=1.0, seed=seed,
                                           extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
        assert choice.choices[0].text in ("yes", "no", "maybe")
        regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=seed,
                                          extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
        assert re.fullmatch("[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
        grammar = client.completions.create(model=MODEL, prompt="Math:", max_tokens=30, temperature=1.0, seed=seed,
                                            extra_body={"structured_outputs": {"grammar": 'root ::= num "+" num\nnum ::= [1-9] [0-9]?'}})
        assert re.fullmatch(r"[1-9][0-9]?\+[1-9][0-9]?", grammar.choices[0].text)


def test_a_constrained_request_gets_alone_what_it_gets_in_a_mixed_batch(live_server: LiveServer) -> None:
    """Seeded sampling: the same tokens whether the request shares its steps with free ones."""
    body = {"model": MODEL, "prompt": "Person:", "max_tokens": 80, "temperature": 1.0, "seed": 11,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    alone = httpx.post(live_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    import concurrent.futures

    free = {"model": MODEL, "prompt": "Story:", "max_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(httpx.post, live_server.url + "/v1/completions", json={**free, "seed": i}, timeout=60)
                  for i in range(5)]
        mixed = pool.submit(httpx.post, live_server.url + "/v1/completions", json=body, timeout=60)
        texts = [f.result().json()["choices"][0]["text"] for f in others]
    assert mixed.result().json()["choices"][0]["text"] == alone
    assert all(t for t in texts)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format"),  # not enforceable
    ({"guided_json": {"type": "object", "properties": {"not": {"not": {"type": "integer"}}}}}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"guided_choice": ["a", "b"], "allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"guided_choice": ["a", "b"], "bad_words": ["a"]}, "bad_words"),
])
def test_constraints_that_cannot_be_enforced_are_refused(live_server: LiveServer, body: dict, param: str) -> None:
    resp = httpx.post(live_server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()
