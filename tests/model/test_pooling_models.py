"""Pooling models vs their references on tiny random checkpoints built here: embeddings vs
sentence-transformers' `encode`, rerank scores vs transformers' classifier, and the runner
choice vLLM makes from a folder."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")

TEXTS = ["hello world", "the cat sat on the mat and it was happy about that", "a",
         "What is the capital of France? Paris is, and it has been for a long time.", "x y z 1 2 3"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from stoker.testing.tiny_pooling import make_bert_embedder, make_cross_encoder, make_decoder_embedder

    root = tmp_path_factory.mktemp("pooling")
    return {
        "bert-mean": make_bert_embedder(root / "bert-mean"),
        "bert-cls": make_bert_embedder(root / "bert-cls", pooling="cls", seed=1),
        "xlm-roberta": make_bert_embedder(root / "xlmr", arch="xlm-roberta", seed=2),
        "qwen3": make_decoder_embedder(root / "qwen3"),
        "cross-encoder": make_cross_encoder(root / "ce"),
    }


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("name", ["bert-mean", "bert-cls", "xlm-roberta", "qwen3"])
def test_embeddings_equal_sentence_transformers(folders: dict[str, Path], name: str) -> None:
    from sentence_transformers import SentenceTransformer

    from stoker.pooling.runner import PoolingRunner, PoolInput

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = SentenceTransformer(str(folders[name]), device="cpu")
    reference = st.encode(TEXTS, batch_size=len(TEXTS))
    runner = PoolingRunner.from_folder(folders[name])
    batch = [PoolInput(st.tokenizer(t)["input_ids"]) for t in TEXTS]
    packed = runner.run(batch)  # (5, hidden): one packed forward, no padding in the GEMMs
    assert packed.shape == reference.shape
    assert _cosines(packed, reference).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(packed, axis=1), 1.0, atol=1e-5)  # the Normalize module
    # packing several sequences together changes nothing about each one
    alone = np.stack([runner.run([x])[0] for x in batch])
    np.testing.assert_allclose(packed, alone, atol=1e-5)


def test_rerank_scores_equal_the_transformers_classifier(folders: dict[str, Path]) -> None:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from stoker.pooling.runner import PoolingRunner, PoolInput

    path = folders["cross-encoder"]
    tok = AutoTokenizer.from_pretrained(str(path))
    pairs = [("what is it", "the dog barked"), ("hello", "a world of cats and dogs, all of them"), ("paris", "france")]
    enc = tok([q for q, _ in pairs], [d for _, d in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = BertForSequenceClassification.from_pretrained(str(path)).eval()(**enc).logits[:, 0]
    expected = torch.sigmoid(logits).numpy()
    assert np.ptp(expected) > 1e-3, "the random classifier must tell the pairs apart for the test to mean anything"
    runner = PoolingRunner.from_folder(path)
    assert runner.config.kind == "classify"
    batch = []
    for q, d in pairs:
        e = tok(q, d)
        batch.append(PoolInput(e["input_ids"], e["token_type_ids"]))
    np.testing.assert_allclose(runner.run(batch), expected, rtol=1e-5, atol=1e-6)


def test_runner_is_chosen_from_the_folder_as_vllm_does(folders: dict[str, Path], tiny_llama: Path,
                                                       tmp_path: Path) -> None:
    from stoker.pooling.config import resolve_runner

    assert resolve_runner(folders["bert-mean"]) == "pooling"  # BertModel
    assert resolve_runner(folders["cross-encoder"]) == "pooling"  # *ForSequenceClassification
    assert resolve_runner(tiny_llama) == "generate"  # *ForCausalLM
    assert resolve_runner(tiny_llama, "pooling") == "pooling"  # --runner overrides
    # Qwen3-Embedding ships Qwen3ForCausalLM: its sentence-transformers modules.json makes it pooling
    causal = tmp_path / "qwen3-causal"
    shutil.copytree(folders["qwen3"], causal)
    cfg = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    assert resolve_runner(causal) == "pooling"
    (causal / "modules.json").unlink()
    assert resolve_runner(causal) == "generate"
    with pytest.raises(ValueError, match="--runner"):
        resolve_runner(causal, "embed")


def test_pooling_config_reads_what_the_folder_declares(folders: dict[str, Path], tmp_path: Path) -> None:
    from stoker.pooling.config import read_pooling_config

    mean = read_pooling_config(folders["bert-mean"])
    assert (mean.kind, mean.pooling, mean.normalize, mean.is_matryoshka) == ("embed", "mean", True, False)
    assert mean.max_model_len == 128
    assert read_pooling_config(folders["qwen3"]).pooling == "last"
    assert read_pooling_config(folders["bert-mean"], max_model_len=64).max_model_len == 64
    with pytest.raises(ValueError, match="longer than the model's"):
        read_pooling_config(folders["bert-mean"], max_model_len=4096)
    mrl = tmp_path / "mrl"
    shutil.copytree(folders["bert-mean"], mrl)
    cfg = json.loads((mrl / "config.json").read_text())
    (mrl / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32]}))
    declared = read_pooling_config(mrl)
    assert declared.is_matryoshka and declared.matryoshka_dimensions == (16, 32)
    # the old sentence-transformers pooling config (booleans) reads the same
    (mrl / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                "pooling_mode_cls_token": True}))
    assert read_pooling_config(mrl).pooling == "cls"
    (mrl / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="not supported"):
        read_pooling_config(mrl)
