"""A pooling model's instances (pooling/instances.py): how many, and each thread's OpenMP count
set on that thread only (torch and the C kernels read the calling thread's)."""

from __future__ import annotations

import threading

import pytest
import torch

from stoker.pooling.instances import instance_executor, resolve_instance_count, threads_per_instance
from stoker.server.pooling.models import PoolingModelSpec


def test_instance_count_by_device_and_as_asked() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_instance_count(None, cpu, 2) == 2
    assert resolve_instance_count(None, cpu, 16) == 2
    assert resolve_instance_count(None, cpu, 1) == 1
    assert resolve_instance_count(None, gpu, 16) == 1
    assert resolve_instance_count(3, cpu, 2) == 3
    with pytest.raises(ValueError, match="--instance-count must be >= 1"):
        PoolingModelSpec("unused", ("m",), instance_count=0)
    assert [threads_per_instance(n, 8) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]


def test_each_instance_thread_runs_its_own_count_and_the_process_default_is_kept() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with instance_executor(2, 1) as pool:
            barrier = threading.Barrier(2, timeout=5)

            def count() -> int:
                barrier.wait()  # both instance threads exist (and ran their initializer)
                return torch.get_num_threads()

            assert [f.result() for f in [pool.submit(count), pool.submit(count)]] == [1, 1]
        assert torch.get_num_threads() == 2  # this thread: untouched
        seen: list[int] = []
        fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        fresh.start()
        fresh.join()
        assert seen == [2]  # a thread starting now (a chat engine's) gets the machine's count
    finally:
        torch.set_num_threads(before)
