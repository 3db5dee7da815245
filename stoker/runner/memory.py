"""How many KV blocks fit: measured, returned, never written into the config.

CPU: a byte budget (`kv_cache_memory_bytes`, default 1 GiB).
CUDA (vLLM's rule, facts.md): total * gpu_memory_utilization - weights - activation peak
(profiled by a forward of `max_num_batched_tokens` dummy tokens) - non-torch memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from stoker.config import DEFAULT_CPU_KV_CACHE_BYTES

logger = logging.getLogger(__name__)


def cpu_num_blocks(bytes_per_block: int, kv_cache_memory_bytes: int | None) -> int:
    budget = kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    return budget // bytes_per_block


def cuda_num_blocks(
    device: torch.device,
    bytes_per_block: int,
    gpu_memory_utilization: float,
    profile_forward: Callable[[], None],
    kv_cache_memory_bytes: int | None = None,
) -> int:
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes // bytes_per_block
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    profile_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    # Memory used outside torch's allocator (CUDA context, NCCL, other processes).
    non_torch = (total - free_after) - torch.cuda.memory_reserved(device)
    activation_peak = peak - weights
    budget = int(total * gpu_memory_utilization) - weights - activation_peak - max(non_torch, 0)
    logger.info(
        "GPU memory: total %.1f GiB x %.2f, weights %.2f GiB, activation peak %.2f GiB, non-torch %.2f GiB -> KV %.2f GiB",
        total / 2**30, gpu_memory_utilization, weights / 2**30, activation_peak / 2**30, non_torch / 2**30, budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            "no GPU memory left for the KV cache after weights and activations; raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, or use a smaller model"
        )
    del free_before
    return budget // bytes_per_block
