"""LoRA through the server (vLLM's flags and endpoints), driven by the official openai client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import NotFoundError, OpenAI

from tests.model.test_lora import ATTN, MLP, make_adapter, peft_greedy
from tests.server.conftest import MODEL, start_server

PROMPT = [1, 17, 300, 42, 7, 99, 5]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(tiny_llama, root / "a", ATTN + MLP, 8, seed=21),
            "b": make_adapter(tiny_llama, root / "b", ATTN, 16, seed=22)}


@pytest.fixture(scope="module")
def lora_server(tiny_llama: Path, adapters):
    live = start_server(tiny_llama, {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16},
                        lora_modules=(("a", str(adapters["a"])),), allow_runtime_lora_updates=True)
    yield live
    live.stop()


def _same_text(got: str, ids: list[int], tok) -> bool:
    """The server's text is the tokens' text (special tokens skipped), but for an incomplete
    UTF-8 character at the end, which the incremental detokenizer holds back."""
    want = tok.decode(ids, skip_special_tokens=True)
    return want.startswith(got) and len(want.rstrip("\ufffd")) <= len(got)


def _text(client: OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_an_adapter_is_a_model(lora_server, tiny_llama: Path, adapters) -> None:
    client = OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    models = {m.id: m for m in client.models.list().data}
    assert models["a"].model_extra["parent"] == MODEL and models["a"].model_extra["root"] == str(adapters["a"])
    tok = lora_server.state.tokenizer
    assert _same_text(_text(client, "a"), peft_greedy(tiny_llama, adapters["a"], PROMPT, 8), tok)
    assert _text(client, MODEL) != _text(client, "a")
    with pytest.raises(NotFoundError):
        _text(client, "nope")
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "a"
    info = [k for k in lora_server.metrics() if k.startswith("vllm:lora_requests_info{")]
    assert info and 'max_lora="2"' in info[0]


def test_load_and_unload_while_serving(lora_server, tiny_llama: Path, adapters) -> None:
    client = OpenAI(base_url=lora_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    url = lora_server.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])}, timeout=60)
    assert r.status_code == 200 and "added" in r.text
    assert "b" in {m.id for m in client.models.list().data}
    assert _same_text(_text(client, "b"), peft_greedy(tiny_llama, adapters["b"], PROMPT, 8), lora_server.state.tokenizer)
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    with pytest.raises(NotFoundError):
        _text(client, "b")
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
    lora_server.wait_idle()
    lora_server.engine.check_integrity()


def test_runtime_updates_are_off_unless_allowed(live_server) -> None:
    r = httpx.post(live_server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 404 and "--allow-runtime-lora-updates" in r.json()["error"]["message"]
