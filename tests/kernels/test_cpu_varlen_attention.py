"""kernels/cpu/prefill_attention.varlen_attention (prefill_attention.c over packed sequences,
block_size 1, no padding) against SDPA run on each sequence alone: bidirectional (encoders) and
causal (decoder embedding models), with GQA, and the pooling layer choosing it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from stoker.kernels.cpu import prefill_attention as cpu_prefill
from stoker.pooling.attention import VarlenAttention, VarlenBatch, varlen_attention, varlen_batch

if not shutil.which("cc") and not shutil.which("gcc"):
    pytest.skip("no C compiler: the CPU kernels are not built here (SDPA runs instead)", allow_module_level=True)


def per_sequence(q, k, v, lengths, scale, causal):
    out, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        o = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                                           scale=scale, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
def test_varlen_attention_equals_sdpa_per_sequence(causal: bool, heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(heads + causal)
    lengths = [5, 1, 70, 33, 130]  # around the kernel's 64-row query chunks and its key panels
    num_tokens, head_dim = sum(lengths), 32
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    batch = VarlenBatch.build(lengths, torch.device("cpu"))
    got = cpu_prefill.varlen_attention(q, k, v, batch.token_table, batch.cu_tensor, batch.lengths, 0.2, causal)
    want = per_sequence(q, k, v, lengths, 0.2, causal)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # and the padded SDPA path the layer falls back to agrees with both
    torch.testing.assert_close(varlen_attention(q, k, v, batch, 0.2, causal), want, rtol=1e-4, atol=1e-5)


def test_the_layer_picks_the_kernel_on_cpu_float32_only() -> None:
    lengths = [3, 9]
    q = torch.randn(12, 2, 32)
    layer = VarlenAttention(2, 2, 32, 0.3, causal=False)
    with varlen_batch(VarlenBatch.build(lengths, torch.device("cpu"))):
        out = layer(q, q, q)
    assert layer.use_kernel is True
    torch.testing.assert_close(out, per_sequence(q, q, q, lengths, 0.3, False), rtol=1e-4, atol=1e-5)
    double = VarlenAttention(2, 2, 32, 0.3, causal=False)
    with varlen_batch(VarlenBatch.build(lengths, torch.device("cpu"))):
        double(q.double(), q.double(), q.double())
    assert double.use_kernel is False


@pytest.mark.parametrize("heads, head_dim", [(4, 32), (12, 16)])
def test_encoder_attention_reads_qkv_in_place(heads: int, head_dim: int) -> None:
    """An encoder's fused projection (T, 3, H, D) straight into the kernel, no q/k/v copies; the
    lengths sit around the vector width (a short row's softmax runs as whole masked vectors)
    and the 64-key panels."""
    gen = torch.Generator().manual_seed(heads)
    lengths = [1, 5, 12, 16, 17, 64, 65, 130]
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=gen)
    batch = VarlenBatch.build(lengths, torch.device("cpu"))
    got = cpu_prefill.encoder_attention(qkv, batch.token_table, batch.cu_tensor, batch.lengths, 0.3)
    want = per_sequence(qkv[:, 0], qkv[:, 1], qkv[:, 2], lengths, 0.3, False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_encoder_attention_refuses_tables_that_disagree() -> None:
    qkv = torch.randn(10, 3, 2, 32)
    batch = VarlenBatch.build([4, 6], torch.device("cpu"))
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the 9 tokens"):
        cpu_prefill.encoder_attention(qkv[:9], batch.token_table, batch.cu_tensor, batch.lengths, 0.3)
    with pytest.raises(ValueError, match=r"contiguous float32 \(T, 3, H, D\)"):
        cpu_prefill.encoder_attention(qkv.double(), batch.token_table, batch.cu_tensor, batch.lengths, 0.3)
    with pytest.raises(ValueError, match="disagree on the number of sequences"):
        cpu_prefill.encoder_attention(qkv, batch.token_table[:1], batch.cu_tensor, batch.lengths, 0.3)
