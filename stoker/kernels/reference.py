"""Plain-torch twins of every kernel. They are the CPU path and the tests' ground truth.

Shapes used throughout:
    num_tokens T (packed over sequences), num_seqs B, num_heads H, num_kv_heads Hkv,
    head_dim D, KV cache (num_blocks, block_size, Hkv, D), block_tables (B, max_blocks) int32,
    slot_mapping (T,) int64 with -1 for tokens whose K/V are not stored (padding).
A query token at index i of sequence s sits at position context_lens[s] - q_len[s] + i and
attends causally to every cached position <= its own (and > position - sliding_window, if set).
With `logits_soft_cap` c (Gemma 2), each score s = q.k x scale becomes c x tanh(s / c) before
the mask and the softmax (transformers' eager attention).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stoker.kernels._common import FP8_KV_DTYPE, FP8_MAX, kv_inverse_scales


def store_kvcache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64
    k_scale: float = 1.0,  # FP8 caches: x is stored as e4m3(clamp(x / scale, +-448))
    v_scale: float = 1.0,
) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if k_cache.dtype == FP8_KV_DTYPE:
        k_inv, v_inv = kv_inverse_scales(k_scale, v_scale)
        # index_copy_ has no float8 kernel: the bytes are copied as uint8.
        for x, cache, inv in ((key, k_cache, k_inv), (value, v_cache, v_inv)):
            q = (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE).view(torch.uint8)
            cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, q)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements -> `dtype`: FP8 as value x scale (computed in float32), others a cast."""
    if x.dtype == FP8_KV_DTYPE:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


# Reused gather buffers, one per (role, dtype, device): a fresh multi-MB tensor per call
# costs page faults (the allocator maps new zeroed pages) on top of the copy itself.
_workspaces: dict[tuple, torch.Tensor] = {}


def _workspace(role: str, like: torch.Tensor, num_rows: int) -> torch.Tensor:
    # Inference tensors (made under torch.inference_mode) may not be written outside it.
    key = (role, like.dtype, like.device, like.shape[1:], torch.is_inference_mode_enabled())
    buf = _workspaces.get(key)
    if buf is None or buf.shape[0] < num_rows:
        buf = torch.empty((max(num_rows, 2 * (buf.shape[0] if buf is not None else 0)), *like.shape[1:]), dtype=like.dtype, device=like.device)
        _workspaces[key] = buf
    return buf[:num_rows]


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int, role: str | None = None) -> torch.Tensor:
    """(B, max_blocks) block ids -> (B, max_len, Hkv, D) keys or values, in position order.

    With `role`, the result lives in a reused buffer, valid until the next call with that role.
    """
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks_used = -(-max_len // block_size)
    # index_select on dim 0 is a plain row copy: ~1.5x faster on CPU than advanced indexing.
    ids = block_tables[:, :num_blocks_used].reshape(-1).long()
    if role is None:
        gathered = cache.index_select(0, ids)
    else:
        gathered = torch.index_select(cache, 0, ids, out=_workspace(role, cache, ids.shape[0]))
    return gathered.view(num_seqs, num_blocks_used * block_size, *cache.shape[2:])[:, :max_len]


# Decode sequences are attended in groups of similar context length, each group padded only
# to its own longest context: on CPU this is ~2.5x faster than one batch padded to the
# longest context overall (less to gather, and each group's K/V stays in cache).
_DECODE_GROUP = 16


@dataclass
class _DecodeGroup:
    rows: slice  # rows of the length-sorted batch
    block_ids: torch.Tensor  # (b * nb,) int64: the blocks to gather, sequence by sequence
    max_len: int
    # (b, 1, 1, L) additive mask, 0 where a sequence attends and -inf elsewhere: SDPA would
    # turn a bool mask into this on every call, i.e. once per layer.
    mask: torch.Tensor


@dataclass
class _DecodePlan:
    """What every layer of one step shares: the groups, their blocks and masks. Built once per
    step (the block tables and context lengths are the same tensors for all layers)."""

    key: tuple  # weak references to the step's tensors + window: the plan's validity
    order: torch.Tensor  # (B,) sequences sorted by context length, longest first
    inverse: torch.Tensor  # (B,) where each sequence landed in `order`
    groups: list[_DecodeGroup]


_plan: _DecodePlan | None = None


def _decode_plan(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int | None, dtype: torch.dtype
) -> _DecodePlan:
    global _plan
    if _plan is not None:
        bt_ref, cl_ref, w, dt = _plan.key
        if bt_ref() is block_tables and cl_ref() is context_lens and w == window and dt == dtype:
            return _plan
    order = torch.argsort(context_lens, descending=True)
    lens = context_lens[order]
    tables = block_tables[order]
    lens_list = lens.tolist()
    groups = []
    for start in range(0, len(lens_list), _DECODE_GROUP):
        stop = min(start + _DECODE_GROUP, len(lens_list))
        max_len = max(lens_list[start:stop])
        nb = -(-max_len // block_size)
        pos = torch.arange(max_len, device=lens.device)
        group_lens = lens[start:stop, None]
        allowed = pos[None, :] < group_lens  # (b, L)
        if window is not None:
            allowed &= pos[None, :] > group_lens - 1 - window
        block_ids = tables[start:stop, :nb].reshape(-1).long()
        mask = torch.zeros(allowed.shape, dtype=dtype, device=lens.device).masked_fill_(~allowed, float("-inf"))
        groups.append(_DecodeGroup(slice(start, stop), block_ids, max_len, mask[:, None, None, :]))
    key = (weakref.ref(block_tables), weakref.ref(context_lens), window, dtype)
    _plan = _DecodePlan(key, order, torch.argsort(order), groups)
    return _plan


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D): one query token per sequence, at position context_len - 1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks)
    context_lens: torch.Tensor,  # (B,)
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # (H,) attention sinks (gpt-oss): the twins and the C kernels take them
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap x tanh(score / cap); None or 0: off
) -> torch.Tensor:  # (B, H, D)
    plan = _decode_plan(block_tables, context_lens, k_cache.shape[1], sliding_window, query.dtype)
    q_sorted = query.index_select(0, plan.order)
    out_sorted = torch.empty_like(q_sorted)
    for g in plan.groups:
        out_sorted[g.rows] = _decode_group(q_sorted[g.rows], k_cache, v_cache, g, scale, k_scale, v_scale, sinks,
                                           logits_soft_cap)
    return out_sorted.index_select(0, plan.inverse)


def _decode_group(
    query: torch.Tensor,  # (b, H, D)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # (b, H, D)
    b = query.shape[0]
    rows = group.block_ids.shape[0]
    k_flat = torch.index_select(k_cache, 0, group.block_ids, out=_workspace("k", k_cache, rows))
    v_flat = torch.index_select(v_cache, 0, group.block_ids, out=_workspace("v", v_cache, rows))
    keys = k_flat.view(b, -1, *k_cache.shape[2:])[:, : group.max_len]  # (b, L, Hkv, D)
    values = v_flat.view(b, -1, *v_cache.shape[2:])[:, : group.max_len]
    # SDPA reads the gathered K/V through a transposed view (no second copy), never
    # materialises the (b, H, L) scores, and does GQA without repeating K/V.
    out = _attend(
        query.unsqueeze(2),  # (b, H, 1, D)
        dequantize_kv(keys.transpose(1, 2), k_scale, query.dtype),  # (b, Hkv, L, D)
        dequantize_kv(values.transpose(1, 2), v_scale, query.dtype),
        group.mask,
        False,
        scale,
        sinks,
        logits_soft_cap,
    )
    return out.squeeze(2)


def _attend(
    q: torch.Tensor,  # (b, H, Lq, D)
    k: torch.Tensor,  # (b, Hkv, L, D)
    v: torch.Tensor,  # (b, Hkv, L, D)
    mask: torch.Tensor | None,  # bool (allowed) or additive, broadcast to (b, H, Lq, L)
    is_causal: bool,
    scale: float,
    sinks: torch.Tensor | None,  # (H,)
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # (b, H, Lq, D)
    """SDPA; with attention sinks or a soft cap, the same attention written out: each head's
    sink is one more logit in the softmax's denominator, with no value (gpt-oss), the soft cap
    bends every score to cap x tanh(score / cap) before the mask (Gemma 2; transformers' eager path)."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None and not logits_soft_cap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (b, H, Lq, L)
    if logits_soft_cap:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if is_causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (b, H, Lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    return (probs @ v.float()).to(q.dtype)


def paged_attention(
    query: torch.Tensor,  # (T, H, D), packed over sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks)
    cu_seqlens_q: list[int] | torch.Tensor,  # (B + 1,) query offsets into T
    context_lens: list[int] | torch.Tensor,  # (B,) cached + new tokens per sequence
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,  # (H,) attention sinks (gpt-oss): the twins and the C kernels take them
    logits_soft_cap: float | None = None,  # Gemma 2: scores -> cap x tanh(score / cap); None or 0: off
) -> torch.Tensor:  # (T, H, D)
    """Prefill / extend / decode in one: each sequence's new tokens attend causally to its
    whole cached context (prefix-cache hits and earlier chunks included)."""
    cu = [int(x) for x in cu_seqlens_q]
    ctx = [int(x) for x in context_lens]
    out = torch.empty_like(query)
    for s in range(len(ctx)):
        q_start, q_end, ctx_len = cu[s], cu[s + 1], ctx[s]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = _gather_context(k_cache, block_tables[s : s + 1], ctx_len)[0]  # (L, Hkv, D)
        values = _gather_context(v_cache, block_tables[s : s + 1], ctx_len)[0]
        allowed = None
        # A whole prompt at once (nothing cached before it, no window in reach): plain causal,
        # which SDPA runs without a mask and without computing the upper triangle.
        plain_causal = q_len == ctx_len and (sliding_window is None or sliding_window >= ctx_len)
        if not plain_causal:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            k_pos = torch.arange(ctx_len, device=query.device)
            allowed = k_pos[None, :] <= q_pos[:, None]  # (q_len, L)
            if sliding_window is not None:
                allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        o = _attend(
            query[q_start:q_end].transpose(0, 1).unsqueeze(0),  # (1, H, q_len, D)
            dequantize_kv(keys.transpose(0, 1).unsqueeze(0), k_scale, query.dtype),  # (1, Hkv, L, D)
            dequantize_kv(values.transpose(0, 1).unsqueeze(0), v_scale, query.dtype),
            allowed,
            plain_causal,
            scale,
            sinks,
            logits_soft_cap,
        )
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


def linear_packed(
    x: torch.Tensor,  # (..., K)
    packed: torch.Tensor,  # (P, K, NR): W (N, K) in column panels, kernels/cpu/linear.pack_linear_weight
    out_features: int,  # N <= P * NR
    bias: torch.Tensor | None = None,  # (P * NR,) in panel order
    silu_and_mul: bool = False,  # panels of [gate | up] halves -> silu(gate) * up, (..., N / 2)
) -> torch.Tensor:  # (..., N) or (..., N / 2)
    rows = x.reshape(-1, x.shape[-1])
    num_panels, _, nr = packed.shape
    panels = torch.matmul(rows, packed)  # (P, M, NR)
    if bias is not None:
        panels = panels + bias.view(num_panels, 1, nr)
    if silu_and_mul:
        panels = F.silu(panels[..., : nr // 2]) * panels[..., nr // 2 :]
    out = panels.permute(1, 0, 2).reshape(rows.shape[0], -1)
    width = out_features // 2 if silu_and_mul else out_features
    return out[:, :width].reshape(*x.shape[:-1], width)


def dequantize_panels(packed: torch.Tensor, scales: torch.Tensor, group_k: int) -> torch.Tensor:
    """(P, K, NR) int8 / float8 panels and (G, P * NR) scales (kernels/cpu/linear.pack_scales)
    -> the (P, K, NR) float32 panels they stand for: w = q * s, as linear.c computes it. FP8
    panels are read as value / 256, their scales carrying the 256 (linear.c's header)."""
    num_panels, k, nr = packed.shape
    q = packed.float()
    if packed.dtype == torch.float8_e4m3fn:
        q = q * (1.0 / 256.0)
    s = scales.view(scales.shape[0], num_panels, nr).permute(1, 0, 2)  # (P, G, NR)
    s = s.repeat_interleave(group_k, dim=1)[:, :k]  # (P, K, NR)
    return q * s


def linear_packed_q8(
    x: torch.Tensor,  # (..., K)
    packed: torch.Tensor,  # (P, K, NR) int8 or float8_e4m3fn
    scales: torch.Tensor,  # (G, P * NR) float32
    group_k: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """Twin of kernels/cpu/linear.linear_q8: dequantize the panels, then linear_packed."""
    return linear_packed(x, dequantize_panels(packed, scales, group_k), out_features, bias, silu_and_mul)


def w8_linear(
    x: torch.Tensor,  # (..., K)
    qweight: torch.Tensor,  # (N, K) int8 or float8_e4m3fn
    scale: torch.Tensor,  # (N, G) float32: one scale per row and group of group_k columns
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # (..., N)
    """Weight-only quantized linear: dequantize (w = q * s in float32, then x's dtype), then F.linear.
    Twin of kernels/w8_linear.py; also the fallback where no kernel serves the device."""
    k = qweight.shape[1]
    s = scale.float() if scale.shape[1] == 1 else scale.float().repeat_interleave(group_k, dim=1)[:, :k]
    w = (qweight.float() * s).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF Llama computes it: normalise in float32, cast, then scale."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op, same arithmetic
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
    cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)  # (T, 1, rot_dim / 2) each
    rot_dim = cos_sin_cache.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]: rotate_half without building it.
        x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out

    return rotate(query), rotate(key)


def lora_bgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor,
              col_offset: int = 0) -> torch.Tensor:
    """Twin of kernels/lora_bgmv.py: out[t, col_offset:col_offset + N] += (x[t] @ A[s].T) @ B[s].T
    for s = slot_ids[t] >= 0, in float32, rounded once into out's dtype."""
    n = b.shape[1]
    for s in sorted({int(v) for v in slot_ids.tolist() if v >= 0}):
        rows = (slot_ids == s).nonzero().flatten()
        delta = (x[rows].float() @ a[s].float().T) @ b[s].float().T  # (rows, N)
        cols = slice(col_offset, col_offset + n)
        out[rows, cols] = (out[rows, cols].float() + delta).to(out.dtype)
    return out


def lora_segments(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, segments: list[tuple[int, int, int]],
                  out: torch.Tensor) -> torch.Tensor:
    """Twin of kernels/cpu/lora.lora (and the CPU path without the C kernels): for each
    segment (slot s, tokens t0:t1), out[t0:t1, :N] += (x[t0:t1] @ A[s].T) @ BT[s]. BT's zeros
    outside the kernel's blocks and past each adapter's rank are multiplied here, skipped there."""
    n = bt.shape[2]
    for slot, t0, t1 in segments:
        out[t0:t1, :n].addmm_(x[t0:t1] @ a[slot].T, bt[slot])
    return out


def fused_moe(
    x: torch.Tensor,  # (T, H)
    w13: torch.Tensor,  # (E, 2I, H): [gate; up] of each expert
    w2: torch.Tensor,  # (E, H, I)
    topk_weights: torch.Tensor,  # (T, k) routing weights (float32)
    topk_ids: torch.Tensor,  # (T, k) expert of each choice
    activation=silu_and_mul,  # (n, 2I) [gate | up] -> (n, I)
    b13: torch.Tensor | None = None,  # (E, 2I) [gate; up] biases (gpt-oss), or None
    b2: torch.Tensor | None = None,  # (E, H)
) -> torch.Tensor:  # (T, H)
    """Mixture-of-Experts feed-forward, one expert at a time over the tokens that chose it (as
    transformers' eager experts loop): the twin of layers/moe.py's sorted, grouped method."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token_idx, slot = torch.where(topk_ids == e)
        if token_idx.numel() == 0:
            continue
        pre = x[token_idx] @ w13[e].t() + (b13[e] if b13 is not None else 0)  # (n, 2I)
        h = activation(pre) @ w2[e].t() + (b2[e] if b2 is not None else 0)  # (n, H)
        out.index_add_(0, token_idx, (h * topk_weights[token_idx, slot, None]).to(x.dtype))
    return out


def _gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """(n, 2I) [gate | up] float32 -> (n, I) float32: the gates of kernels/fused_moe.ACTIVATIONS."""
    gate, up = gate_up.chunk(2, dim=-1)
    fns = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "relu": F.relu}
    return fns[activation](gate) * up


def fused_moe_grouped(
    x: torch.Tensor,  # (T, H)
    w13: torch.Tensor,  # (E, 2I, H) model dtype, or int8 / float8_e4m3fn with w13_scale
    w2: torch.Tensor,  # (E, H, I)
    topk_weights: torch.Tensor,  # (T, k) float32
    topk_ids: torch.Tensor,  # (T, k)
    activation: str = "silu",
    w13_scale: torch.Tensor | None = None,  # (E, 2I, G13) float32
    w2_scale: torch.Tensor | None = None,  # (E, H, G2) float32
    group_k13: int | None = None,
    group_k2: int | None = None,
) -> torch.Tensor:  # (T, H)
    """Twin of kernels/fused_moe.py, rounding where it rounds: per expert, the gate/up GEMM and
    the activation in float32 (operands in x's dtype, 8-bit weights dequantized to it first, as
    w8_linear), rounded to x's dtype; the down GEMM in float32 times the routing weight, rounded;
    then each token's k results summed in float32 in ascending expert order, rounded once."""
    num_tokens, k = topk_ids.shape
    ids, perm = topk_ids.sort(dim=1)
    weights = topk_weights.gather(1, perm).float()

    def dequantized(w: torch.Tensor, scale: torch.Tensor | None, group_k: int | None, e: int) -> torch.Tensor:
        if scale is None:
            return w[e].float()
        assert group_k is not None
        s = scale[e].float().repeat_interleave(group_k, dim=1)[:, : w.shape[2]]
        return (w[e].float() * s).to(x.dtype).float()

    per_choice = torch.zeros(num_tokens, k, x.shape[1], dtype=x.dtype, device=x.device)
    for e in range(w13.shape[0]):
        token_idx, slot = torch.where(ids == e)
        if token_idx.numel() == 0:
            continue
        a = x[token_idx].float()
        act = _gated(a @ dequantized(w13, w13_scale, group_k13, e).t(), activation).to(x.dtype)
        h = act.float() @ dequantized(w2, w2_scale, group_k2, e).t()  # (n, H) float32
        per_choice[token_idx, slot] = (h * weights[token_idx, slot, None]).to(x.dtype)
    out = per_choice[:, 0].float()
    for j in range(1, k):
        out += per_choice[:, j].float()
    return out.to(x.dtype)


def linear_packed_q4(
    x: torch.Tensor,  # (..., K)
    packed: torch.Tensor,  # (P, K, NR / 2) uint8 (kernels/cpu/linear_q4.pack_q4_weight)
    scales: torch.Tensor,  # (G, P * NR) float16 or float32
    offsets: torch.Tensor | None,  # (G, P * NR) float32 o' = o + 8 s, or None (all zero)
    group_k: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """Twin of kernels/cpu/linear_q4.linear_q4, the same regrouping (linear_q4.h): per group g,
    s_g * (x_g @ (q_g - 8)) + o'_g * sum(x_g), summed over the groups, + bias (panel order)."""
    from stoker.kernels.cpu.linear_q4 import unpack_q4_panels

    num_panels, k, half = packed.shape
    nr = 2 * half
    codes = unpack_q4_panels(packed).float().permute(1, 0, 2).reshape(k, num_panels * nr)  # (K, P * NR)
    rows = x.reshape(-1, k).float()
    groups = k // group_k
    per_group = torch.einsum("mgk,gkn->mgn", rows.view(-1, groups, group_k), codes.view(groups, group_k, -1))
    out = (per_group * scales.float()).sum(dim=1)  # (M, P * NR)
    if offsets is not None:
        out = out + rows.view(-1, groups, group_k).sum(dim=2) @ offsets
    return _packed_output(out, bias, silu_and_mul, nr, out_features, x.shape[:-1])


def quantize_q8_blocks(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float32 -> (M, K) int8 values in [-127, 127] and (M, K / block) float32 scales d,
    x ~ a * d per block of `block` columns (llama.cpp's Q8_0): d = amax|x| * (1 / 127),
    a = round-half-even(x * (1 / d)), 0 where amax is 0 (linear_q4_a8.h's q8_quantize_rows)."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(dim=2)
    d = amax * (torch.tensor(1.0) / torch.tensor(127.0))  # float32 constant, as C's 1.0f / 127.0f
    inv = torch.where(d > 0, 1.0 / d.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(d))
    a = torch.round(blocks * inv.unsqueeze(2)).clamp(-127, 127)
    return a.to(torch.int8).reshape(x.shape), d


def _packed_output(out: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: bool, nr: int, out_features: int,
                   lead: torch.Size) -> torch.Tensor:
    """The end of the packed-panel twins: (M, P * NR) sums in panel column order, + bias, then
    silu(gate) * up per panel (its NR / 2 gate then NR / 2 up columns) or the first out_features
    columns, shaped (*lead, N) or (*lead, N / 2)."""
    if bias is not None:
        out = out + bias
    if silu_and_mul:
        gate, up = out.view(out.shape[0], -1, 2, nr // 2).unbind(dim=2)
        return (F.silu(gate) * up).reshape(*lead, out.shape[1] // 2)[..., : out_features // 2]
    return out[:, :out_features].reshape(*lead, out_features)


def linear_packed_q4_a8(
    x: torch.Tensor,  # (..., K)
    packed: torch.Tensor,  # (P, K, NR / 2) uint8 (kernels/cpu/linear_q4.pack_q4_weight)
    scales: torch.Tensor,  # (G, P * NR) float16 or float32
    offsets: torch.Tensor | None,  # (G, P * NR) float32 o' = o + 8 s, or None (all zero)
    group_k: int,  # a multiple of 32
    out_features: int,
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """Twin of kernels/cpu/linear_q4.linear_q4_a8 (W4A8), bit for bit: x quantized per block of
    32 (quantize_q8_blocks), exact integer dot products per block, then the float sums in
    linear_q4_a8.h's order, each one IEEE mul or add:
    A_g = sum_b float(I_b) * d_b, y = sum_g A_g * s_g + o'_g * X_g, + bias."""
    from stoker.kernels.cpu.linear_q4 import Q8_BLOCK, unpack_q4_panels

    num_panels, k, half = packed.shape
    nr = 2 * half
    codes = unpack_q4_panels(packed).permute(1, 0, 2).reshape(k, num_panels * nr)  # (K, P * NR) q - 8
    rows = x.reshape(-1, k).float()
    a, d = quantize_q8_blocks(rows, Q8_BLOCK)  # (M, K), (M, B)
    num_blocks = k // Q8_BLOCK
    # |I| <= 32 * 8 * 127 < 2^15: exact in float64, and in float32 after
    ints = torch.einsum("mbk,bkn->mbn", a.double().view(-1, num_blocks, Q8_BLOCK),
                        codes.double().view(num_blocks, Q8_BLOCK, -1)).float()  # (M, B, P * NR)
    sums = a.view(-1, num_blocks, Q8_BLOCK).sum(dim=2, dtype=torch.int32).float()  # (M, B) S_b
    per_group = group_k // Q8_BLOCK
    out = torch.zeros(rows.shape[0], num_panels * nr)
    for g in range(k // group_k):
        acc = torch.zeros_like(out)
        xg = torch.zeros(rows.shape[0], 1)
        for b in range(g * per_group, (g + 1) * per_group):
            acc = acc + ints[:, b] * d[:, b : b + 1]
            xg = xg + d[:, b : b + 1] * sums[:, b : b + 1]
        out = out + acc * scales[g].float()
        if offsets is not None:
            out = out + offsets[g] * xg
    return _packed_output(out, bias, silu_and_mul, nr, out_features, x.shape[:-1])


def linear_packed_q6_a8(
    x: torch.Tensor,  # (..., K)
    packed: torch.Tensor,  # (P, K / 16, 13 NR) uint8 (kernels/cpu/linear_q6.pack_q6_weight)
    super_scales: torch.Tensor,  # (K / 256, P * NR) float32
    out_features: int,
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """Twin of kernels/cpu/linear_q6.linear_q6_a8 (W6A8), bit for bit: x quantized per block of
    32 (quantize_q8_blocks), exact integer dot products per chunk of 16 times the chunk's
    sub-scale, summed per block, then the float sums in linear_q6_a8.h's order, each one IEEE
    mul or add: A_s = sum_b float(I_b) * d_b, y = sum_s A_s * D_s, + bias."""
    from stoker.kernels.cpu.linear_q4 import Q8_BLOCK
    from stoker.kernels.cpu.linear_q6 import CHUNK, SUPER, unpack_q6_panels

    codes, sc = unpack_q6_panels(packed)  # (P, K, NR) q - 32, (P, K / 16, NR)
    num_panels, k, nr = codes.shape
    cols = num_panels * nr
    codes = codes.permute(1, 0, 2).reshape(k, cols)
    sc = sc.permute(1, 0, 2).reshape(k // CHUNK, cols)
    rows = x.reshape(-1, k).float()
    a, d = quantize_q8_blocks(rows, Q8_BLOCK)  # (M, K), (M, B)
    num_chunks = k // CHUNK
    # |T| <= 16 * 32 * 127 and |I| < 2^25: exact in float64; I rounded once to float32, as C's cvt
    t = torch.einsum("mck,ckn->mcn", a.double().view(-1, num_chunks, CHUNK), codes.double().view(num_chunks, CHUNK, -1))
    ints = (t * sc.double()).view(rows.shape[0], -1, 2, cols).sum(dim=2).float()  # (M, B, P * NR)
    blocks_per_super = SUPER // Q8_BLOCK
    out = torch.zeros(rows.shape[0], cols)
    for s in range(k // SUPER):
        acc = torch.zeros_like(out)
        for b in range(s * blocks_per_super, (s + 1) * blocks_per_super):
            acc = acc + ints[:, b] * d[:, b : b + 1]
        out = out + acc * super_scales[s]
    return _packed_output(out, bias, silu_and_mul, nr, out_features, x.shape[:-1])


def linear_packed_q4k_a8(
    x: torch.Tensor,  # (..., K)
    packed: torch.Tensor,  # (P, K, NR / 2) uint8 (kernels/cpu/linear_q4.pack_q4_weight)
    sub: torch.Tensor,  # (2, K / 32, P * NR) uint8 [sc; m]
    sup: torch.Tensor,  # (2, K / 256, P * NR) float32 [d; dmin]
    group_k: int,  # 32
    out_features: int,
    bias: torch.Tensor | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """Twin of kernels/cpu/linear_q4.linear_q4k_a8 (Q4_K's own bytes, W4A8), bit for bit: x
    quantized per block of 32 (quantize_q8_blocks), exact integer dot products per group times
    its sc, then linear_q4k_a8.h's float order, each one IEEE mul or add:
    A_s = sum_g float(I_g sc_g) * d_g, B_s = sum_g float(m_g) * X_g (X_g = d_g * float(S_g)),
    y = y + A_s * D_s, y = y - B_s * Dmin_s, + bias."""
    from stoker.kernels.cpu.linear_q4 import Q4K_SUPER, Q8_BLOCK, unpack_q4_panels

    num_panels, k, half = packed.shape
    nr = 2 * half
    cols = num_panels * nr
    codes = unpack_q4_panels(packed).permute(1, 0, 2).reshape(k, cols) + 8  # (K, P * NR) q in [0, 15]
    rows = x.reshape(-1, k).float()
    a, d = quantize_q8_blocks(rows, Q8_BLOCK)  # (M, K), (M, G)
    groups = k // Q8_BLOCK
    # |I sc| <= 32 * 15 * 127 * 63 < 2^22: exact in float64, and in float32 after
    ints = torch.einsum("mgk,gkn->mgn", a.double().view(-1, groups, Q8_BLOCK), codes.double().view(groups, Q8_BLOCK, -1))
    ints = (ints * sub[0].double()).float()  # (M, G, P * NR)
    sums = a.view(-1, groups, Q8_BLOCK).sum(dim=2, dtype=torch.int32).float()  # (M, G)
    xg = d * sums  # X_g
    mins = sub[1].float()
    per = Q4K_SUPER // Q8_BLOCK
    out = torch.zeros(rows.shape[0], cols)
    for s in range(k // Q4K_SUPER):
        acc_a, acc_b = torch.zeros_like(out), torch.zeros_like(out)
        for g in range(s * per, (s + 1) * per):
            acc_a = acc_a + ints[:, g] * d[:, g : g + 1]
            acc_b = acc_b + mins[g] * xg[:, g : g + 1]
        out = out + acc_a * sup[0, s]
        out = out - acc_b * sup[1, s]
    return _packed_output(out, bias, silu_and_mul, nr, out_features, x.shape[:-1])


def int4_linear(
    x: torch.Tensor,  # (..., K)
    q: torch.Tensor,  # (N, K) uint8 codes in [0, 15]
    scale: torch.Tensor,  # (N, G) float32
    offset: torch.Tensor,  # (N, G) float32
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # (..., N)
    """W4A16 where no kernel serves the device: dequantize as quantization/int4.dequantize
    does (q * s, rounded, + o, rounded; one layer per call), cast to x's dtype, F.linear."""
    w = q.float() * scale.float().repeat_interleave(group_k, dim=1) + offset.float().repeat_interleave(group_k, dim=1)
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def w4a16_linear(
    x: torch.Tensor,  # (..., K)
    qweight: torch.Tensor,  # (N, K / 2) uint8, even k in the low nibble (quantization/int4.pack)
    scale: torch.Tensor,  # (N, G) float16 / float32
    offset: torch.Tensor | None,  # (N, G) float32 o' = o + 8 s, or None (symmetric)
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # (..., N)
    """Twin of kernels/w4a16_linear.py: w = (q - 8) * s (+ o') in float32, cast to x's dtype,
    then the product in float32 (x's dtype for float32 x), rounded once to x's dtype."""
    out = x.float() @ dequant_w4(qweight, scale, offset, group_k, x.dtype).float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def dequant_w4(
    qweight: torch.Tensor,  # (N, K / 2) uint8, even k in the low nibble
    scale: torch.Tensor,  # (N, G) float16 / float32
    offset: torch.Tensor | None,  # (N, G) float32 o', or None
    group_k: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # (N, K)
    """Twin of quant_gemv.dequant_w4: w = (q - 8) * s (+ o') in float32, rounded to `dtype`
    (the weight `w4a16_linear` below multiplies by)."""
    k = 2 * qweight.shape[1]
    codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(qweight.shape[0], k)

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.float().repeat_interleave(group_k, dim=1)[:, :k]

    w = (codes.float() - 8.0) * per_column(scale)
    if offset is not None:
        w = w + per_column(offset)
    return w.to(dtype)


def _grouped_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_k: int) -> torch.Tensor:
    """float32 (M, N): sum over groups g of s[:, g] * (x_g @ q_g^T), with x and q float32."""
    k = q.shape[1]
    groups = scale.shape[1]
    width = group_k if groups > 1 else k
    pad = groups * width - k  # a short last group
    xg = F.pad(x, (0, pad)).reshape(-1, groups, width)
    qg = F.pad(q, (0, pad)).reshape(q.shape[0], groups, width)
    return torch.einsum("mgk,ngk->mng", xg, qg).mul(scale.float()[None]).sum(-1)


def gemv_w4(
    x: torch.Tensor,  # (..., K)
    qweight: torch.Tensor,  # (N, K / 2) uint8, even k in the low nibble
    scale: torch.Tensor,  # (N, G) float16 / float32
    offset: torch.Tensor | None,  # (N, G) float32 o', or None
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # (..., N)
    """Twin of quant_gemv.gemv_w4: in float32, per row and group, s * sum((q - 8) * x) + o' * sum(x),
    the groups summed, + bias, rounded once to x's dtype. The weight is never formed, so never
    rounded to x's dtype (w4a16_linear above rounds it: the two agree to float32 accumulation
    for float32 x, to x's rounding of the weight for 16-bit x)."""
    k = 2 * qweight.shape[1]
    codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(qweight.shape[0], k).float() - 8.0
    rows = x.reshape(-1, k).float()
    out = _grouped_gemv(rows, codes, scale, group_k)
    if offset is not None:
        groups = scale.shape[1]
        out = out + rows.reshape(rows.shape[0], groups, -1).sum(-1) @ offset.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])


def gemv_w8(
    x: torch.Tensor,  # (..., K)
    qweight: torch.Tensor,  # (N, K) int8 / float8_e4m3fn
    scale: torch.Tensor,  # (N, G) float32
    group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # (..., N)
    """Twin of quant_gemv.gemv_w8: in float32, per row and group, s * sum(q * x), the groups
    summed, + bias, rounded once to x's dtype (w8_linear above rounds q * s to x's dtype first)."""
    k = qweight.shape[1]
    rows = x.reshape(-1, k).float()
    out = _grouped_gemv(rows, qweight.float(), scale, group_k)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])


def mla_decode_attention(
    query: torch.Tensor,  # (B, H, kv_lora_rank + rope): the W_UK-absorbed nope part, then q_pe
    latent_cache: torch.Tensor,  # (num_blocks, block_size, 1, kv_lora_rank + rope): [latent | k_pe] rows
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    context_lens: torch.Tensor,  # (B,) int32
    kv_lora_rank: int,
    scale: float,
    k_scale: float = 1.0,  # FP8 caches: a row element is e4m3 value x k_scale
) -> torch.Tensor:  # (B, H, kv_lora_rank) float32
    """Absorbed MLA decode (twin of kernels/cpu/mla_decode_attention.c and the Triton
    kernels/mla_decode_attention.py): each sequence's heads attend over its latent rows as keys
    (all values) and values (the first kv_lora_rank)."""
    b, h, width = query.shape
    out = torch.zeros(b, h, kv_lora_rank, dtype=torch.float32, device=query.device)
    bs = latent_cache.shape[1]
    for i, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        blocks = block_tables[i, : -(-n // bs)].long()
        rows = dequantize_kv(latent_cache[blocks].reshape(-1, width)[:n], k_scale, torch.float32)  # (L, width)
        probs = torch.softmax((query[i].float() @ rows.T) * scale, dim=-1)  # (H, L)
        out[i] = probs @ rows[:, :kv_lora_rank]
    return out
