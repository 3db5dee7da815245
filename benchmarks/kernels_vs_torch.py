"""Time each Triton kernel against its torch twin and torch.compile of the twin, on CUDA.

    python benchmarks/kernels_vs_torch.py              # Llama-3-8B shapes, bf16, needs a GPU
    python benchmarks/kernels_vs_torch.py --json k.json
    python benchmarks/kernels_vs_torch.py --smoke      # tiny shapes on CPU via the interpreter:
                                                       # exercises this script, times nothing useful
First it measures the two ceilings (device-to-device copy bandwidth, bf16 matmul rate); then
every row prints the median time, the bytes or FLOPs the kernel must move or do, and the
fraction of the measured ceiling it reached (memory-bound kernels: achieved GB/s over copy
GB/s; prefill attention: achieved TFLOP/s over matmul TFLOP/s). Shapes: Llama-3-8B (H 32,
Hkv 8, D 128, hidden 4096, intermediate 14336), KV block 16. Without CUDA (and without
--smoke) it says it needs a GPU and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from stoker.kernels import reference  # noqa: E402

H, HKV, D, HIDDEN, INTER, BLOCK = 32, 8, 128, 4096, 14336, 16


@dataclass
class Row:
    kernel: str
    shape: str
    impl: str
    ms: float
    work: float  # bytes (memory-bound rows) or FLOPs (prefill attention)
    unit: str  # "GB/s" or "TFLOP/s"
    achieved: float
    of_ceiling: float  # achieved / measured ceiling


def bench(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # smoke mode: one warm call, one timed call
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ceilings(device: torch.device, smoke: bool) -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s), measured on this device."""
    n = (1 << 20) if smoke else (1 << 30)  # bytes per buffer
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * n / (bench(lambda: dst.copy_(src), device) * 1e-3) / 1e9
    m = 256 if smoke else 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_tflops = 2 * m**3 / (bench(lambda: a @ b, device) * 1e-3) / 1e12
    return copy_gbs, mm_tflops


def paged_cache(context_lens: list[int], device: torch.device, dtype: torch.dtype):
    blocks = [math.ceil(c / BLOCK) for c in context_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks - 1) + 1
    tables = torch.zeros(len(context_lens), max(blocks), dtype=torch.int32)
    i = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = perm[i : i + nb]
        i += nb
    k = torch.randn(num_blocks, BLOCK, HKV, D, device=device, dtype=dtype)
    v = torch.randn_like(k)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return k, v, tables.to(device), ctx


def compiled(fn: Callable) -> Callable | None:
    if "--smoke" in sys.argv:  # inductor on CPU needs a C++ toolchain and minutes: skip
        return None
    try:
        return torch.compile(fn, dynamic=False)
    except Exception as exc:  # noqa: BLE001 - report and carry on
        print(f"  torch.compile unavailable: {exc}", file=sys.stderr)
        return None


def run(device: torch.device, smoke: bool) -> tuple[list[Row], dict[str, float]]:
    from stoker.kernels import activation, paged_decode_attention, paged_prefill_attention, rms_norm, rotary
    from stoker.kernels import store_kvcache

    dtype = torch.bfloat16
    copy_gbs, mm_tflops = ceilings(device, smoke)
    print(f"ceilings on {device_name(device)}: copy {copy_gbs:.0f} GB/s, bf16 matmul {mm_tflops:.1f} TFLOP/s")
    rows: list[Row] = []
    bpe = 2  # bytes per bf16 element

    def add(kernel: str, shape: str, impls: dict[str, Callable | None], work: float, unit: str) -> None:
        ceiling = copy_gbs if unit == "GB/s" else mm_tflops
        scale = 1e9 if unit == "GB/s" else 1e12
        for impl, fn in impls.items():
            if fn is None:
                continue
            try:
                ms = bench(fn, device)
            except Exception as exc:  # noqa: BLE001 - e.g. torch.compile failing on a twin
                print(f"  {kernel} {shape} {impl}: failed ({type(exc).__name__}: {exc})", file=sys.stderr)
                continue
            achieved = work / (ms * 1e-3) / scale
            rows.append(Row(kernel, shape, impl, ms, work, unit, achieved, achieved / ceiling))
            print(f"  {kernel:24s} {shape:28s} {impl:14s} {ms * 1e3:10.1f} us {achieved:9.1f} {unit} {achieved / ceiling:6.1%}")

    # Decode attention: batch x context 1024 (and batch 1 at 32k), the bytes are K and V.
    decode_cases = [(1, 64)] if smoke else [(1, 1024), (8, 1024), (64, 1024), (256, 1024), (1, 32768)]
    twin_decode_c = compiled(reference.paged_decode_attention)
    for batch, ctx_len in decode_cases:
        k, v, tables, ctx = paged_cache([ctx_len] * batch, device, dtype)
        q = torch.randn(batch, H, D, device=device, dtype=dtype)
        args = (q, k, v, tables, ctx, 1 / math.sqrt(D))
        work = 2 * batch * ctx_len * HKV * D * bpe + 2 * q.numel() * bpe
        impls = {
            "triton": lambda a=args: paged_decode_attention.paged_decode_attention(*a),
            "torch": lambda a=args: reference.paged_decode_attention(*a),
            "torch.compile": (lambda a=args: twin_decode_c(*a)) if twin_decode_c else None,
        }
        add("paged_decode_attention", f"B={batch} ctx={ctx_len}", impls, work, "GB/s")

    # Prefill attention: 8 x 2048 fresh prompts; FLOPs of QK^T and PV over the causal triangle.
    prefill_cases = [(1, 64)] if smoke else [(8, 2048), (1, 8192)]
    for batch, q_len in prefill_cases:
        k, v, tables, _ = paged_cache([q_len] * batch, device, dtype)
        q = torch.randn(batch * q_len, H, D, device=device, dtype=dtype)
        cu = [i * q_len for i in range(batch + 1)]
        args = (q, k, v, tables, cu, [q_len] * batch, 1 / math.sqrt(D))
        flops = 4 * batch * H * D * q_len * (q_len + 1) / 2
        impls = {
            "triton": lambda a=args: paged_prefill_attention.paged_attention(*a),
            "torch": lambda a=args: reference.paged_attention(*a),
        }
        add("paged_attention", f"{batch}x{q_len} causal", impls, flops, "TFLOP/s")

    tokens_cases = [8] if smoke else [64, 8192]
    for t in tokens_cases:
        kv = torch.randn(t, HKV, D, device=device, dtype=dtype)
        k, v, _, _ = paged_cache([t], device, dtype)
        slots = torch.randperm(t, device=device)
        add("store_kvcache", f"T={t}", {
            "triton": lambda: store_kvcache.store_kvcache(kv, kv, k, v, slots),
            "torch": lambda: reference.store_kvcache(kv, kv, k, v, slots),
        }, 4 * kv.numel() * bpe, "GB/s")

        x = torch.randn(t, HIDDEN, device=device, dtype=dtype)
        res = torch.randn_like(x)
        w = torch.ones(HIDDEN, device=device, dtype=dtype)
        rms_c, fused_c = compiled(reference.rms_norm), compiled(reference.fused_add_rms_norm)
        add("rms_norm", f"T={t} hidden={HIDDEN}", {
            "triton": lambda: rms_norm.rms_norm(x, w, 1e-5),
            "torch": lambda: reference.rms_norm(x, w, 1e-5),
            "torch.compile": (lambda: rms_c(x, w, 1e-5)) if rms_c else None,
        }, 2 * x.numel() * bpe, "GB/s")
        add("fused_add_rms_norm", f"T={t} hidden={HIDDEN}", {
            "triton": lambda: rms_norm.fused_add_rms_norm(x, res, w, 1e-5),
            "torch": lambda: reference.fused_add_rms_norm(x, res, w, 1e-5),
            "torch.compile": (lambda: fused_c(x, res, w, 1e-5)) if fused_c else None,
        }, 4 * x.numel() * bpe, "GB/s")

        gate_up = torch.randn(t, 2 * INTER, device=device, dtype=dtype)
        silu_c = compiled(reference.silu_and_mul)
        add("silu_and_mul", f"T={t} d={INTER}", {
            "triton": lambda: activation.silu_and_mul(gate_up),
            "torch": lambda: reference.silu_and_mul(gate_up),
            "torch.compile": (lambda: silu_c(gate_up)) if silu_c else None,
        }, 1.5 * gate_up.numel() * bpe, "GB/s")

        positions = torch.randint(0, 8192, (t,), device=device)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
        freqs = torch.arange(8192, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        cache = torch.cat((freqs.cos(), freqs.sin()), -1)
        q = torch.randn(t, H, D, device=device, dtype=dtype)
        kk = torch.randn(t, HKV, D, device=device, dtype=dtype)
        rot_c = compiled(reference.rotary_embedding)
        add("rotary_embedding", f"T={t}", {
            "triton": lambda: rotary.rotary_embedding(positions, q, kk, cache),
            "torch": lambda: reference.rotary_embedding(positions, q, kk, cache),
            "torch.compile": (lambda: rot_c(positions, q, kk, cache)) if rot_c else None,
        }, 2 * (q.numel() + kk.numel()) * bpe + t * D * 4, "GB/s")
    return rows, {"copy_gb_s": copy_gbs, "bf16_matmul_tflop_s": mm_tflops}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows and ceilings to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    args = parser.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("kernels_vs_torch: needs a CUDA GPU (none found); nothing measured. `--smoke` runs tiny shapes on CPU.")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernels_vs_torch: triton is not installed; nothing measured.")
        return 0
    torch.manual_seed(0)
    rows, ceil = run(device, args.smoke)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(device), "torch": torch.__version__, "ceilings": ceil,
                       "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
