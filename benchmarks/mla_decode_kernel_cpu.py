"""The absorbed MLA decode attention alone: kernels/cpu/mla_decode_attention.c against its torch
twin (reference.mla_decode_attention), and the C kernel over an FP8 E4M3 latent cache (`c-fp8`),
one thread each (this machine is shared: one thread is the stable comparison), V2-Lite/V3's
latent (16 heads, kv_lora_rank 512 + rope 64), float32 queries, median of 31 calls, at batch 1
and 32, contexts 128 and 1024.

    nice -n 5 python benchmarks/mla_decode_kernel_cpu.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from stoker.kernels import reference
from stoker.kernels.cpu.mla_decode_attention import mla_decode_attention
torch.set_num_threads(1)
H, r, R, bs = 16, 512, 64, 16
for B, L in ((1, 128), (1, 1024), (32, 128), (32, 1024)):
    nb = B * (L // bs)
    cache = torch.randn(nb, bs, 1, r + R)
    tables = torch.arange(nb, dtype=torch.int32).view(B, -1)
    ctx = torch.full((B,), L, dtype=torch.int32)
    q = torch.randn(B, H, r + R)
    fp8 = cache.to(torch.float8_e4m3fn)
    res = {}
    for name, f, c in (("c", mla_decode_attention, cache), ("torch", reference.mla_decode_attention, cache),
                       ("c-fp8", mla_decode_attention, fp8)):
        f(q, c, tables, ctx, r, 0.1)
        ts = []
        for _ in range(31):
            t0 = time.perf_counter(); f(q, c, tables, ctx, r, 0.1); ts.append(time.perf_counter() - t0)
        res[name] = statistics.median(ts) * 1e3
    print(B, L, {k: round(v, 3) for k, v in res.items()}, "torch/c", round(res["torch"] / res["c"], 2),
          "c-fp8/c", round(res["c-fp8"] / res["c"], 2))
