"""The host KV tier's storage on one rank: host-memory copies of KV blocks, and the copies to and from it.

The bookkeeping (which block is in which slot, LRU, chain verification) is the engine's,
core/host_kv_pool.py; the step message names the copies (`StepMessage.kv_host_saves`,
`kv_host_loads`) and every tensor-parallel rank runs them on its own shard (its KV heads).
Per attention layer the host holds K and V shaped like the device cache,
(num_host_blocks, block_size, num_kv_heads, head_dim), in the cache's element type (FP8 too);
V is empty for a latent (MLA) cache. On CUDA the host tensors are pinned, so the copies are
DMA transfers. Copies move raw bytes (a uint8 view), so a block comes back bit-identical,
whatever its element type.
"""

from __future__ import annotations

import logging
import os

import torch

from stoker.config import EngineConfig, KVCacheSpec
from stoker.core.host_kv_pool import num_host_blocks

logger = logging.getLogger(__name__)


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """(N, block_size, Hkv, D) of any element type -> (N, block_size, Hkv, D * itemsize) uint8, same memory."""
    return t.view(torch.uint8)


def _runs(pairs: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """(source, destination) pairs as (first source, first destination, length) runs of
    consecutive blocks on both sides (free blocks and free slots are mostly handed out in order)."""
    runs: list[list[int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


class HostKVCache:
    def __init__(self, num_blocks: int, block_size: int, spec: KVCacheSpec, num_layers: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        per_block = spec.bytes_per_token * block_size
        ram = physical_memory_bytes()
        if ram is not None and num_blocks * per_block > ram:
            raise ValueError(f"the host KV tier ({num_blocks} blocks, {num_blocks * per_block / 2**30:.2f} GiB on this "
                             f"rank) is larger than this machine's memory ({ram / 2**30:.2f} GiB): lower "
                             "--kv-offloading-size")
        pin = device.type == "cuda"  # pinned host memory: asynchronous-capable DMA copies
        self.num_blocks = num_blocks
        self.device = device
        # Empty, not zeros: a slot is read only after a save wrote it (the pool never hands out an unwritten one)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(num_layers):
            k = torch.empty(shape, dtype=dtype, pin_memory=pin)
            v = torch.empty(shape if spec.kv_tensors == 2 else 0, dtype=dtype, pin_memory=pin)
            self.caches.append((k, v))

    def _check(self, what: str, pairs: tuple[tuple[int, int], ...], num_device_blocks: int, host_first: bool) -> None:
        for a, b in pairs:
            slot, block = (a, b) if host_first else (b, a)
            if not (0 <= slot < self.num_blocks and 0 <= block < num_device_blocks):
                raise ValueError(f"{what} {list(pairs)} name a host slot outside [0, {self.num_blocks}) or a device "
                                 f"block outside [0, {num_device_blocks})")

    def save(self, device_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: tuple[tuple[int, int], ...]) -> None:
        """(device block, host slot) pairs: device -> host, in every layer's K and V, before the
        forward that overwrites the device blocks (on the compute stream: the forward runs after)."""
        self._check("kv_host_saves", pairs, device_caches[0][0].shape[0], host_first=False)
        for (dk, dv), (hk, hv) in zip(device_caches, self.caches):
            self._copy(dk, hk, pairs)
            if hv.numel():  # empty for a latent (MLA) cache
                self._copy(dv, hv, pairs)

    def load(self, device_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: tuple[tuple[int, int], ...]) -> None:
        """(host slot, device block) pairs: host -> device, in every layer's K and V, before the
        forward that attends to them (on the compute stream, so the forward sees them)."""
        self._check("kv_host_loads", pairs, device_caches[0][0].shape[0], host_first=True)
        for (dk, dv), (hk, hv) in zip(device_caches, self.caches):
            self._copy(hk, dk, pairs)
            if hv.numel():
                self._copy(hv, dv, pairs)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, pairs: tuple[tuple[int, int], ...]) -> None:
        """dst[d] = src[s] for each (s, d), one slice copy (a memcpy or a DMA) per run of consecutive
        blocks: an indexed copy (index_copy_) moved blocks 2-10x slower on CPU (docs/benchmarks.md,
        "Host KV tier"). Pinned host memory lets the DMA run asynchronously in
        stream order; pageable memory (CPU machines) copies synchronously."""
        src_b, dst_b = _bytes(src), _bytes(dst)  # (N, bs, Hkv, D * itemsize)
        non_blocking = self.device.type == "cuda"
        for s, d, n in _runs(pairs):
            dst_b[d:d + n].copy_(src_b[s:s + n], non_blocking=non_blocking)

    def run(self, device_caches: list[tuple[torch.Tensor, torch.Tensor]], saves: tuple[tuple[int, int], ...],
            loads: tuple[tuple[int, int], ...]) -> None:
        """One step's copies in the order the pool planned them: saves first (a block evicted this
        step may be a load's destination), then loads."""
        if saves:
            self.save(device_caches, saves)
        if loads:
            self.load(device_caches, loads)


def make_host_kv_cache(config: EngineConfig, spec: KVCacheSpec, num_layers: int, dtype: torch.dtype,
                       device: torch.device, tensor_parallel_size: int) -> HostKVCache | None:
    """This rank's host tier, sized as the engine sizes the pool (core/host_kv_pool.num_host_blocks); None when off."""
    cache = config.cache_config
    if cache.kv_offloading_size is None:
        return None
    num_blocks = num_host_blocks(cache.kv_offloading_size, tensor_parallel_size, spec.bytes_per_token * cache.block_size)
    if num_blocks < 1:
        return None  # the engine refuses to start with a message naming the sizes
    return HostKVCache(num_blocks, cache.block_size, spec, num_layers, dtype, device)
