"""/v1/embeddings, /v1/rerank and /v1/score on a real uvicorn server holding pooling models,
driven by the official `openai` client and httpx: results equal the references, the batcher
batches concurrent requests without cross-talk, and the limits answer as vLLM's do."""

from __future__ import annotations

import base64
import json
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("sentence_transformers")

EMB, RERANK = "tiny-embed", "tiny-rerank"


def _start(specs: list[Any]) -> Any:
    from stoker.server.app import create_app
    from stoker.server.pooling.models import PoolingModels
    from stoker.server.state import ServerSettings

    from tests.server.conftest import serve_app

    settings = ServerSettings(model_path=specs[0].path, served_model_names=specs[0].names, log_interval_s=3600)
    return serve_app(create_app(settings, None, pooling=PoolingModels(specs)), ready_path="/health")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from stoker.testing.tiny_pooling import make_bert_embedder, make_cross_encoder

    root = tmp_path_factory.mktemp("pooling-server")
    emb = make_bert_embedder(root / "emb")
    mrl = root / "mrl"
    shutil.copytree(emb, mrl)
    cfg = json.loads((mrl / "config.json").read_text())
    (mrl / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    return {"emb": emb, "mrl": mrl, "ce": make_cross_encoder(root / "ce")}


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]):
    from stoker.pooling.batcher import BatcherConfig
    from stoker.server.pooling.models import PoolingModelSpec

    batcher = BatcherConfig(max_batch_size=8, max_queue_delay_microseconds=20_000, priority_levels=2,
                            default_priority_level=2)
    live = _start([PoolingModelSpec(str(folders["emb"]), (EMB,), batcher),
                   PoolingModelSpec(str(folders["ce"]), (RERANK,), batcher),
                   PoolingModelSpec(str(folders["mrl"]), ("tiny-mrl",), batcher)])
    yield live.url, live.app
    live.stop()


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> Any:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(folders["emb"]), device="cpu")


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))


def test_openai_client_embeddings_equal_sentence_transformers(server, reference) -> None:
    from openai import OpenAI

    url, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts = ["hello world", "the cat sat on the mat", "a"]
    out = client.embeddings.create(model=EMB, input=texts, encoding_format="float")
    expected = reference.encode(texts)
    assert [d.index for d in out.data] == [0, 1, 2]
    for d, e in zip(out.data, expected):
        assert _cos(np.array(d.embedding), e) >= 0.9999
    ids = [reference.tokenizer(t)["input_ids"] for t in texts]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    # the client's default is base64 (float32 little-endian), decoded by the client
    b64 = client.embeddings.create(model=EMB, input="hello world")
    assert _cos(np.array(b64.data[0].embedding), expected[0]) >= 0.9999
    raw = httpx.post(url + "/v1/embeddings", json={"input": ids[1], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert _cos(vec, expected[1]) >= 0.9999  # token-id input, same vector


def test_concurrent_requests_are_batched_and_each_gets_its_own_result(server) -> None:
    url, app = server
    texts = [f"request {i} " + "word " * (i % 7) for i in range(32)]
    with httpx.Client(timeout=60) as c:
        alone = [np.array(c.post(url + "/v1/embeddings", json={"model": EMB, "input": t}).json()["data"][0]["embedding"])
                 for t in texts[:8]]
    model = next(m for m in app.state.stoker.pooling.models if EMB in m.names)
    model.recent_batches.clear()
    before = _samples(url)

    def one(t: str) -> np.ndarray:
        with httpx.Client(timeout=60) as c:
            r = c.post(url + "/v1/embeddings", json={"model": EMB, "input": t})
            assert r.status_code == 200, r.text
            return np.array(r.json()["data"][0]["embedding"])

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, texts))
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, atol=1e-5)  # no cross-talk inside a packed batch
    sizes = [r.size for r in model.recent_batches]
    assert sum(sizes) == 32 and max(sizes) <= 8
    assert max(sizes) > 1, f"concurrent requests were never batched: {sizes}"
    # the same batches in /metrics, per model
    after = _samples(url)
    lbl = f'{{model_name="{EMB}"}}'

    def delta(name: str) -> float:
        return after.get(name + lbl, 0.0) - before.get(name + lbl, 0.0)

    assert delta("stoker:pooling_batch_size_count") == len(sizes) and delta("stoker:pooling_batch_size_sum") == 32
    assert delta("stoker:pooling_inputs_total") == 32 and delta("stoker:pooling_queue_time_seconds_count") == len(sizes)
    ok = f'stoker:pooling_requests_total{{model_name="{EMB}",outcome="ok"}}'
    assert after[ok] - before.get(ok, 0.0) == 32


def _samples(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_rerank_and_score(server) -> None:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    url, app = server
    path = next(m for m in app.state.stoker.pooling.models if RERANK in m.names).spec.path
    tok = AutoTokenizer.from_pretrained(path)
    docs = ["the dog barked", "paris is in france", "a cat", "numbers 1 2 3"]
    enc = tok(["where is paris"] * 4, docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(BertForSequenceClassification.from_pretrained(path).eval()(**enc).logits[:, 0]).numpy()
    r = httpx.post(url + "/v1/rerank", json={"model": RERANK, "query": "where is paris", "documents": docs, "top_n": 3},
                   timeout=60).json()
    order = list(np.argsort(-expected)[:3])
    assert [x["index"] for x in r["results"]] == order
    for x in r["results"]:
        assert x["relevance_score"] == pytest.approx(float(expected[x["index"]]), rel=1e-5)
        assert x["document"]["text"] == docs[x["index"]]
    bare = httpx.post(url + "/v1/rerank", json={"model": RERANK, "query": "q", "documents": [{"text": "d"}],
                                               "return_documents": False}, timeout=60).json()
    assert "document" not in bare["results"][0]
    s = httpx.post(url + "/v1/score", json={"model": RERANK, "text_1": "where is paris", "text_2": docs}, timeout=60).json()
    assert [d["score"] for d in s["data"]] == pytest.approx(expected.tolist(), rel=1e-5)
    # an embedding model scores by cosine similarity, as vLLM's
    s = httpx.post(url + "/v1/score", json={"model": EMB, "text_1": ["a b", "c"], "text_2": ["a b", "d"]}, timeout=60).json()
    assert s["data"][0]["score"] == pytest.approx(1.0, abs=1e-5) and s["data"][1]["score"] < 0.9999


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_limits_and_refusals(server) -> None:
    url, _ = server
    post = lambda path, body: httpx.post(url + path, json=body, timeout=60)  # noqa: E731
    long_text = "word " * 300
    assert "maximum context length is 128" in _error(post("/v1/embeddings", {"model": EMB, "input": long_text}), 400, "input")
    ok = post("/v1/embeddings", {"model": EMB, "input": long_text, "truncate_prompt_tokens": 16}).json()
    assert ok["usage"]["prompt_tokens"] == 16
    assert post("/v1/embeddings", {"model": EMB, "input": long_text, "truncate_prompt_tokens": -1}).json()["usage"]["prompt_tokens"] == 128
    _error(post("/v1/embeddings", {"model": EMB, "input": "x", "truncate_prompt_tokens": 1000}), 400, "truncate_prompt_tokens")
    assert "does not support matryoshka" in _error(post("/v1/embeddings", {"model": EMB, "input": "x", "dimensions": 16}), 400, "dimensions")
    _error(post("/v1/embeddings", {"model": "tiny-mrl", "input": "x", "dimensions": 20}), 400, "dimensions")
    full = np.array(post("/v1/embeddings", {"model": "tiny-mrl", "input": "hello"}).json()["data"][0]["embedding"])
    cut = np.array(post("/v1/embeddings", {"model": "tiny-mrl", "input": "hello", "dimensions": 16}).json()["data"][0]["embedding"])
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)  # truncate, then renormalize
    _error(post("/v1/embeddings", {"model": EMB, "input": "x", "encoding_format": "int8"}), 400, "encoding_format")
    _error(post("/v1/embeddings", {"model": EMB, "input": [5, 10**6]}), 400, "input")
    _error(post("/v1/embeddings", {"model": EMB, "input": "x", "priority": 3}), 400, "priority")
    _error(post("/v1/embeddings", {"model": EMB, "input": "x", "dimensions": "8"}), 400, "dimensions")  # strict numbers
    for field, value in (("additional_data", {"k": 1}), ("mm_processor_kwargs", {"a": 1}), ("normalize", True)):
        _error(post("/v1/embeddings", {"model": EMB, "input": "x", field: value}), 400, field)  # vLLM's, not honoured
    assert post("/v1/embeddings", {"model": EMB, "input": "x", "request_id": "q7"}).json()["id"] == "embd-q7"
    _error(post("/v1/embeddings", {"model": EMB, "messages": [{"role": "user", "content": "x"}], "input": "x"}), 400, "messages")
    _error(post("/v1/embeddings", {"model": "nope", "input": "x"}), 404, "model")
    _error(post("/v1/embeddings", {"model": RERANK, "input": "x"}), 400, "model")
    # a generation request to a pooling server: vLLM's 400 naming the API
    assert "does not support Chat Completions" in _error(
        post("/v1/chat/completions", {"model": EMB, "messages": [{"role": "user", "content": "hi"}]}), 400, "model")
    assert "does not support Completions" in _error(post("/v1/completions", {"model": EMB, "prompt": "hi"}), 400, "model")
    names = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert names == [EMB, RERANK, "tiny-mrl"]
    assert httpx.get(url + "/v1/health/ready").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


def _rejected_400(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("stoker:requests_rejected_total{") and 'status="400"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_bodies_the_pooling_fast_path_hands_on(server) -> None:
    """The pooling endpoints are answered before FastAPI's routing (server/pooling/asgi.py); what that
    path does not take reaches FastAPI with its body intact and gets FastAPI's answer."""
    url, _ = server
    post = lambda body, **kw: httpx.post(url + "/v1/embeddings", content=body, timeout=60, **kw)  # noqa: E731
    ok = json.dumps({"model": EMB, "input": "hello"}).encode()
    before = _rejected_400(url)
    assert "input" in _error(post(b'{"model": "tiny-embed"}', headers={"content-type": "application/json"}), 400, "input")
    assert _rejected_400(url) == before + 1  # refusals on the fast path are counted like FastAPI's
    # handed on: malformed JSON, a JSON array, an empty body, a body that is not JSON by its type
    assert _error(post(b'{"input": ', headers={"content-type": "application/json"}), 400, None).startswith("malformed JSON")
    _error(post(b'["hello"]', headers={"content-type": "application/json"}), 400, None)
    _error(post(b"", headers={"content-type": "application/json"}), 400, None)
    _error(post(ok, headers={"content-type": "text/plain"}), 400, None)
    # taken: JSON by any of FastAPI's rules, in one piece or in chunks
    for headers in ({"content-type": "application/json; charset=utf-8"}, {"content-type": "application/vnd.api+json"}):
        assert post(ok, headers=headers).json()["data"][0]["object"] == "embedding"
    chunked = post(iter([ok[:7], ok[7:20], ok[20:]]), headers={"content-type": "application/json"})
    assert chunked.status_code == 200 and chunked.json()["usage"]["prompt_tokens"] > 0
    # other methods on the path are FastAPI's
    assert httpx.get(url + "/v1/embeddings").status_code == 405


def test_a_full_queue_answers_503_with_retry_after(folders: dict[str, Path]) -> None:
    from stoker.pooling.batcher import BatcherConfig
    from stoker.server.pooling.models import PoolingModelSpec

    # a 2-input queue whose batches wait 4 s for company: the first request fills it, and the
    # second is sent once the batcher holds the first (a fixed sleep lost the race on a loaded
    # machine: the second arrived first and was taken)
    batcher = BatcherConfig(max_batch_size=8, max_queue_delay_microseconds=4_000_000, max_queue_size=2)
    live = _start([PoolingModelSpec(str(folders["emb"]), (EMB,), batcher)])
    url = live.url
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, url + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=60)
            queue = live.app.state.stoker.pooling.models[0].batcher
            deadline = time.monotonic() + 15
            while queue.num_queued < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert queue.num_queued == 2, "the first request never reached the batcher's queue"
            busy = httpx.post(url + "/v1/embeddings", json={"input": "c"}, timeout=60)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
            assert first.result().status_code == 200
        assert httpx.post(url + "/v1/embeddings", json={"input": "c"}, timeout=60).status_code == 200
    finally:
        live.stop()
