"""Every request field vLLM accepts is honoured or refused by name (stoker/server/generate/fields.py).

The table is walked row by row: a refused row's sample is a 400 that names the field, an
honoured row's sample a 200. The cheap fields the table calls honoured are then checked for
what they do: usage in every streamed chunk, cache_salt, priority, request_id,
return_tokens_as_token_ids, truncate_prompt_tokens, continue_final_message with echo,
add_special_tokens and a request's own chat template.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from stoker.server.generate.fields import RULES, FieldRule
from tests.server.conftest import MODEL, LiveServer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"


def _body(endpoint: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    if endpoint == "chat":
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "The fox"
    return {**base, **fields}


def _path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


ROWS = [(e, r) for r in RULES for e in r.endpoints if r.sample is not None]


@pytest.mark.parametrize("endpoint, rule", ROWS, ids=[f"{e}-{r.name}-{r.answer}" for e, r in ROWS])
def test_each_vllm_field_is_honoured_or_refused_by_name(live_server: LiveServer, endpoint: str, rule: FieldRule) -> None:
    body = _body(endpoint, **dict(rule.with_), **{rule.name: rule.sample})
    resp = httpx.post(live_server.url + _path(endpoint), json=body, timeout=60)
    if rule.answer == "refused":
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == rule.name and rule.name in err["message"], err
    else:
        assert resp.status_code == 200, resp.text


def test_the_docs_table_lists_every_field() -> None:
    """docs/server.md's "Request fields" table has a row for each field and says the same answer."""
    text = DOCS.read_text()
    section = text[text.index("### Request fields"):text.index("#### How the honoured fields behave")]
    for rule in RULES:
        row = re.search(rf"^\| `{re.escape(rule.name)}` \|([^\n]*)", section, re.M)
        assert row is not None, f"docs/server.md has no row for {rule.name}"
        assert rule.answer in row.group(1), rule.name
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows and not any("ignored" in line for line in rows)


def _sse(resp: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_in_every_chunk(live_server: LiveServer, endpoint: str) -> None:
    """guidellm's stream options: usage in every chunk, its completion tokens counting up, the
    last chunk's totals equal to the non-streamed usage."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = _body(endpoint, max_tokens=6, ignore_eos=True, stream=True, stream_options=opts)
    chunks = _sse(httpx.post(live_server.url + _path(endpoint), json=body, timeout=60))
    assert chunks and all("usage" in c and c["usage"] is not None for c in chunks)
    *running, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    counts = [c["usage"]["completion_tokens"] for c in running]
    assert counts == sorted(counts) and counts[-1] == 6
    prompt = last["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"]
               for c in chunks)
    whole = httpx.post(live_server.url + _path(endpoint), json=_body(endpoint, max_tokens=6, ignore_eos=True),
                       timeout=60).json()["usage"]
    assert (whole["prompt_tokens"], whole["completion_tokens"]) == (prompt, 6)
    # without it, only the last chunk has usage; continuous_usage_stats alone asks for usage (vLLM's default)
    plain = _sse(httpx.post(live_server.url + _path(endpoint), timeout=60,
                            json={**body, "stream_options": {"include_usage": True}}))
    assert [c.get("usage") is not None for c in plain] == [False] * (len(plain) - 1) + [True]
    alone = _sse(httpx.post(live_server.url + _path(endpoint), timeout=60,
                            json={**body, "stream_options": {"continuous_usage_stats": True}}))
    assert all(c.get("usage") for c in alone)


def test_cache_salt_keeps_tenants_apart(client: OpenAI) -> None:
    prompt = "Salted prefixes are shared only within a tenant. " * 4
    kw = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    first = client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    same = client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    other = client.completions.create(**kw, extra_body={"cache_salt": "tenant-b"})
    unsalted = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens >= 16
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0
    assert same.choices[0].text == other.choices[0].text == unsalted.choices[0].text


def test_priority_needs_the_priority_policy(live_server: LiveServer) -> None:
    resp = httpx.post(live_server.url + "/v1/completions", json=_body("completions", priority=3), timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in resp.json()["error"]["message"]


def test_priority_server_admits_lower_values_first(server_factory: Any) -> None:
    live = server_factory(engine_kwargs={"scheduling_policy": "priority"})
    for p in (-5, 0, 7):
        resp = httpx.post(live.url + "/v1/completions", json=_body("completions", priority=p), timeout=30)
        assert resp.status_code == 200, resp.text


def test_request_id_names_the_response(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"request_id": "abc-1"})
    assert out.id == "cmpl-abc-1"
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                           extra_body={"request_id": "abc-1"})
    assert again.id == "chatcmpl-abc-1"


def test_return_tokens_as_token_ids(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The fox", max_tokens=3, temperature=0, logprobs=2,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert all(re.fullmatch(r"token_id:\d+", t) for t in out.choices[0].logprobs.tokens)
    assert all(re.fullmatch(r"token_id:\d+", k) for top in out.choices[0].logprobs.top_logprobs for k in top)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    for entry in chat.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", entry.token)
        assert all(re.fullmatch(r"token_id:\d+", t.token) for t in entry.top_logprobs)


def test_truncate_prompt_tokens_keeps_the_prompt_end(client: OpenAI) -> None:
    long = "one two three four five six seven eight nine ten " * 40  # past max_model_len (256)
    out = client.completions.create(model=MODEL, prompt=long, max_tokens=2, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 20})
    assert out.usage.prompt_tokens == 20
    tail = client.completions.create(model=MODEL, prompt=long, max_tokens=2, temperature=0, echo=True,
                                     extra_body={"truncate_prompt_tokens": 20})
    assert long.rstrip().endswith(tail.choices[0].text[: -len(out.choices[0].text)].strip()[-20:])
    # -1: the last max_model_len (256) tokens, which leave no room for the completion here
    import openai

    with pytest.raises(openai.BadRequestError, match="256 in the prompt"):
        client.completions.create(model=MODEL, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 30})
    assert chat.usage.prompt_tokens == 30


def test_continue_final_message_with_echo(live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello, my"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0,
            "continue_final_message": True, "add_generation_prompt": False, "echo": True}
    out = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=30).json()
    assert out["choices"][0]["message"]["content"].startswith("Hello, my")
    tok = httpx.post(live_server.url + "/tokenize", json={"model": MODEL, "messages": messages,
                                                         "add_generation_prompt": False}, timeout=30).json()
    # the prompt ends with the open assistant message: fewer tokens than a closed turn would have
    assert out["usage"]["prompt_tokens"] < tok["count"]
    streamed = _sse(httpx.post(live_server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"])
    assert text == out["choices"][0]["message"]["content"]
    both = httpx.post(live_server.url + "/v1/chat/completions", json={**body, "add_generation_prompt": True}, timeout=30)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_add_special_tokens_adds_bos(client: OpenAI) -> None:
    kw = dict(model=MODEL, prompt="The fox", max_tokens=1)
    assert (client.completions.create(**kw).usage.prompt_tokens
            == client.completions.create(**kw, extra_body={"add_special_tokens": False}).usage.prompt_tokens + 1)


def test_request_chat_template_only_when_trusted(live_server: LiveServer, server_factory: Any) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": "{% for m in messages %}{{ m['content'] }} ZZZ{% endfor %}"}
    resp = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template"
    trusted = server_factory(trust_request_chat_template=True)
    out = httpx.post(trusted.url + "/v1/chat/completions", json=body, timeout=30).json()
    plain = httpx.post(trusted.url + "/v1/chat/completions", json={k: v for k, v in body.items() if k != "chat_template"},
                       timeout=30).json()
    assert out["usage"]["prompt_tokens"] != plain["usage"]["prompt_tokens"]
