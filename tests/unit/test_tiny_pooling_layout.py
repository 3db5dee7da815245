"""stoker/testing/tiny_pooling.py without sentence-transformers (a bare GPU machine): the folder it
writes by hand has the library's layout, and Stoker reads and embeds it exactly as the library's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sentence_transformers")

FILES = ("modules.json", "1_Pooling/config.json", "2_Normalize/config.json")


def test_layout_without_the_library_is_the_library_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.pooling.config import read_pooling_config
    from stoker.pooling.runner import PoolingRunner, PoolInput
    from stoker.testing.tiny_pooling import make_bert_embedder

    by_library = make_bert_embedder(tmp_path / "lib")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "sentence_transformers", None)  # `import sentence_transformers` raises ImportError
        by_hand = make_bert_embedder(tmp_path / "hand")
    assert not (by_hand / "README.md").exists()  # written by hand: the library writes a model card
    for name in FILES:
        assert json.loads((by_hand / name).read_text()) == json.loads((by_library / name).read_text()), name
    assert read_pooling_config(by_hand) == read_pooling_config(by_library)
    ids = [[2, 40, 41, 3], [2, 50, 3]]
    vectors = [PoolingRunner.from_folder(d, device="cpu").run([PoolInput(x) for x in ids]) for d in (by_library, by_hand)]
    np.testing.assert_array_equal(vectors[0], vectors[1])
