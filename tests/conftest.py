import os

# Triton kernels run on CPU under the interpreter; set before triton is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The engine reads the machine's measured rates from the doctor's device file (k chosen by the
# wall, batch defaults): a file someone wrote on this machine must not change what the tests see.
# Tests that want one write their own (monkeypatch.setenv(ENV_VAR, ...)); this path never exists.
os.environ.setdefault("STOKER_DEVICE_FILE", os.path.join(os.devnull, "this-device.yaml"))

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


# --- Every engine a test drives must end whole: DESIGN.md principle 6 ----------------------
# Engines built on the test's own thread are tracked; after each test, any that is idle must
# pass check_integrity() with every KV block back in the free list (a leaked block is a bug).
# Engines stepped by a server thread are checked through the server's own tests instead.
import threading
import weakref

_engines: "weakref.WeakSet" = weakref.WeakSet()  # long-lived (fixture) engines
_new_engines: list = []  # strong refs: engines made by the running test, checked then dropped


@pytest.fixture(autouse=True, scope="session")
def _track_engines():
    from stoker.engine.llm_engine import LLMEngine

    original = LLMEngine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if threading.current_thread() is threading.main_thread():
            _engines.add(self)
            _new_engines.append(self)

    LLMEngine.__init__ = tracking_init
    yield
    LLMEngine.__init__ = original


@pytest.fixture(autouse=True)
def _engines_end_whole():
    yield
    engines = {id(e): e for e in [*_engines, *_new_engines]}
    _new_engines.clear()
    for engine in engines.values():
        if not engine.has_unfinished_requests():
            engine.check_integrity()
            bm = engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
