"""The server's OpenAI-client tests again, against a server whose engine runs at
tensor_parallel_size 2 (this process is rank 0; one worker process): behaviour unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import test_server_openai
from tests.server.conftest import LiveServer, start_server

# Every test of the OpenAI-client module, collected again here with this module's server.
globals().update({name: fn for name, fn in vars(test_server_openai).items() if name.startswith("test_")})


@pytest.fixture(scope="module")
def live_server(tiny_llama: Path) -> Iterator[LiveServer]:
    live = start_server(tiny_llama, {"tensor_parallel_size": 2, "device": "cpu"})
    assert live.engine.executor.driver_runner.tp.world_size == 2
    yield live
    live.stop()
    import torch.distributed

    assert not torch.distributed.is_initialized()  # the server's shutdown left the group and stopped the worker
