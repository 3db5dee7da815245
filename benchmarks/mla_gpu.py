"""MBU of the Triton absorbed MLA decode attention at DeepSeek-V3's latent shape, beside its torch twin.

    python benchmarks/mla_gpu.py                          # batch 1, 8, 64 x context 1024, 4096,
                                                          # bf16 and FP8 latent caches; needs a GPU
    python benchmarks/mla_gpu.py --batch 1 64 --context 4096 --cache bf16 --json mla.json
    python benchmarks/mla_gpu.py --smoke                  # tiny shapes on CPU via the interpreter:
                                                          # exercises this script, times nothing useful

Shape (DeepSeek-V3): 128 query heads, kv_lora_rank 512, qk_rope_head_dim 64, so every cached
token is one 576-wide row [latent | rotated k_pe] shared by all heads; the query is the absorbed
one (W_UK folded in): (B, 128, 576) bf16. The cache is paged as the engine holds it:
(num_blocks, 16, 1, 576), block size 16 (CacheConfig's default), each sequence's blocks a random
permutation of the pool (scattered, as in a cache that has run a while), every sequence at the
full context. Softmax scale 192^-0.5 (qk_nope 128 + rope 64; V3's YaRN mscale only rescales it).
`--cache fp8`: the same rows as float8_e4m3fn with one k_scale (amax / 448), the kernel's FP8 path.

Rows, at each batch x context x cache:
  triton     kernels/mla_decode_attention.py (what the MLA layers run on CUDA), its split count
             chosen by pick_num_splits as in the engine (column `splits`)
  torch twin reference.mla_decode_attention on the same inputs: a per-sequence torch loop
             (gather the rows, dequantize, float32 matmuls and softmax), what runs without Triton
Time: the median of one call, triton.testing.do_bench (CUDA events; L2 flushed between calls);
`first s` is the wall time of the triton row's first call (its compile where not cached). Bytes
that must move: the latent rows (B x context x 576 x 2 bytes, 1 for FP8: the `cache GB` column),
the query, the block table and the float32 output written; GB/s = bytes / time and MBU = GB/s /
peak HBM bandwidth (stoker/roofline/hardware.py's figure for the device torch names;
--peak-gb-s overrides it). The kernel reads each row once per 16-head program (8 times at 128
heads), the repeats meant to hit L2: MBU counts each byte once. Before timing, the kernel's
output is compared with the twin's: the max abs error is printed beside the twin's max abs value.
Without CUDA (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.moe_gpu import bench, peak_gb_per_s  # noqa: E402
from stoker.kernels import reference  # noqa: E402
from stoker.kernels._common import FP8_KV_DTYPE, FP8_MAX  # noqa: E402

NUM_HEADS, KV_LORA_RANK, ROPE = 128, 512, 64
QK_HEAD_DIM = 128 + ROPE  # qk_nope_head_dim + qk_rope_head_dim: the softmax scale's
BLOCK_SIZE = 16  # CacheConfig.block_size's default
SMOKE = dict(heads=16, rank=64, rope=16, batch=[1, 2], context=[32, 300])  # 300: split in 2 (the reduce runs)


@dataclass
class Row:
    cache: str  # bf16 | fp8
    batch: int
    context: int
    impl: str
    splits: int  # the triton kernel's context partitions (0 for the twin)
    us: float  # median microseconds per call
    first_s: float  # the triton row's first call, compile included (0 for the twin)
    cache_gb: float  # latent rows read, 1e9 bytes
    gb: float  # everything that must move, 1e9 bytes
    gb_per_s: float
    mbu: float
    max_abs_err: float  # vs the twin (0 for the twin itself)
    twin_max_abs: float


def paged_inputs(batch: int, context: int, heads: int, rank: int, rope: int, device: torch.device, seed: int):
    """query (B, heads, rank + rope) bf16, cache (B * context / 16, 16, 1, rank + rope) bf16,
    block_tables (B, context / 16) int32 over a shuffled pool, context_lens (B,) int32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(num_blocks, BLOCK_SIZE, 1, rank + rope, generator=gen, device=device).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = (torch.randn(batch, heads, rank + rope, generator=gen, device=device) * 0.5).to(torch.bfloat16)
    return query, cache, block_tables, context_lens


def to_fp8(cache: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The rows as e4m3 codes under one k_scale (amax / 448), as an FP8 latent cache stores them."""
    k_scale = float(cache.float().abs().amax()) / FP8_MAX
    return (cache.float() / k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE), k_scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 8 64")
    parser.add_argument("--context", type=int, nargs="+", default=None, help="default 1024 4096")
    parser.add_argument("--cache", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--peak-gb-s", type=float, default=None, help="HBM bandwidth to divide by (default: the table's)")
    parser.add_argument("--no-twin", action="store_true", help="time only the triton kernel (the error check still runs)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks/mla_gpu.py needs a CUDA GPU (none is visible to torch); nothing was measured. "
              "--smoke runs the script on CPU through the Triton interpreter.")
        return 0
    device = torch.device("cuda" if not args.smoke else "cpu")
    heads, rank, rope = (SMOKE["heads"], SMOKE["rank"], SMOKE["rope"]) if args.smoke else (NUM_HEADS, KV_LORA_RANK, ROPE)
    batches = args.batch or (SMOKE["batch"] if args.smoke else [1, 8, 64])
    contexts = args.context or (SMOKE["context"] if args.smoke else [1024, 4096])
    scale = QK_HEAD_DIM**-0.5
    peak, peak_source = peak_gb_per_s(device, args.peak_gb_s)

    from stoker.kernels.mla_decode_attention import mla_decode_attention, pick_num_splits, tile_config

    t_start = time.perf_counter()
    rows: list[Row] = []
    for context in contexts:
        for batch in batches:
            query, cache_bf16, block_tables, context_lens = paged_inputs(batch, context, heads, rank, rope, device,
                                                                        seed=batch * 100003 + context)
            for kind in args.cache:
                cache, k_scale = (cache_bf16, 1.0) if kind == "bf16" else to_fp8(cache_bf16)
                block_n = tile_config(rank, rope, query.dtype)["BLOCK_N"]
                splits = pick_num_splits(batch, heads, block_tables.shape[1] * BLOCK_SIZE, block_n, device)
                cache_bytes = batch * context * (rank + rope) * cache.element_size()
                moved = (cache_bytes + query.numel() * query.element_size() + block_tables.numel() * 4
                         + batch * heads * rank * 4)  # + the float32 output written

                def triton_call():
                    return mla_decode_attention(query, cache, block_tables, context_lens, rank, scale, k_scale)

                def twin_call():
                    return reference.mla_decode_attention(query, cache, block_tables, context_lens, rank, scale, k_scale)

                t0 = time.perf_counter()
                out = triton_call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                first_s = time.perf_counter() - t0
                twin = twin_call()
                err = float((out - twin).abs().max())
                twin_max = float(twin.abs().max())
                print(f"check {kind} batch {batch} context {context}: max abs error {err:.2e} "
                      f"(twin's max abs {twin_max:.3f}); first call {first_s:.2f} s", flush=True)
                impls = {"triton": triton_call} if args.no_twin else {"triton": triton_call, "torch twin": twin_call}
                for impl, fn in impls.items():
                    us = bench(fn, device) * 1e3
                    gb_per_s = moved / (us * 1e-6) / 1e9
                    is_triton = impl == "triton"
                    rows.append(Row(kind, batch, context, impl, splits if is_triton else 0, us,
                                    first_s if is_triton else 0.0, cache_bytes / 1e9, moved / 1e9, gb_per_s,
                                    gb_per_s / peak, err if is_triton else 0.0, twin_max))
                del cache, out, twin
            del query, cache_bf16, block_tables, context_lens
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print(f"\nabsorbed MLA decode, DeepSeek-V3 latent: {heads} heads, kv_lora_rank {rank}, rope {rope}, bf16 queries, "
          f"paged cache of block size {BLOCK_SIZE}; peak {peak:.0f} GB/s from {peak_source}; "
          f"{time.perf_counter() - t_start:.1f} s")
    print("| cache | batch | context | impl | splits | us | first s | cache GB | GB | GB/s | MBU | max abs err |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        err = f"{r.max_abs_err:.2e}" if r.impl == "triton" else "(twin)"
        print(f"| {r.cache} | {r.batch} | {r.context} | {r.impl} | {r.splits or '-'} | {r.us:.1f} | "
              f"{r.first_s:.2f} | {r.cache_gb:.4f} | {r.gb:.4f} | {r.gb_per_s:.0f} | {r.mbu:.1%} | {err} |")
    if args.smoke:
        print("(smoke: interpreted on CPU, the times mean nothing)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_gb_per_s": peak, "peak_source": peak_source, "heads": heads, "kv_lora_rank": rank,
                       "rope": rope, "block_size": BLOCK_SIZE, "scale": scale, "rows": [asdict(r) for r in rows]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
