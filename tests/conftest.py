import os

# Triton kernels run on CPU under the interpreter; set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """Factory: a tiny random HF checkpoint per (arch, overrides), built once per session."""
    from stoker.testing.tiny_checkpoint import make_tiny_checkpoint

    cache: dict[tuple, Path] = {}

    def get(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints("llama")
