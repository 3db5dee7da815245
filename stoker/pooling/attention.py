"""Attention without a KV cache over a packed batch of whole sequences (pooling models).

A pooling step runs each sequence once, start to end, so nothing is cached. The projections
around attention run on the packed tokens (T = the sum of the lengths, no padding); only the
attention itself scatters them into a padded (B, H, max_len, D) view so one SDPA call serves
the batch, with a key mask (and the causal mask for decoders). That pads the attention's
FLOPs to max_len^2 per sequence, never the GEMMs': a varlen kernel would remove even that.
This is the torch path, the reference any varlen kernel is tested against (DESIGN.md rule 7).

The batch's layout is set once per forward on the running thread (`varlen_batch`), as the
paged path sets its AttentionMetadata: one runner thread per model, so thread-local.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class VarlenBatch:
    cu_seqlens: list[int]  # (B + 1,) offsets of each sequence in the packed tokens
    max_len: int
    pad_index: torch.Tensor  # (T,) int64: each packed token's row in the flattened (B * max_len) padded view
    key_valid: torch.Tensor  # (B, 1, 1, max_len) bool: a real (not padding) key

    @classmethod
    def build(cls, lengths: list[int], device: torch.device) -> VarlenBatch:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        max_len = max(lengths)
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        starts = torch.tensor(cu[:-1]).repeat_interleave(torch.tensor(lengths))
        within = torch.arange(cu[-1]) - starts
        pad_index = (seq * max_len + within).to(device)
        key_valid = (torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]).to(device)
        return cls(cu, max_len, pad_index, key_valid[:, None, None, :])


_local = threading.local()


@contextlib.contextmanager
def varlen_batch(batch: VarlenBatch) -> Iterator[None]:
    _local.batch = batch
    try:
        yield
    finally:
        _local.batch = None


def current_batch() -> VarlenBatch:
    batch = getattr(_local, "batch", None)
    if batch is None:
        raise RuntimeError("pooling attention called outside a runner forward (no VarlenBatch set)")
    return batch


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch, scale: float,
                     causal: bool) -> torch.Tensor:
    """q (T, H, D), k/v (T, Hkv, D) packed -> (T, H, D); each sequence attends only to itself."""
    num_tokens, num_heads, head_dim = q.shape
    if len(batch.cu_seqlens) == 2:  # one sequence: no padding at all
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale,
                                             is_causal=causal, enable_gqa=k.shape[1] != num_heads)
        return out.transpose(0, 1)
    num_seqs, max_len = len(batch.cu_seqlens) - 1, batch.max_len

    def padded(x: torch.Tensor) -> torch.Tensor:  # (T, h, D) -> (B, h, max_len, D)
        out = x.new_zeros(num_seqs * max_len, x.shape[1], head_dim)
        out.index_copy_(0, batch.pad_index, x)
        return out.view(num_seqs, max_len, x.shape[1], head_dim).transpose(1, 2)

    mask = batch.key_valid  # (B, 1, 1, max_len)
    if causal:
        mask = mask & torch.ones(max_len, max_len, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != num_heads)  # (B, H, max_len, D)
    out = out.transpose(1, 2).reshape(num_seqs * max_len, num_heads, head_dim)
    return out.index_select(0, batch.pad_index)


class VarlenAttention(nn.Module):
    """Drop-in for layers.attention.Attention in a pooling model: same call, no KV cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.causal = scale, causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q, k, v, current_batch(), self.scale, self.causal)
