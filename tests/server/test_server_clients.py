"""What real clients rely on (issue 15): readiness, the first-token time of streamed chat,
and the sampling extras vLLM clients send."""

from __future__ import annotations

import time

from openai import OpenAI

from tests.server.conftest import MODEL, LiveServer


def test_streamed_chat_sends_the_role_with_the_first_token(server_factory) -> None:
    """The role chunk used to go out before the prefill ran, so a client's TTFT was the
    request's arrival; it now goes with the first output, as vLLM sends it."""
    live: LiveServer = server_factory()
    engine = live.engine
    real_step = engine.step

    def slow_step():  # every step takes 0.3 s: a visible prefill
        time.sleep(0.3)
        return real_step()

    engine.step = slow_step
    try:
        client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        start = time.monotonic()
        arrivals = []
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, stream=True, temperature=0)
        for chunk in stream:
            if chunk.choices:
                d = chunk.choices[0].delta
                arrivals.append(("role" if d.role else "content", time.monotonic() - start))
    finally:
        del engine.step
    assert arrivals[0][0] == "role" and [k for k, _ in arrivals].count("role") == 1
    role_t = arrivals[0][1]
    assert role_t >= 0.3, f"the role chunk came {role_t:.3f} s after the request, before the first step ended"


import httpx  # noqa: E402
import pytest  # noqa: E402


def test_logit_bias_forces_and_bans_tokens(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The fox", max_tokens=6, temperature=1.0, seed=1,
                                    logit_bias={"300": 100})
    assert out.choices[0].text  # every sampled token is 300
    ids = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize",
                     json={"model": MODEL, "prompt": out.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    assert set(ids) == {300}
    greedy = client.completions.create(model=MODEL, prompt="The fox", max_tokens=1, temperature=0, logprobs=1)
    first = greedy.choices[0].logprobs.tokens[0]
    first_id = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize",
                          json={"model": MODEL, "prompt": first, "add_special_tokens": False}).json()["tokens"][0]
    banned = client.completions.create(model=MODEL, prompt="The fox", max_tokens=1, temperature=0, logprobs=1,
                                       logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"300": 100}, logprobs=True)
    assert [c.token for c in chat.choices[0].logprobs.content] == [chat.choices[0].logprobs.content[0].token] * 4


def test_allowed_token_ids_limit_what_is_sampled(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The fox", max_tokens=8, temperature=1.0, seed=3,
                                    extra_body={"allowed_token_ids": [300, 301], "return_tokens_as_token_ids": True})
    ids = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize",
                     json={"model": MODEL, "prompt": out.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    assert ids and set(ids) <= {300, 301}


@pytest.mark.parametrize("field, value", [
    ("tool_choice", "required"),  # without tools (tool calling itself: test_tool_calls.py)
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", {"name": "f"}),
])
def test_fields_not_honoured_are_refused_by_name(live_server: LiveServer, field: str, value: object) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    resp = httpx.post(live_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and field in err["message"]
    # the no-op values are accepted
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
          "response_format": {"type": "text"}, "tool_choice": "none", "tools": []}
    assert httpx.post(live_server.url + "/v1/chat/completions", json=ok, timeout=30).status_code == 200


def test_function_turns_and_bad_logit_bias_are_refused(live_server: LiveServer) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "42"}]
    resp = httpx.post(live_server.url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[1]"
    resp = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": {"99999": 5}},
                      timeout=30)
    assert resp.status_code == 400 and "logit_bias" in resp.json()["error"]["message"]


def test_usage_reports_cached_prompt_tokens(client: OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens  # full blocks from the prefix cache; the last token is computed
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2)
    assert chat.usage.prompt_tokens_details is not None
