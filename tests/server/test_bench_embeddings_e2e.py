"""End to end: `stoker bench serve --endpoint embeddings` against a real embedding server
(a tiny random BERT embedder behind uvicorn, started as test_embeddings_server.py does):
counts add up, every request succeeds, inputs and tokens match what was sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("stoker.server.app")

from stoker.cli import main

EMB = "tiny-embed"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:

    from stoker.server.app import create_app
    from stoker.pooling.batcher import BatcherConfig
    from stoker.server.pooling.models import PoolingModels, PoolingModelSpec
    from stoker.server.state import ServerSettings
    from stoker.testing.tiny_pooling import make_bert_embedder
    from tests.server.conftest import serve_app

    folder = make_bert_embedder(tmp_path_factory.mktemp("bench-emb") / "emb")
    batcher = BatcherConfig(max_batch_size=8, max_queue_delay_microseconds=5_000)
    spec = PoolingModelSpec(str(folder), (EMB,), batcher)
    settings = ServerSettings(model_path=spec.path, served_model_names=spec.names, log_interval_s=3600)
    app = create_app(settings, None, pooling=PoolingModels([spec]))
    live = serve_app(app, ready_path="/health")
    yield live.url, folder
    live.stop()


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_bench_embeddings_against_a_real_server(server: tuple[str, Path], kind: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    url, folder = server
    out = tmp_path / "run.json"
    rc = main(["bench", "serve", "--base-url", url, "--endpoint", "embeddings" if kind == "text" else "/v1/embeddings",
               "--num-prompts", "12", "--random-input-len", "10", "--embedding-input", kind,
               "--embedding-inputs-per-request", "2", "--tokenizer", str(folder), "--max-concurrency", "4",
               "--request-timeout", "60", "--disable-tqdm", "--save-result", str(out)])
    d = json.loads(out.read_text())
    assert rc == 0, d["errors"]
    assert d["backend"] == "openai-embeddings" and d["endpoint"] == "/v1/embeddings" and d["model_id"] == EMB
    assert d["completed"] + d["failed"] == d["num_prompts"] == 12
    assert d["failed"] == 0 and d["failures"] == {}, d["errors"]
    assert d["total_inputs"] == 24 and d["num_inputs"] == [2] * 12
    assert d["input_tokens_source"] == "usage"
    assert d["total_input_tokens"] == sum(d["input_lens"]) > 0
    assert d["request_throughput"] == pytest.approx(12 / d["duration"])
    assert d["input_throughput"] == pytest.approx(24 / d["duration"])
    assert all(e is not None and e > 0 for e in d["e2els"])
    assert 0 < d["median_e2el_ms"] <= d["p99_e2el_ms"]
    assert d["max_concurrent_requests"] <= 4
    assert "mean_ttft_ms" not in d
    b = d["server_batch_sizes"]  # the server's distribution when it exports one, else why not
    assert b["available"] or b["why"]
    if b["available"]:
        assert b["batches"] >= 1 and sum(b["batch_size_le"].values()) == b["batches"]
    printed = capsys.readouterr().out
    assert "Embedding Benchmark Result" in printed and "Input throughput (inputs/s):" in printed
