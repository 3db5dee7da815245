"""The server as users meet it: the official `openai` client against a real uvicorn server."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server.conftest import MODEL, LiveServer

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story about a fox."}]


def _post(client: OpenAI, path: str, body: dict) -> dict:
    """Non-/v1 routes (tokenize, detokenize) with plain httpx."""
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    resp = httpx.post(root + path, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream_completion(client: OpenAI, **kw) -> tuple[str, list, object]:
    pieces, chunks, usage = [], [], None
    for chunk in client.completions.create(model=MODEL, stream=True, **kw):
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
    return "".join(pieces), chunks, usage


def test_models(client: OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "stoker" and models[0].created > 0
    assert models[0].model_extra["max_model_len"] == 256


def test_completion_stream_equals_greedy(client: OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.created > 0
    assert full.system_fingerprint
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == len(_post(client, "/tokenize", {"prompt": PROMPT})["tokens"])
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    streamed, chunks, usage = _stream_completion(client, prompt=PROMPT, max_tokens=40, temperature=0,
                                                 stream_options={"include_usage": True})
    assert streamed == text
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens and usage.prompt_tokens == full.usage.prompt_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]


def test_default_max_tokens_is_16(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_chat_stream_equals_greedy(client: OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and msg.role == "assistant"
    assert full.usage.completion_tokens <= 30
    pieces, roles, usage, finish = [], [], None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            pieces.append(c.delta.content or "")
            if c.finish_reason:
                finish.append(c.finish_reason)
    assert "".join(pieces) == msg.content
    assert roles == ["assistant"] and finish == [full.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_max_completion_tokens_and_length(client: OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_n2_usage_and_seeds(client: OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, n=2, seed=7, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices], "same seed, same text"
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == b.usage.prompt_tokens
    other = client.completions.create(**{**kw, "seed": 8})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    # n=2 streamed: each index reassembles to text, usage counts both completions.
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in a.choices]
    assert usage.completion_tokens == 24


def test_chat_n2(client: OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, seed=3,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 12


def test_stop_strings(client: OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert len(greedy) > 12
    stop = greedy[8:11]
    cut = greedy.index(stop)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "\x00never"],
                                    extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert c.text == greedy[:cut] and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    streamed, _, _ = _stream_completion(client, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                        extra_body={"ignore_eos": True})
    assert streamed == greedy[:cut]
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == greedy[: cut + len(stop)]


def test_completion_logprobs(client: OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # Per-token text can be a partial UTF-8 character (U+FFFD) the full text completes.
    assert "".join(t for t in lp.tokens if "\ufffd" not in t) in out.choices[0].text or "\ufffd" in "".join(lp.tokens)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 1 <= len(top) <= 4  # 3 + the sampled one; tokens decoding alike collide as keys
        assert val >= max(top.values()) - 1e-4, "greedy picks the most likely token"
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                         stream=True, extra_body={"ignore_eos": True})
    toks = [t for ch in streamed for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    assert toks == lp.tokens


def test_chat_logprobs(client: OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_echo_token_prompts_and_batches(client: OpenAI) -> None:
    ids = _post(client, "/tokenize", {"prompt": PROMPT})["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "Another prompt"], max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]
    assert batch.usage.completion_tokens == 8
    batch_ids = client.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=3, temperature=0, stream=True)
    got = {}
    for chunk in batch_ids:
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert set(got) == {0, 1}


def test_tokenize_detokenize(client: OpenAI) -> None:
    tok = _post(client, "/tokenize", {"prompt": "hello world"})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    text = _post(client, "/detokenize", {"tokens": tok["tokens"]})["prompt"]
    assert text.endswith("hello world")
    chat = _post(client, "/tokenize", {"messages": CHAT})
    assert chat["count"] > tok["count"]


def test_32_concurrent_streams(live_server: LiveServer) -> None:
    async def run() -> list[tuple[str, str | None, int]]:
        client = AsyncOpenAI(base_url=live_server.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(i: int) -> tuple[str, str | None, int]:
            text, finish, usage = "", None, 0
            stream = await client.completions.create(model=MODEL, prompt=f"{i} {PROMPT}", max_tokens=8 + i % 8,
                                                     temperature=0.8, seed=i, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
                for c in chunk.choices:
                    text += c.text
                    finish = c.finish_reason or finish
            return text, finish, usage

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert [r[1] for r in results] == ["length"] * 32
    assert [r[2] for r in results] == [8 + i % 8 for i in range(32)]
    live_server.wait_idle()
    assert live_server.engine.block_manager.num_free_blocks == live_server.engine.block_manager.num_blocks
    live_server.engine.check_integrity()


def test_same_tokens_alone_and_among_32_concurrent_requests(live_server: LiveServer) -> None:
    """Issue 12 through the server: a greedy and a seeded request answer the same text and
    logprobs alone and while 31 other requests (other lengths, sampled) share their steps."""
    from stoker.kernels.cpu import build

    if not build.available():
        pytest.skip("batch invariance is a property of the C kernels")
    probes = [dict(temperature=0), dict(temperature=0.8, seed=77)]

    async def run(kws: list[dict], with_others: bool) -> list[tuple[str, list[float]]]:
        client = AsyncOpenAI(base_url=live_server.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def probe(kw: dict) -> tuple[str, list[float]]:
            out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, logprobs=1,
                                                  extra_body={"ignore_eos": True}, **kw)
            return out.choices[0].text, out.choices[0].logprobs.token_logprobs

        async def other(i: int) -> None:
            await client.completions.create(model=MODEL, prompt=" ".join([f"{i} {PROMPT}"] * (1 + i % 5)), max_tokens=4 + i % 20,
                                            temperature=0.9, seed=i, extra_body={"ignore_eos": True})

        try:
            others = [other(i) for i in range(30)] if with_others else []
            results = await asyncio.gather(*(probe(kw) for kw in kws), *others)
            return list(results[: len(kws)])
        finally:
            await client.close()

    alone = [asyncio.run(run([kw], with_others=False))[0] for kw in probes]
    together = asyncio.run(run(probes, with_others=True))
    assert together == alone
    live_server.wait_idle()
    live_server.engine.check_integrity()
