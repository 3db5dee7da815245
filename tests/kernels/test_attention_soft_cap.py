"""Attention logit soft-capping (Gemma 2's attn_logit_softcapping): each score s = q.k x scale
becomes cap x tanh(s / cap) before the mask and the softmax. The torch twins are checked against
that definition written densely per sequence (prefill chunks after cached context, decode, GQA,
a sliding window), the C kernels (float32 and FP8 caches, the generic and the 16-wide decode
loops) and the Triton kernels (interpreter, split decode) against the twins. Queries are scaled
up so that scores reach several times the cap: without capping the outputs differ (checked)."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import reference
from stoker.kernels.cpu import build
from tests.kernels.paged_cases import assert_close, make_paged_batch, poisoned_like

CAP = 2.0
LENS, Q_LENS, CU = [1, 13, 30, 21], [1, 13, 5, 1], [0, 1, 14, 19, 20]


def dense(q, keys, values, q_pos, window, scale, cap):  # q (n, H, D), keys (L, Hkv, D) -> (n, H, D)
    h, hkv = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(h // hkv, dim=1)
    v = values.double().repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale  # (H, n, L)
    scores = cap * torch.tanh(scores / cap)
    k_pos = torch.arange(keys.shape[0])
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).float()


def case(head_dim: int, seed: int, heads: int = 4, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(seed)
    batch = make_paged_batch(LENS, kv_heads, head_dim, 8, torch.float32, "cpu", gen)
    q = torch.randn(sum(Q_LENS), heads, head_dim, generator=gen) * 4  # scores of several caps
    qd = torch.randn(len(LENS), heads, head_dim, generator=gen) * 4
    return batch, q, qd


@pytest.mark.parametrize("window", [None, 7])
def test_the_twins_soft_cap_as_the_definition(window) -> None:
    d = 16
    batch, q, qd = case(d, 1 + (window or 0))
    scale = d**-0.5
    out = reference.paged_attention(q, batch.k_ref, batch.v_ref, batch.block_tables, CU, LENS, scale, window,
                                    logits_soft_cap=CAP)
    dec = reference.paged_decode_attention(qd, batch.k_ref, batch.v_ref, batch.block_tables,
                                           batch.context_lens_tensor(), scale, window, logits_soft_cap=CAP)
    for s, (ctx, n) in enumerate(zip(LENS, Q_LENS)):
        keys = reference._gather_context(batch.k_ref, batch.block_tables[s:s + 1], ctx)[0]
        values = reference._gather_context(batch.v_ref, batch.block_tables[s:s + 1], ctx)[0]
        want = dense(q[CU[s]:CU[s + 1]], keys, values, torch.arange(ctx - n, ctx), window, scale, CAP)
        torch.testing.assert_close(out[CU[s]:CU[s + 1]], want, rtol=1e-5, atol=1e-5)
        want = dense(qd[s:s + 1], keys, values, torch.tensor([ctx - 1]), window, scale, CAP)
        torch.testing.assert_close(dec[s:s + 1], want, rtol=1e-5, atol=1e-5)
    uncapped = reference.paged_attention(q, batch.k_ref, batch.v_ref, batch.block_tables, CU, LENS, scale, window)
    assert (uncapped - out).abs().max() > 0.1, "the cap should bite on these scores"


@pytest.mark.skipif(not build.available(), reason="the C kernels did not build here")
@pytest.mark.parametrize("head_dim", [16, 64])  # the generic decode loop, and its 16-wide fast path
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_c_kernels_soft_cap_as_the_twins(head_dim, window, fp8) -> None:
    from stoker.kernels._common import FP8_KV_DTYPE
    from stoker.kernels.cpu import paged_decode_attention as cpu_decode
    from stoker.kernels.cpu import prefill_attention as cpu_prefill

    batch, q, qd = case(head_dim, head_dim + (window or 0) + fp8)
    k_cache, v_cache = batch.k_ref, batch.v_ref
    if fp8:
        k_cache, v_cache = k_cache.to(FP8_KV_DTYPE), v_cache.to(FP8_KV_DTYPE)
    scale = head_dim**-0.5
    kv = (k_cache, v_cache, batch.block_tables)
    if cpu_prefill.prefill_supported(q, k_cache):
        torch.testing.assert_close(cpu_prefill.paged_attention(q, *kv, CU, LENS, scale, window, logits_soft_cap=CAP),
                                   reference.paged_attention(q, *kv, CU, LENS, scale, window, logits_soft_cap=CAP),
                                   rtol=1e-5, atol=1e-5)
    ctx = batch.context_lens_tensor()
    torch.testing.assert_close(cpu_decode.paged_decode_attention(qd, *kv, ctx, scale, window, logits_soft_cap=CAP),
                               reference.paged_decode_attention(qd, *kv, ctx, scale, window, logits_soft_cap=CAP),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, num_splits", [(None, 1), (7, 2)])
def test_the_triton_kernels_soft_cap_as_the_twins(window, num_splits) -> None:
    pytest.importorskip("triton")
    from stoker.kernels import paged_decode_attention as decode_mod
    from stoker.kernels import paged_prefill_attention as prefill_mod

    d = 16
    batch, q, qd = case(d, 5 + (window or 0))
    scale = d**-0.5
    out = prefill_mod.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, CU, LENS, scale, window,
                                      out=poisoned_like(q), logits_soft_cap=CAP)
    ref = reference.paged_attention(q, batch.k_ref, batch.v_ref, batch.block_tables, CU, LENS, scale, window,
                                    logits_soft_cap=CAP)
    assert_close(out, ref, 1e-5, "prefill")
    ctx = batch.context_lens_tensor()
    out = decode_mod.paged_decode_attention(qd, batch.k_cache, batch.v_cache, batch.block_tables, ctx, scale, window,
                                            out=poisoned_like(qd), num_splits=num_splits, logits_soft_cap=CAP)
    ref = reference.paged_decode_attention(qd, batch.k_ref, batch.v_ref, batch.block_tables, ctx, scale, window,
                                           logits_soft_cap=CAP)
    assert_close(out, ref, 1e-5, "decode")
