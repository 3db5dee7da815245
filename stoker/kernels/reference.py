"""Plain-torch twins of every kernel. They are the CPU path and the tests' ground truth.

Shapes used throughout:
    num_tokens T (packed over sequences), num_seqs B, num_heads H, num_kv_heads Hkv,
    head_dim D, KV cache (num_blocks, block_size, Hkv, D), block_tables (B, max_blocks) int32,
    slot_mapping (T,) int64 with -1 for tokens whose K/V are not stored (padding).
A query token at index i of sequence s sits at position context_lens[s] - q_len[s] + i and
attends causally to every cached position <= its own (and > position - sliding_window, if set).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64
) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """(B, max_blocks) block ids -> (B, max_len, Hkv, D) keys or values, in position order."""
    num_blocks_used = -(-max_len // cache.shape[1])
    gathered = cache[block_tables[:, :num_blocks_used].long()]  # (B, nb, bs, Hkv, D)
    return gathered.flatten(1, 2)[:, :max_len]


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D): one query token per sequence, at position context_len - 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks)
    context_lens: torch.Tensor,  # (B,)
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # (B, H, D)
    max_len = int(context_lens.max())
    keys = _gather_context(k_cache, block_tables, max_len)  # (B, L, Hkv, D)
    values = _gather_context(v_cache, block_tables, max_len)
    pos = torch.arange(max_len, device=query.device)
    allowed = pos[None, :] < context_lens[:, None]  # (B, L)
    if sliding_window is not None:
        allowed &= pos[None, :] > (context_lens[:, None] - 1 - sliding_window)
    # SDPA reads the gathered K/V through a transposed view (no second copy) and never
    # materialises the (B, H, L) scores in HBM-like memory; GQA without repeating K/V.
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # (B, H, 1, D)
        keys.transpose(1, 2).to(query.dtype),  # (B, Hkv, L, D)
        values.transpose(1, 2).to(query.dtype),
        attn_mask=allowed[:, None, None, :],
        scale=scale,
        enable_gqa=query.shape[1] != k_cache.shape[2],
    )
    return out.squeeze(2)


def paged_attention(
    query: torch.Tensor,  # (T, H, D), packed over sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks)
    cu_seqlens_q: list[int] | torch.Tensor,  # (B + 1,) query offsets into T
    context_lens: list[int] | torch.Tensor,  # (B,) cached + new tokens per sequence
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # (T, H, D)
    """Prefill / extend / decode in one: each sequence's new tokens attend causally to its
    whole cached context (prefix-cache hits and earlier chunks included)."""
    cu = [int(x) for x in cu_seqlens_q]
    ctx = [int(x) for x in context_lens]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    for s in range(len(ctx)):
        q_start, q_end, ctx_len = cu[s], cu[s + 1], ctx[s]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = _gather_context(k_cache, block_tables[s : s + 1], ctx_len)[0]  # (L, Hkv, D)
        values = _gather_context(v_cache, block_tables[s : s + 1], ctx_len)[0]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
        k_pos = torch.arange(ctx_len, device=query.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # (q_len, L)
        if sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        o = F.scaled_dot_product_attention(
            query[q_start:q_end].transpose(0, 1).unsqueeze(0),  # (1, H, q_len, D)
            keys.transpose(0, 1).unsqueeze(0).to(query.dtype),  # (1, Hkv, L, D)
            values.transpose(0, 1).unsqueeze(0).to(query.dtype),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF Llama computes it: normalise in float32, cast, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) [gate | up] -> (..., d) silu(gate) * up."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(
    positions: torch.Tensor,  # (T,)
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, Hkv, D)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim) float32: [cos | sin], rot_dim/2 each
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rot_dim dims of q and k, GPT-NeoX style (HF's rotate_half)."""
    cos_sin = cos_sin_cache[positions]  # (T, rot_dim)
    cos, sin = cos_sin.chunk(2, dim=-1)  # (T, rot_dim / 2)
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    rot_dim = cos_sin_cache.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        out = (x_rot * cos + rotated * sin).to(x.dtype)
        return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out

    return rotate(query), rotate(key)
