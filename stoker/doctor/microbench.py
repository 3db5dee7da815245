"""CPU microbenchmarks behind the device file and the on-machine step prediction.

Each returns a median over timed repetitions after warm-up (the machine is shared: medians,
not means). The kernels are the CPU engine's own (kernels/cpu: packed-panel linear, paged
attention), called directly at the model's shapes, never the engine's step:

    stream_read_bytes_per_s(num_bytes)    a sum over a float32 buffer: reads each byte once (a copy
                                          also writes, and doubles what it counts)
    gemv_read_bytes_per_s(num_bytes)      the engine's linear kernel at one row over a num_bytes
                                          weight: a GEMV's weight stream, the read decode does
    matmul_flops(n, dtype)                dense n^3 matmul through torch (MKL/oneDNN)
    projection_chain_s(spec, tokens)      every layer's qkv/o/gate_up/down, distinct weights per
                                          layer (the step's working set), M = tokens rows
    decode_attention_s / prefill_attention_s   the paged attention kernels over all layers
    row_ops_s(spec, tokens)               the layers' row-wise kernels and activation copies
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from stoker.roofline.modelspec import ModelSpec


def median_s(fn: Callable[[], Any], iters: int, warmup: int = 2, before: Callable[[], Any] | None = None) -> float:
    """Median seconds of fn(); `before` runs untimed ahead of every call (a cache flush)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Larger than this VM's last-level cache (260 MiB of L3, shared with the host): reading it
# leaves none of a microbenchmark's own data cached.
FLUSH_BYTES = 512 << 20


def cache_flusher(num_bytes: int = FLUSH_BYTES) -> Callable[[], Any]:
    """A call that evicts the caches by reading num_bytes: in an engine step a layer's KV cache
    was last read a whole step ago, with the step's weights and every other layer's KV streamed
    since, so it comes from memory; repeated back to back, a microbenchmark's ~100 MB of KV
    would be partly served from the L3 instead (decode attention ran ~25% faster than in the
    steps at 2 threads that way)."""
    import torch

    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    return buffer.sum


def stream_read_bytes_per_s(num_bytes: int, iters: int = 10) -> float:
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    return x.numel() * 4 / median_s(x.sum, iters)


def gemv_read_bytes_per_s(num_bytes: int, iters: int = 10, k: int = 4096) -> float | None:
    """Weight bytes / time of x (1, K) @ W^T with W (num_bytes / 4K, K) packed (None without the C kernels)."""
    import torch

    from stoker.kernels.cpu import build
    from stoker.kernels.cpu import linear as cpu_linear

    if not build.available():
        return None
    n = max(cpu_linear.panel_width(), num_bytes // (4 * k) // cpu_linear.panel_width() * cpu_linear.panel_width())
    w = cpu_linear.pack_linear_weight(torch.ones(n, k))
    x = torch.ones(1, k)
    return n * k * 4 / median_s(lambda: cpu_linear.linear(x, w, n), iters)


def matmul_flops(n: int, dtype_name: str = "float32", iters: int = 10) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    return 2 * n**3 / median_s(lambda: torch.matmul(a, b), iters)


def _projection_weights(spec: ModelSpec) -> list[tuple[Any, int, bool]]:
    """(packed weight, out_features, fused silu-and-mul) for every layer's projections, in the
    order the forward runs them: (L x 4) distinct matrices, (ceil(N / NR), K, NR) panels each."""
    import torch

    from stoker.kernels.cpu import linear as cpu_linear

    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    shapes = [(q + 2 * kv, h, False), (h, q, False), (2 * i, h, cpu_linear.gate_up_fusable(i)), (h, i, False)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(spec.num_layers):
        for n, k, fused in shapes:
            w = torch.randn(n, k, generator=gen) * k**-0.5
            out.append((cpu_linear.pack_linear_weight(w, gate_up=fused), n, fused))
    return out


class ProjectionChain:
    """The model's projection weights, built once, timed at any number of rows."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.weights = _projection_weights(spec)

    def seconds(self, tokens: int, iters: int) -> float:
        import torch

        from stoker.kernels.cpu import linear as cpu_linear

        gen = torch.Generator().manual_seed(1)
        xs = {k: torch.randn(tokens, k, generator=gen) for k in {w.shape[1] for w, _, _ in self.weights}}

        def chain() -> None:
            for w, n, fused in self.weights:
                cpu_linear.linear(xs[w.shape[1]], w, n, None, fused)

        return median_s(chain, iters, warmup=1 if tokens >= 512 else 2)


def _paged_caches(spec: ModelSpec, num_seqs: int, context_len: int, block_size: int = 16) -> tuple[list, Any]:
    """Per layer (k, v) caches holding num_seqs x context_len tokens in distinct blocks, and the
    (num_seqs, blocks per seq) block table."""
    import torch

    per_seq = -(-context_len // block_size)
    shape = (num_seqs * per_seq, block_size, spec.num_kv_heads, spec.head_dim)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(spec.num_layers)]
    table = torch.arange(num_seqs * per_seq, dtype=torch.int32).view(num_seqs, per_seq)
    return caches, table


def decode_attention_s(spec: ModelSpec, num_seqs: int, context_len: int, iters: int, flush: bool = False) -> float:
    """All layers' decode attention: one query token per sequence over its whole context (with
    `flush`, from cold caches, as in a step)."""
    import torch

    from stoker.kernels.cpu import paged_decode_attention as cpu_decode

    caches, table = _paged_caches(spec, num_seqs, context_len)
    q = torch.randn(num_seqs, spec.num_heads, spec.head_dim)
    lens = torch.full((num_seqs,), context_len, dtype=torch.int32)
    scale = spec.head_dim**-0.5

    def run() -> None:
        for k, v in caches:
            cpu_decode.paged_decode_attention(q, k, v, table, lens, scale)

    return median_s(run, iters, before=cache_flusher() if flush else None)


def prefill_attention_s(spec: ModelSpec, prompt_len: int, iters: int) -> float:
    """All layers' causal attention of one fresh prompt of prompt_len tokens."""
    import torch

    from stoker.kernels.cpu import prefill_attention as cpu_prefill

    caches, table = _paged_caches(spec, 1, prompt_len)
    q = torch.randn(prompt_len, spec.num_heads, spec.head_dim)
    scale = spec.head_dim**-0.5

    def run() -> None:
        for k, v in caches:
            cpu_prefill.paged_attention(q, k, v, table, [0, prompt_len], [prompt_len], scale)

    return median_s(run, iters, warmup=1)


def row_ops_s(spec: ModelSpec, tokens: int, iters: int) -> float:
    """All layers' row-wise work at `tokens` rows, as the layer forward does it: residual-add +
    RMSNorm on (T, hidden), q and k split from the qkv projection's output (T, q + 2 kv) and
    rotated (strided views in, new (T, H, D) and (T, Hkv, D) out), K/V stored into a paged cache,
    the attention output copied into the layer's (T, H, D) buffer (prefill's `out[nd:] = ...`;
    decode returns the kernel's own: <= 64 x q_dim floats a layer at the sweep's batches, ~1% of
    this term there), the second residual-add + RMSNorm; and the token embeddings' gather once.
    Every layer has its own buffers, as in the step: the 8 layers' activations (~28 MB a layer at
    2048 tokens) are not the cache-resident pair a loop over one layer's would be."""
    import torch

    from stoker.kernels.cpu import elementwise as cpu_elementwise
    from stoker.kernels.cpu import store_kvcache as cpu_store

    h, d, q_dim, kv_dim = spec.hidden_size, spec.head_dim, spec.q_dim, spec.kv_dim
    gen = torch.Generator().manual_seed(2)
    pos = torch.arange(tokens, dtype=torch.int64)
    ids = (pos * 7) % spec.vocab_size
    embed = torch.randn(spec.vocab_size, h, generator=gen)
    cos_sin = torch.randn(tokens, d, generator=gen)
    w = torch.ones(h)
    caches, _ = _paged_caches(spec, 1, tokens)
    layers = [{"x": torch.randn(tokens, h, generator=gen), "res": torch.randn(tokens, h, generator=gen),
               "qkv": torch.randn(tokens, q_dim + 2 * kv_dim, generator=gen),
               "attn": torch.randn(tokens, spec.num_heads, d, generator=gen),
               "o": torch.randn(tokens, h, generator=gen)} for _ in range(spec.num_layers)]

    def run() -> None:
        torch.nn.functional.embedding(ids, embed)
        for (kc, vc), b in zip(caches, layers):
            _, res = cpu_elementwise.fused_add_rms_norm(b["x"], b["res"], w, 1e-6)
            q, k, v = b["qkv"].split([q_dim, kv_dim, kv_dim], dim=-1)
            q, k = cpu_elementwise.rotary_embedding(pos, q.reshape(tokens, spec.num_heads, d),
                                                    k.reshape(tokens, spec.num_kv_heads, d), cos_sin)
            cpu_store.store_kvcache(k, v.reshape(tokens, spec.num_kv_heads, d), kc, vc, pos)
            out = torch.empty_like(q)
            out[:] = b["attn"]
            cpu_elementwise.fused_add_rms_norm(b["o"], res, w, 1e-6)
        cpu_elementwise.fused_add_rms_norm(layers[-1]["o"], layers[-1]["res"], w, 1e-6)  # the final norm

    return median_s(run, iters)
