"""Tensors backed by transparent huge pages, for the weights the CPU kernels stream.

A MoE layer's call reads its experts' packed panels once, front to back (kernels/cpu/moe.c):
at 1 to 64 tokens that stream is most of the call. On 4 KB pages each 4 KB of it is a TLB
miss and a page walk, and the hardware prefetchers stop at every page boundary; on 2 MB pages
neither happens. Measured on this project's 2-core Zen 4 VM (docs/benchmarks.md, "MoE on CPU"),
1 thread, CPU time: the fused kernel on the same packed experts 1.46 vs 2.16 ms at 1 token,
4.7 vs 6.5 ms at 8, 13.2 vs 15.1 ms at 64.

Linux gives anonymous memory huge pages when the system's policy allows it
(/sys/kernel/mm/transparent_hugepage/enabled: `always`, or `madvise` and the range was
madvise(MADV_HUGEPAGE)d before its pages were first touched). `empty_huge` allocates a
2 MB-aligned range and advises it; elsewhere (another OS, the policy `never`, a refused
madvise) it is an ordinary tensor, with the same values and layout.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
# MADV_HUGEPAGE, linux/mman.h
_MADV_HUGEPAGE = 14
# Below this a tensor is not worth a huge page's alignment slack.
MIN_BYTES = 4 * HUGE_PAGE_BYTES


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty(shape, dtype) on CPU, its data 2 MB-aligned and advised to huge pages
    (Linux, tensors of MIN_BYTES or more): a contiguous view into a slightly larger buffer.
    Its pages are not touched here, so the first writes fault them in as huge pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES  # bytes to the first 2 MB boundary
    view = raw[start : start + nbytes].view(dtype).view(shape)
    madvise(view.data_ptr(), nbytes, _MADV_HUGEPAGE)  # a refusal (EINVAL: no THP here) leaves 4 KB pages
    return view
