"""Attention without a KV cache over a packed batch of whole sequences (pooling models).

A pooling step runs each sequence once, start to end, so nothing is cached. The projections
around attention run on the packed tokens (T = the sum of the lengths, no padding); only the
attention itself scatters them into a padded (B, H, max_len, D) view so one SDPA call serves
the batch, with a key mask (and the causal mask for decoders). That pads the attention's
FLOPs to max_len^2 per sequence, never the GEMMs'. That is the torch path, the reference the
varlen C kernel is tested against (DESIGN.md rule 7): on CPU float32, VarlenAttention runs every
sequence over its own tokens with no padding and no mask (prefill_attention.varlen_attention).

An encoder's q, k and v come out of one GEMM as (T, 3, H, D) (`varlen_attention_qkv`): they
are scattered into the padded view with one copy, not three, and the key mask is an additive
float tensor built once per forward, not a bool mask SDPA converts in every layer (together
15-20% off the attention's time at 32 sequences on a 2-core CPU, same results bit for bit).
A lone sequence needs no copy at all: its (1, H, L, D) views go to SDPA's fused kernel as they
are (the transposed views used before fell to the unfused math path: 2-2.5x slower at B = 1).

The batch's layout is set once per forward in the forward's context (layers/forward_context.py,
`varlen`), as the paged path sets its AttentionMetadata: one runner thread per model, so the
context is thread-local.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from stoker.layers.forward_context import ForwardContext, get_forward_context, set_forward_context


@dataclass
class VarlenBatch:
    """One forward's layout. Only what every path needs is built up front (the offsets and
    positions); the padded path's indices and mask and the C kernel's tables are built on first
    use, so a forward pays for the attention path it runs, once, whatever its layer count."""

    seq_lens: list[int]  # (B,) tokens of each sequence
    cu_seqlens: list[int]  # (B + 1,) offsets of each sequence in the packed tokens
    max_len: int
    positions: torch.Tensor  # (T,) int64: each token's position within its own sequence
    device: torch.device
    _key_bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, lengths: list[int], device: torch.device) -> VarlenBatch:
        # Index lists in Python, then one tensor each: cheaper than the chain of small torch
        # ops (repeat_interleave, an arange per sequence, cat) it replaces, 0.3 ms -> 0.1-0.2 ms
        # per forward of 32 sequences on a 2-core CPU; it runs once per batch, on the runner thread.
        within = [i for n in lengths for i in range(n)]
        return cls(list(lengths), list(itertools.accumulate(lengths, initial=0)), max(lengths),
                   torch.tensor(within, dtype=torch.long, device=device), device)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    # ---------------------------------------------------------------- the padded (SDPA) path
    @functools.cached_property
    def pad_index(self) -> torch.Tensor:
        """(T,) int64: each packed token's row in the flattened (B * max_len) padded view."""
        pad = [b * self.max_len + i for b, n in enumerate(self.seq_lens) for i in range(n)]
        return torch.tensor(pad, dtype=torch.long, device=self.device)

    @functools.cached_property
    def key_valid(self) -> torch.Tensor:
        """(B, 1, 1, max_len) bool: a real (not padding) key."""
        valid = torch.arange(self.max_len)[None, :] < torch.tensor(self.seq_lens)[:, None]
        return valid[:, None, None, :].to(self.device)

    def key_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, 1, max_len): 0 for a real key, -inf for padding; built once per forward and
        dtype (SDPA wants a float mask in the query's dtype), shared by every layer."""
        bias = self._key_bias.get(dtype)
        if bias is None:
            bias = torch.zeros(self.key_valid.shape, dtype=dtype, device=self.key_valid.device)
            bias.masked_fill_(~self.key_valid, float("-inf"))
            self._key_bias[dtype] = bias
        return bias

    # ---------------------------------------------------------------- the C kernel (prefill_attention.c)
    @functools.cached_property
    def token_table(self) -> torch.Tensor:
        """(B, max_len) int32: row s = sequence s's token rows, then zeros."""
        return torch.tensor([list(range(start, start + n)) + [0] * (self.max_len - n)
                             for start, n in zip(self.cu_seqlens, self.seq_lens)], dtype=torch.int32)

    @functools.cached_property
    def cu_tensor(self) -> torch.Tensor:  # (B + 1,) int64
        return torch.tensor(self.cu_seqlens, dtype=torch.int64)

    @functools.cached_property
    def lengths(self) -> torch.Tensor:  # (B,) int64
        return torch.tensor(self.seq_lens, dtype=torch.int64)


@contextlib.contextmanager
def varlen_batch(batch: VarlenBatch) -> Iterator[None]:
    """A forward over `batch`: its layout in this thread's forward context for the block."""
    with set_forward_context(ForwardContext(varlen=batch)):
        yield


def current_batch() -> VarlenBatch:
    batch = get_forward_context().varlen
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


def varlen_attention_qkv(qkv: torch.Tensor, batch: VarlenBatch, scale: float) -> torch.Tensor:
    """An encoder's fused projection, qkv (T, 3, H, D) packed -> (T, H, D), not causal, as many
    key/value heads as query heads; each sequence attends only to itself."""
    num_tokens, _, num_heads, head_dim = qkv.shape
    num_seqs, max_len = batch.num_seqs, batch.max_len
    if num_seqs == 1:  # strided (1, H, T, D) views, no copy and no mask
        q, k, v = qkv.view(1, num_tokens, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1)
    padded = qkv.new_zeros(num_seqs * max_len, 3, num_heads, head_dim)
    padded.index_copy_(0, batch.pad_index, qkv)  # one scatter for q, k and v together
    q, k, v = padded.view(num_seqs, max_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)  # each (B, H, max_len, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_bias(qkv.dtype), scale=scale)
    out = out.transpose(1, 2).reshape(num_seqs * max_len, num_heads, head_dim)
    return out.index_select(0, batch.pad_index)


def kernel_supports(x: torch.Tensor, head_dim: int) -> bool:
    """The C varlen path (prefill_attention.c): CPU float32, the kernels built, head_dim a
    multiple of their vector width."""
    from stoker.kernels.cpu import build

    if x.device.type != "cpu" or x.dtype != torch.float32 or not build.available():
        return False
    return head_dim % int(build.library().stoker_linear_vl()) == 0


class VarlenAttention(nn.Module):
    """Drop-in for layers.attention.Attention in a pooling model: same call, no KV cache.

    On CPU float32 the C kernel runs every sequence over its own tokens with no padding
    (prefill_attention.varlen_attention); elsewhere the padded SDPA path above, its reference. Which one is
    decided at the first forward (the model's dtype and device are known then) and kept."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.causal = scale, causal
        self.use_kernel: bool | None = None

    def _kernel(self, x: torch.Tensor) -> bool:
        if self.use_kernel is None:
            self.use_kernel = kernel_supports(x, self.head_dim)
        return self.use_kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch = current_batch()
        if self._kernel(q):
            return _kernel_attention(q.contiguous(), k.contiguous(), v.contiguous(), batch, self.scale, self.causal)
        return varlen_attention(q, k, v, batch, self.scale, self.causal)

    def forward_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """(T, 3, H, D) from one fused projection -> (T, H, D): an encoder's path (not causal, no GQA)."""
        assert not self.causal and self.num_kv_heads == self.num_heads, "forward_qkv is the encoders' path"
        batch = current_batch()
        if self._kernel(qkv):
            from stoker.kernels.cpu import prefill_attention as cpu_prefill

            # q, k and v read in place from the projection's rows: no copy of each
            return cpu_prefill.encoder_attention(qkv.contiguous(), batch.token_table, batch.cu_tensor, batch.lengths, self.scale)
        return varlen_attention_qkv(qkv, batch, self.scale)


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch, scale: float,
                      causal: bool) -> torch.Tensor:
    from stoker.kernels.cpu import prefill_attention as cpu_prefill

    return cpu_prefill.varlen_attention(q, k, v, batch.token_table, batch.cu_tensor, batch.lengths, scale, causal)
