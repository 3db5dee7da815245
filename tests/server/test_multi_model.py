"""`stoker serve --config models.yaml` (issue 18 part 4): one server holding a chat model and an
embedding model, built by the real CLI path and driven by the official `openai` client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytest.importorskip("sentence_transformers")


def _args(*argv: str):
    from stoker.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint
    from stoker.testing.tiny_pooling import make_bert_embedder

    root = tmp_path_factory.mktemp("multi-model")
    return {"chat": make_tiny_checkpoint(root / "chat"), "emb": make_bert_embedder(root / "emb"), "root": root}


def _write(root: Path, text: str, name: str = "models.yaml") -> Path:
    path = root / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]):

    from stoker.server.cli import build_app

    from tests.server.conftest import serve_app

    cfg = _write(folders["root"], f"""
generate:
  path: {folders['chat']}
  served_model_name: [tiny-chat]
  max_model_len: 128
  max_num_seqs: 4
  kv_cache_memory_bytes: 4000000
pooling:
  - path: {folders['emb'].relative_to(folders['root'])}   # relative to this file
    served_model_name: tiny-embed
    max_batch_size: 4
    max_queue_delay_microseconds: 1000
""")
    app, _ = build_app(_args("--config", str(cfg), "--log-interval", "3600"))
    live = serve_app(app)
    yield live.url, app
    live.stop()


def test_both_models_answer_through_openai(server) -> None:
    from openai import OpenAI

    url, app = server
    st = app.state.stoker
    assert st.ready and st.pooling.ready  # /v1/health/ready waited for both
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny-chat", "tiny-embed"]
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0)
    assert chat.model == "tiny-chat" and chat.usage.completion_tokens >= 1
    emb = client.embeddings.create(model="tiny-embed", input=["a furnace", "a stoker"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 64


def test_stoker_serve_config_as_a_process(folders: dict[str, Path], tmp_path: Path) -> None:
    """The command a user runs, in a fresh interpreter: the chat model and the embedding model load
    on two threads at once (in this pytest process transformers is already imported, which hid
    a race in its lazy imports that stopped this start-up)."""
    from tests.server.conftest import start_serve_process, stop_process

    cfg = _write(tmp_path, f"generate:\n  path: {folders['chat']}\n  served_model_name: chat\n  max_model_len: 128\n"
                           f"  kv_cache_memory_bytes: 4000000\npooling:\n  - path: {folders['emb']}\n    served_model_name: emb\n")
    log_path = tmp_path / "server.log"
    proc, url = start_serve_process(["--config", str(cfg)], log_path)
    try:
        r = httpx.post(url + "/v1/embeddings", json={"model": "emb", "input": "a stoker"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64, r.text
        r = httpx.post(url + "/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        stop_process(proc)
    assert "Traceback" not in log_path.read_text()


def test_a_request_to_the_other_kind_of_model_is_a_400(server) -> None:
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-embed", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = httpx.post(url + "/v1/embeddings", json={"model": "tiny-chat", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "does not support Embeddings API" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404


@pytest.mark.parametrize("body, words", [
    ("pooling:\n  - path: {emb}\n    max_batch_sise: 4\n", ["pooling[0]", "max_batch_sise", "unknown key"]),
    ("pooling:\n  - path: {emb}\n    served_model_name: e\n    max_batch_size: many\n", ["'e'", "max_batch_size", "integer"]),
    ("generate:\n  path: {chat}\n  served_model_name: c\n  dtype: float64\n", ["generate", "'c'", "dtype"]),
    ("generate:\n  path: {emb}\n", ["generate", "pooling model"]),
    ("pooling:\n  - path: {emb}\n    served_model_name: x\n  - path: {emb}\n    served_model_name: x\n", ["'x'", "two models"]),
    ("models: []\n", ["unknown key", "models"]),
    ("pooling:\n  - path: {emb}\n    served_model_name: e\n    instance_count: 0\n", ["'e'", "--instance-count", ">= 1"]),
])
def test_a_bad_config_is_refused_naming_the_key(folders: dict[str, Path], body: str, words: list[str]) -> None:
    from stoker.server.repository.model_config import ConfigError, load_serve_config

    cfg = _write(folders["root"], body.format(emb=folders["emb"], chat=folders["chat"]), "bad.yaml")
    with pytest.raises(ConfigError) as err:
        load_serve_config(cfg)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_config_with_model_dir_or_per_model_flags_is_refused(folders: dict[str, Path]) -> None:
    from stoker.server.cli import build_app

    cfg = _write(folders["root"], f"pooling:\n  - path: {folders['emb']}\n", "ok.yaml")
    with pytest.raises(ValueError, match="MODEL_DIR"):
        build_app(_args(str(folders["chat"]), "--config", str(cfg)))
    with pytest.raises(ValueError, match="--max-batch-size, --max-model-len"):
        build_app(_args("--config", str(cfg), "--max-model-len", "64", "--max-batch-size", "2"))


def test_batcher_flags_on_a_generative_model_are_refused_naming_them(folders: dict[str, Path]) -> None:
    from stoker.server.cli import build_app

    with pytest.raises(ValueError, match="--instance-count, --max-batch-size: dynamic-batcher flags"):
        build_app(_args(str(folders["chat"]), "--max-batch-size", "8", "--instance-count", "2"))
    with pytest.raises(ValueError, match="--max-queue-delay-microseconds"):
        build_app(_args("--max-queue-delay-microseconds", "100"))  # the demo model


@pytest.fixture(scope="module")
def repository(folders: dict[str, Path]) -> Path:
    """Triton's layout: one folder per model, named as served; `emb` in version folders (2 is
    served), `rr` with its settings in serve.yaml."""
    import shutil

    from stoker.testing.tiny_pooling import make_cross_encoder

    repo = folders["root"] / "repository"
    shutil.copytree(folders["chat"], repo / "chat")
    shutil.copytree(folders["emb"], repo / "emb" / "1")
    shutil.copytree(folders["emb"], repo / "emb" / "2")
    make_cross_encoder(repo / "rr")
    (repo / "rr" / "serve.yaml").write_text("served_model_name: [reranker, rr]\nmax_batch_size: 4\npriority_levels: 2\n")
    (repo / ".cache").mkdir()  # hidden folders are not models
    return repo


def test_a_model_repository_folder(repository: Path) -> None:
    from stoker.server.repository.model_config import load_serve_config

    cfg = load_serve_config(repository)
    assert cfg.generate is not None and cfg.generate.names == ("chat",)
    assert Path(cfg.generate.path) == repository / "chat"
    by_name = {s.names[0]: s for s in cfg.pooling}
    assert sorted(by_name) == ["emb", "reranker"] and by_name["reranker"].names == ("reranker", "rr")
    assert Path(by_name["emb"].path) == repository / "emb" / "2", "the highest version is served"
    assert by_name["reranker"].batcher.max_batch_size == 4 and by_name["reranker"].batcher.priority_levels == 2
    assert by_name["emb"].batcher.max_batch_size == 32  # no serve.yaml: the flags' defaults


def test_a_server_from_a_model_repository(repository: Path) -> None:
    from stoker.server.cli import build_app

    from tests.server.conftest import serve_app

    app, _ = build_app(_args("--config", str(repository), "--log-interval", "3600", "--max-waiting-requests", "8"))
    live = serve_app(app)
    try:
        assert [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]] == ["chat", "emb", "reranker", "rr"]
        r = httpx.post(live.url + "/v1/rerank", json={"model": "rr", "query": "a", "documents": ["b", "c"]}, timeout=60)
        assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text
        r = httpx.post(live.url + "/v1/embeddings", json={"model": "emb", "input": "x"}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        live.stop()


@pytest.mark.parametrize("layout, words", [
    ({"a/1/x.txt": ""}, ["a:", "no config.json", "version folder"]),
    ({}, ["no model folder"]),
    ({"emb/serve.yaml": "path: /elsewhere\n"}, ["emb/serve.yaml", "path", "its folder"]),
    ({"emb/serve.yaml": "max_batch_sise: 4\n"}, ["'emb'", "max_batch_sise", "unknown key", "takes: served_model_name"]),
    ({"emb/serve.yaml": "- 1\n"}, ["emb/serve.yaml", "must be a mapping"]),
    ({"emb/serve.yaml": "runner: embed\n"}, ["emb/serve.yaml", "runner"]),
    ({"emb/serve.yaml": "runner: 5\n"}, ["emb/serve.yaml", "runner", "got '5'"]),
    ({"c2/": "chat"}, ["2 generative models", "c2, chat"]),
])
def test_a_bad_repository_is_refused_naming_the_folder(folders: dict[str, Path], tmp_path: Path,
                                                        layout: dict[str, str], words: list[str]) -> None:
    import shutil

    from stoker.server.repository.model_config import ConfigError, load_serve_config

    repo = tmp_path / "repo"
    repo.mkdir()
    if layout:  # every case but the empty one holds the two good models
        shutil.copytree(folders["chat"], repo / "chat")
        shutil.copytree(folders["emb"], repo / "emb")
    for rel, text in layout.items():
        if rel.endswith("/"):
            shutil.copytree(folders[text], repo / rel)
        else:
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
    with pytest.raises(ConfigError) as err:
        load_serve_config(repo)
    for word in words:
        assert word in str(err.value), str(err.value)
