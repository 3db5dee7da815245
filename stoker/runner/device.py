"""Where a runner computes and in which dtype: one rule for the generative runner, the pooling
runner and `stoker finetune`, decided once when the runner is built."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str, local_rank: int = 0, tp_size: int = 1) -> torch.device:
    """"auto": CUDA when a GPU is visible, else the CPU. With tensor parallelism, rank r's GPU is
    LOCAL_RANK of its node; a bare "cuda" is the current GPU, by index. A CUDA device asked for
    where none is visible is refused."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available; use device='cpu' or 'auto'")
    if device.startswith("cuda") and tp_size > 1:
        if device != "cuda":
            raise ValueError(f"device {device!r} names one GPU, but tensor parallelism puts rank r on GPU LOCAL_RANK: "
                             "pass device 'cuda' (choose the GPUs with CUDA_VISIBLE_DEVICES)")
        return torch.device("cuda", local_rank)
    if device == "cuda":
        # Always an index: torch.cuda.set_device and the graph pools want one, and torch before
        # 2.13 refuses a bare torch.device("cuda") in set_device.
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU; bfloat16 on CUDA, float16 where bf16 is unsupported."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]
