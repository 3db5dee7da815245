"""CPU kernels against their peers, op by op, on issue 2's benchmark shapes (float32).

- decode attention: the C kernel vs the torch twin (gather through the block table + SDPA);
  64 sequences, contexts uniform in [40, 380), 8 heads / 4 KV heads, head_dim 64, block 16.
  "hot": one layer's cache, reused call after call (it stays in the CPU caches);
  "cold": 8 layers' caches (~200 MB), one per call in turn, as an engine step reads them.
- prefill attention: the C kernel vs the twin (SDPA per sequence), one prefill step's prompts.
- row ops: the C kernels vs the twins at prefill (2048 rows) and decode (64 rows) sizes.
- projection GEMMs: Stoker's C linear kernel on packed panels (what the CPU runner uses) vs
  MKL through `F.linear` with the weight row-major (as loaded) and column-major (the runner's
  layout when the C kernels are off), plus oneDNN's packed linear, at decode and prefill M;
  and for the MLP's [gate; up] projection, the C kernel with SiLU-and-mul fused vs MKL
  followed by the C SiLU-and-mul kernel.

Medians of repeated calls; each peer measured side by side in one process.
Usage: python benchmarks/cpu_kernels.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stoker.kernels import reference  # noqa: E402
from stoker.kernels.cpu import build  # noqa: E402
from stoker.kernels.cpu import elementwise as cpu_elementwise  # noqa: E402
from stoker.kernels.cpu import linear as cpu_linear  # noqa: E402
from stoker.kernels.cpu import paged_decode_attention as cpu_decode  # noqa: E402
from stoker.kernels.cpu import prefill_attention as cpu_prefill  # noqa: E402


def median_ms(fn: Callable[[], object], repeats: int = 50) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def decode_attention() -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, num_heads, head_dim, num_seqs, max_blocks, layers = 16, 4, 8, 64, 64, 24, 8
    num_blocks = num_seqs * max_blocks * layers
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    context_lens = torch.randint(40, 380, (num_seqs,), generator=gen, dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen).view(layers, num_seqs, max_blocks).int().contiguous()
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out: dict[str, float] = {}
    for name, fn in (("twin", reference.paged_decode_attention), ("c_kernel", cpu_decode.paged_decode_attention)):
        out[f"{name}_hot_ms"] = median_ms(lambda f=fn: f(query, k_cache, v_cache, tables[0], context_lens, scale))

        def one_step(f=fn) -> None:  # all 8 layers in turn
            for layer in range(layers):
                f(query, k_cache, v_cache, tables[layer], context_lens, scale)

        out[f"{name}_cold_ms"] = median_ms(one_step, repeats=15) / layers
    kv_bytes = int(context_lens.sum()) * num_kv_heads * head_dim * 4 * 2
    out["kv_mb_per_call"] = kv_bytes / 1e6
    out["c_kernel_cold_gb_per_s"] = kv_bytes / out["c_kernel_cold_ms"] / 1e6
    return out


def prefill_attention() -> dict[str, float]:
    """One prefill step's attention for one layer: 13 whole prompts (lengths uniform in
    [32, 256], ~1,900 tokens, as a step of the issue-2 run), nothing cached."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, num_heads, head_dim = 16, 4, 8, 64
    lens = torch.randint(32, 257, (13,), generator=gen).tolist()
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    offset = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = ids[offset : offset + nb]
        offset += nb
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out: dict[str, float] = {"tokens": float(cu[-1])}
    for name, fn in (("twin", reference.paged_attention), ("c_kernel", cpu_prefill.paged_attention)):
        out[f"{name}_ms"] = median_ms(lambda f=fn: f(query, k_cache, v_cache, tables, cu, lens, scale), repeats=20)
    flops = sum(4 * n * (n + 1) / 2 * head_dim * num_heads for n in lens)  # QK^T and PV, causal
    out["c_kernel_gflops"] = flops / out["c_kernel_ms"] / 1e6
    out["twin_gflops"] = flops / out["twin_ms"] / 1e6
    return out


def row_ops() -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    out: dict[str, float] = {}
    for rows in (64, 2048):
        x = torch.randn(rows, 512, generator=gen)
        residual = torch.randn(rows, 512, generator=gen)
        weight = torch.randn(512, generator=gen)
        gate_up = torch.randn(rows, 2 * 1408, generator=gen)
        qkv = torch.randn(rows, 1024, generator=gen)
        q, k = qkv[:, :512].view(rows, 8, 64), qkv[:, 512:768].view(rows, 4, 64)
        positions = torch.randint(0, 512, (rows,), generator=gen)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        freqs = torch.arange(1024, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        for impl in (reference, cpu_elementwise):
            tag = "twin" if impl is reference else "c_kernel"
            out[f"add_rms_norm_{rows}_{tag}_us"] = 1e3 * median_ms(lambda i=impl: i.fused_add_rms_norm(x, residual, weight, 1e-5))
            out[f"silu_and_mul_{rows}_{tag}_us"] = 1e3 * median_ms(lambda i=impl: i.silu_and_mul(gate_up))
            out[f"rotary_{rows}_{tag}_us"] = 1e3 * median_ms(lambda i=impl: i.rotary_embedding(positions, q, k, cos_sin))
    return out


def gemms() -> dict[str, float]:
    gen = torch.Generator().manual_seed(2)
    out: dict[str, float] = {}
    for in_features, out_features in ((512, 2816), (1408, 512)):
        weight = torch.randn(out_features, in_features, generator=gen)
        column_major = weight.t().contiguous().t()
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        panels = cpu_linear.pack_linear_weight(weight)
        gate_up = cpu_linear.pack_linear_weight(weight, gate_up=True) if in_features == 512 else None
        for m in (1, 8, 16, 32, 64, 2048):
            x = torch.randn(m, in_features, generator=gen)
            key = f"{in_features}x{out_features}_m{m}"
            out[f"{key}_stoker_packed_ms"] = median_ms(lambda: cpu_linear.linear(x, panels, out_features))
            out[f"{key}_row_major_ms"] = median_ms(lambda: torch.nn.functional.linear(x, weight))
            out[f"{key}_column_major_ms"] = median_ms(lambda: torch.nn.functional.linear(x, column_major))
            out[f"{key}_onednn_packed_ms"] = median_ms(
                lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
            )
            if gate_up is not None:
                out[f"{key}_gate_up_stoker_fused_silu_ms"] = median_ms(
                    lambda: cpu_linear.linear(x, gate_up, out_features, silu_and_mul=True)
                )
                out[f"{key}_gate_up_mkl_then_silu_ms"] = median_ms(
                    lambda: cpu_elementwise.silu_and_mul(torch.nn.functional.linear(x, column_major))
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not build.available():
        sys.exit("the C kernels are not available here (no compiler, or STOKER_DISABLE_CPU_KERNELS set)")
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "decode_attention": decode_attention(),
        "prefill_attention": prefill_attention(),
        "row_ops": row_ops(),
        "gemms": gemms(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
