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
