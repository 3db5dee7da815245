"""One rule for where and in which dtype every runner computes (generative, pooling, finetune)."""

import pytest
import torch

from stoker.runner.device import resolve_device, resolve_dtype


def test_auto_is_the_cpu_in_float32_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_dtypes_are_named_and_others_refused() -> None:
    cpu = torch.device("cpu")
    assert [resolve_dtype(d, cpu) for d in ("float32", "float16", "bfloat16")] == [torch.float32, torch.float16, torch.bfloat16]
    with pytest.raises(ValueError, match="dtype must be auto or one of float32, float16, bfloat16, got 'float64'"):
        resolve_dtype("float64", cpu)


def test_the_pooling_runner_takes_the_same_rule() -> None:
    from stoker.pooling import runner

    assert runner.resolve_device is resolve_device and runner.resolve_dtype is resolve_dtype


def test_a_bare_cuda_is_the_current_gpu_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.11's torch.cuda.set_device refuses torch.device("cuda") (no index): every engine
    # on a GPU failed to start with it. Resolution gives the index once, where the device is made.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=2, tp_size=4) == torch.device("cuda", 2)
