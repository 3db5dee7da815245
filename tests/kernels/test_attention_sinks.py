"""Attention sinks (gpt-oss): each head's sink is one more logit in the softmax's denominator,
with no value. The torch twins are checked against the definition written densely per sequence
(prefill chunks after cached context, decode, GQA, a sliding window; a sink of -inf gives the
sinkless attention), the C kernels against the twins (float32 and FP8 caches)."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import reference
from stoker.kernels.cpu import build
from tests.kernels.paged_cases import make_paged_batch


def dense(q, keys, values, q_pos, window, scale, sinks):  # q (n, H, D), keys (L, Hkv, D) -> (n, H, D)
    h, hkv = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(h // hkv, dim=1)
    v = values.double().repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale  # (H, n, L)
    k_pos = torch.arange(keys.shape[0])
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    full = torch.cat([scores, sinks.double()[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    probs = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, v).float()


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_prefill_and_decode_with_sinks_match_the_definition(window, heads, kv_heads) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + (window or 0))
    d, bs, lens, q_lens = 16, 8, [1, 13, 30, 21], [1, 13, 5, 1]
    batch = make_paged_batch(lens, kv_heads, d, bs, torch.float32, "cpu", gen)
    sinks = torch.randn(heads, generator=gen)
    scale = d**-0.5
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    out = reference.paged_attention(q, batch.k_ref, batch.v_ref, batch.block_tables, cu, lens, scale, window,
                                    sinks=sinks)
    for s, (ctx, n) in enumerate(zip(lens, q_lens)):
        keys = reference._gather_context(batch.k_ref, batch.block_tables[s:s + 1], ctx)[0]
        values = reference._gather_context(batch.v_ref, batch.block_tables[s:s + 1], ctx)[0]
        want = dense(q[cu[s]:cu[s + 1]], keys, values, torch.arange(ctx - n, ctx), window, scale, sinks)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]], want, rtol=1e-5, atol=1e-5)
    # decode: one query per sequence, at its last position
    qd = torch.randn(len(lens), heads, d, generator=gen)
    out = reference.paged_decode_attention(qd, batch.k_ref, batch.v_ref, batch.block_tables,
                                           batch.context_lens_tensor(), scale, window, sinks=sinks)
    for s, ctx in enumerate(lens):
        keys = reference._gather_context(batch.k_ref, batch.block_tables[s:s + 1], ctx)[0]
        values = reference._gather_context(batch.v_ref, batch.block_tables[s:s + 1], ctx)[0]
        want = dense(qd[s:s + 1], keys, values, torch.tensor([ctx - 1]), window, scale, sinks)
        torch.testing.assert_close(out[s:s + 1], want, rtol=1e-5, atol=1e-5)


def test_a_sink_of_minus_infinity_is_no_sink() -> None:
    gen = torch.Generator().manual_seed(3)
    lens = [9, 20]
    batch = make_paged_batch(lens, 2, 16, 8, torch.float32, "cpu", gen)
    q = torch.randn(sum(lens), 4, 16, generator=gen)
    args = (q, batch.k_ref, batch.v_ref, batch.block_tables, [0, 9, 29], lens, 0.25, None)
    torch.testing.assert_close(reference.paged_attention(*args, sinks=torch.full((4,), float("-inf"))),
                               reference.paged_attention(*args), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not build.available(), reason="the C kernels did not build here")
@pytest.mark.parametrize("head_dim", [16, 64])  # the generic decode loop, and its 16-wide fast path
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_c_kernels_take_sinks_as_the_twins(head_dim, window, fp8) -> None:
    from stoker.kernels._common import FP8_KV_DTYPE
    from stoker.kernels.cpu import paged_decode_attention as cpu_decode
    from stoker.kernels.cpu import prefill_attention as cpu_prefill

    gen = torch.Generator().manual_seed(head_dim + (window or 0) + fp8)
    heads, kv_heads, bs, lens, q_lens = 4, 2, 8, [1, 13, 30, 21], [1, 13, 5, 1]
    batch = make_paged_batch(lens, kv_heads, head_dim, bs, torch.float32, "cpu", gen)
    k_cache, v_cache = batch.k_ref, batch.v_ref
    if fp8:
        k_cache, v_cache = k_cache.to(FP8_KV_DTYPE), v_cache.to(FP8_KV_DTYPE)
    sinks = torch.randn(heads, generator=gen) * 2
    scale = head_dim**-0.5
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen)
    cu = [0, 1, 14, 19, 20]
    kv = (k_cache, v_cache, batch.block_tables)
    if cpu_prefill.prefill_supported(q, k_cache):
        torch.testing.assert_close(cpu_prefill.paged_attention(q, *kv, cu, lens, scale, window, sinks=sinks),
                                   reference.paged_attention(q, *kv, cu, lens, scale, window, sinks=sinks),
                                   rtol=1e-5, atol=1e-5)
    qd = torch.randn(len(lens), heads, head_dim, generator=gen)
    ctx = batch.context_lens_tensor()
    torch.testing.assert_close(cpu_decode.paged_decode_attention(qd, *kv, ctx, scale, window, sinks=sinks),
                               reference.paged_decode_attention(qd, *kv, ctx, scale, window, sinks=sinks),
                               rtol=1e-5, atol=1e-5)
