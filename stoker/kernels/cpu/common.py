"""What the Python entry points of the CPU C kernels share; each C file has its own module
(paged_decode_attention.py, prefill_attention.py, elementwise.py, linear.py, store_kvcache.py,
lora.py, encoder_layer.py, moe.py) of argument checks, then one ctypes call.

Here: the kernels' domains (`supports`, `supports_rows`: what `kernels/ops.py` sends to the C
kernels rather than the torch twins in reference.py), the loaded library or a BuildError
(`_checked_library`), and the argument checks, thread counts and status codes several kernels
share. The C code trusts its indices, so everything that could make it read or write outside a
tensor is checked before each call.
"""

from __future__ import annotations

import torch

from stoker.kernels.cpu.build import BuildError, available, library


KV_DTYPES = (torch.float32, torch.float8_e4m3fn)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C kernels' domain: CPU float32 query, float32 or FP8 E4M3 cache. Anything else takes the torch twin."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and k_cache.dtype in KV_DTYPES
        and available()
    )


def _checked_library():
    lib = library()
    if lib is None:
        raise BuildError("the CPU kernel library is not available")
    return lib


def _check_paged(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Query (.., H, D) and caches (num_blocks, block_size, Hkv, D) fit together; returns the cache's shape."""
    num_heads, head_dim = query.shape[-2:]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"shape mismatch: query {tuple(query.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (num_blocks, block_size, Hkv, D)")
    if query.dtype != torch.float32 or k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"float32 query and float32 or fp8 caches only: query {query.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    return num_blocks, block_size, num_kv_heads, head_dim


def _is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def _raise_for_status(status: int, kernel: str, bad_lengths: str, num_blocks: int) -> None:
    """The attention kernels' return codes: 1 no memory, 2 inconsistent lengths, 3 bad block id."""
    if status == 1:
        raise MemoryError(f"{kernel}: could not allocate the per-thread scratch buffers")
    if status == 2:
        raise ValueError(bad_lengths)
    if status == 3:
        raise ValueError(f"block_tables hold ids outside [0, {num_blocks})")


def _check_varlen_tables(token_table: torch.Tensor, cu_seqlens: torch.Tensor, lengths: torch.Tensor, num_tokens: int) -> None:
    """The C side trusts cu_seqlens; it checks each length against token_table's width and each row id against T."""
    if token_table.dtype != torch.int32 or cu_seqlens.dtype != torch.int64 or lengths.dtype != torch.int64:
        raise ValueError("token_table must be int32, cu_seqlens and lengths int64")
    num_seqs = lengths.shape[0]
    if token_table.dim() != 2 or token_table.shape[0] != num_seqs or cu_seqlens.shape != (num_seqs + 1,):
        raise ValueError(f"token_table {tuple(token_table.shape)}, cu_seqlens {tuple(cu_seqlens.shape)} and lengths "
                         f"{tuple(lengths.shape)} disagree on the number of sequences")
    if not (token_table.is_contiguous() and cu_seqlens.is_contiguous() and lengths.is_contiguous()):
        raise ValueError("token_table, cu_seqlens and lengths must be contiguous")
    if num_seqs and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens):
        raise ValueError(f"cu_seqlens must run from 0 to the {num_tokens} tokens")


# Below this many elements a kernel runs on one thread: waking the OpenMP team costs more
# than it saves (torch's own grain size for element-wise ops is 32768).
_PARALLEL_MIN_ELEMENTS = 32768


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= _PARALLEL_MIN_ELEMENTS else 1


def supports_rows(*tensors: torch.Tensor) -> bool:
    """The row kernels' domain: CPU float32 tensors whose last dim is contiguous."""
    for t in tensors:  # a plain loop: this runs before every kernel call
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() < 1 or t.stride(-1) != 1:
            return False
    return available()


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (..., n) -> (rows, n) view (copy only if the leading dims cannot be merged), row stride."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows, rows.stride(0)


def _head_rows(t: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """(T, heads, D) with contiguous heads (stride(1) == D, stride(2) == 1); returns it and its row stride."""
    if t.dim() != 3:
        raise ValueError(f"{name} must be (num_tokens, num_heads, head_dim), got {tuple(t.shape)}")
    if not (t.stride(2) == 1 and t.stride(1) == t.shape[2]):
        t = t.contiguous()
    return t, t.stride(0)
