"""Property-based fuzzing of request bodies: whatever the body, never a 5xx, and every error
in the OpenAI shape. Values mix valid ones, edge cases, wrong types, huge integers, NaN
and infinity; unknown keys ride along. The engine must still be healthy afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL, LiveServer

BIG_INTS = st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)])
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1e-9, 0.5, 1.0, 2.0, -0.0, 1e308])
SCALARS = st.none() | st.booleans() | st.integers(-5, 40) | BIG_INTS | FLOATS | st.text(max_size=12)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
SMALL_INT = st.integers(-3, 24) | BIG_INTS
TOKEN_IDS = st.lists(st.integers(-2, 1100) | BIG_INTS, max_size=12)
STOPS = st.none() | st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3)

COMMON = {
    "model": st.sampled_from([MODEL, "other", None, ""]) | JUNK,
    "max_tokens": SMALL_INT | JUNK,
    "temperature": FLOATS | st.floats(-1, 3) | JUNK,
    "top_p": FLOATS | st.floats(-0.5, 1.5) | JUNK,
    "top_k": st.integers(-3, 2000) | BIG_INTS | JUNK,
    "min_p": FLOATS | JUNK,
    "n": st.integers(-2, 4) | st.sampled_from([0, 129, 2**40]) | JUNK,
    "seed": st.integers() | JUNK,
    "stop": STOPS | JUNK,
    "stop_token_ids": TOKEN_IDS | JUNK,
    "presence_penalty": FLOATS | JUNK,
    "frequency_penalty": FLOATS | JUNK,
    "repetition_penalty": FLOATS | JUNK,
    "min_tokens": SMALL_INT | JUNK,
    "ignore_eos": st.booleans() | JUNK,
    "stream": st.booleans() | JUNK,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JUNK}) | JUNK,
    "include_stop_str_in_output": st.booleans() | JUNK,
    "skip_special_tokens": st.booleans() | JUNK,
    "unknown_field": JUNK,
}
COMPLETION = {
    **COMMON,
    "prompt": st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=3) | TOKEN_IDS
    | st.lists(TOKEN_IDS, max_size=3) | JUNK,
    "logprobs": st.integers(-2, 25) | JUNK,
    "echo": st.booleans() | JUNK,
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | JUNK},
    optional={"content": st.text(max_size=30) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                                  "text": st.text(max_size=10)}), max_size=2) | JUNK,
              "name": st.text(max_size=5)},
)
CHAT = {
    **COMMON,
    "messages": st.lists(MESSAGE, max_size=3) | JUNK,
    "logprobs": st.booleans() | JUNK,
    "top_logprobs": st.integers(-2, 25) | JUNK,
    "max_completion_tokens": SMALL_INT | JUNK,
}


def _bodies(fields: dict, required: str) -> st.SearchStrategy[dict]:
    """Bodies with any subset of the fields, and (more often) bodies that do have the required one."""
    rest = {k: v for k, v in fields.items() if k != required}
    return st.fixed_dictionaries({}, optional=fields) | st.fixed_dictionaries({required: fields[required]}, optional=rest)


@pytest.fixture(scope="module")
def fuzz_server(server_factory) -> LiveServer:
    # A short context bounds the work of any body that happens to be valid.
    return server_factory(engine_kwargs={"max_model_len": 48, "num_gpu_blocks_override": 512})


def _check(client: httpx.Client, path: str, body: object) -> None:
    raw = json.dumps(body, allow_nan=True)
    resp = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code < 500, (raw, resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == resp.status_code, (raw, resp.text)
    elif resp.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in resp.text.split("\n") if line]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), (raw, resp.text[-500:])
    else:
        assert resp.json()["choices"], raw


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(body=_bodies(COMPLETION, "prompt") | JUNK)
def test_fuzz_completions(fuzz_server: LiveServer, body: object) -> None:
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as client:
        _check(client, "/v1/completions", body)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(body=_bodies(CHAT, "messages") | JUNK)
def test_fuzz_chat(fuzz_server: LiveServer, body: object) -> None:
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as client:
        _check(client, "/v1/chat/completions", body)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional={"prompt": JUNK | st.text(max_size=20), "messages": st.lists(MESSAGE, max_size=2) | JUNK,
                                                "tokens": TOKEN_IDS | JUNK, "add_special_tokens": JUNK}))
def test_fuzz_tokenize(fuzz_server: LiveServer, body: dict) -> None:
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as client:
        for path in ("/tokenize", "/detokenize"):
            resp = client.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
            assert resp.status_code < 500, (body, resp.text[:300])


def test_engine_healthy_after_fuzzing(fuzz_server: LiveServer) -> None:
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    fuzz_server.wait_idle()
    fuzz_server.engine.check_integrity()
