"""MBU of the Triton W4A16 GEMM on Llama-3-8B's projections, beside its peers on the same GPU.

    python benchmarks/w4a16_gpu.py                        # M = 1, 16, 64, 256, 2048; needs a GPU
    python benchmarks/w4a16_gpu.py --rows 1 8 --group 32 --asymmetric --json w4.json
    python benchmarks/w4a16_gpu.py --smoke                # tiny shapes on CPU via the interpreter:
                                                          # exercises this script, times nothing useful
    python benchmarks/w4a16_gpu.py --sweep --json s.json  # the GEMVs' launch configs, M = 1, 2, 4
    python benchmarks/w4a16_gpu.py --smoke --sweep        # the same on CPU, tiny shapes

Each row: one projection (hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128:
qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) at M rows of bf16
activations, the median time of one call (triton.testing.do_bench), the bytes it must read
(weights as held: codes, scales and offsets; x; the output written) and MBU = bytes / time /
peak HBM bandwidth (stoker/roofline/hardware.py's figure for the device torch names;
--peak-gb-s overrides it). Peers in the same run, same shapes:

  triton w4a16      kernels/w4a16_linear.py (the int4 method's CUDA backend)
  int4pack          torch._weight_int4pack_mm (tinygemm; bf16, w = (q - 8) s + z), where this
                    torch has it: the issue asks for it "where it wins", which only this can say
  triton w8         kernels/w8_linear.py, int8 per channel (the 8-bit weight-only backend)
  bf16 F.linear     cuBLAS on the bf16 weight (the unquantized model)
  dequant twin      reference.int4_linear: what the int4 method runs without the kernel
  gemv w4a16        kernels/quant_gemv.py gemv_w4, M <= 8 only (the int4 backend's decode path)
  gemv w8 int8      quant_gemv.gemv_w8 on the int8 per-channel weight, M <= 8 (triton_w8's decode)
  gemv w8 fp8       quant_gemv.gemv_w8 on an fp8 e4m3 per-channel weight, M <= 8 (the decode path
                    of both fp8 backends, scaled_mm and triton_w8)
  dequant+F.linear  quant_gemv.dequant_w4 to bf16, then cuBLAS (the int4 backend from 256 rows)

Each quantized peer is first checked against its twin (relative error printed: the 4-bit
peers against reference.int4_linear, the 8-bit ones against reference.w8_linear on their own
weights); one that disagrees is reported, not timed. Without CUDA (and without --smoke) it
says so and exits 0.

--sweep times instead each launch config of quant_gemv.sweep_tiles (VEC, BLOCK_N, warps, split
of K around tile_config's rule) for gemv_w4 (group --group, symmetric unless --asymmetric) and
gemv_w8 (int8 per channel) at M = 1, 2, 4 (--rows, <= GEMV_ROWS), each checked against its
twin (reference.gemv_w4 / gemv_w8) first; it prints a table per kind, projection and M sorted
by time, then the fastest config per (kind, projection, M), per (kind, M) over all projections
(the least total time) and per (kind, projection) among choices that keep a row's result
independent of its batch (one VEC, warp count and split for every M; BLOCK_N may vary), all
also in --json under "sweep".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from stoker.kernels import reference  # noqa: E402
from stoker.quantization import formats, int4  # noqa: E402

INT4_PEERS = ("triton w4a16", "int4pack", "dequant twin", "gemv w4a16", "dequant+F.linear")
INT8_PEERS = ("triton w8", "gemv w8 int8")
FP8_PEERS = ("gemv w8 fp8",)
GEMV_PEERS = ("gemv w4a16", "gemv w8 int8", "gemv w8 fp8")  # timed at M <= quant_gemv.GEMV_ROWS only
PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@dataclass
class Row:
    projection: str
    rows: int
    impl: str
    ms: float
    gb: float  # bytes that must move, in 1e9
    gb_per_s: float
    mbu: float  # gb_per_s / peak
    rel_err: float  # quantized peers: against the twin of their weights; nan for bf16


def bench(fn: Callable[[], object], device: torch.device, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds per call (CUDA events)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    if warmup_ms:  # smoke mode: one warm call (--sweep has made one), one timed call
        fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def peak_gb_per_s(device: torch.device, override: float | None) -> tuple[float, str]:
    if override:
        return override, "--peak-gb-s"
    if device.type != "cuda":
        return 3350.0, "H100-SXM (smoke: a stand-in, nothing is timed)"
    from stoker.roofline.hardware import gpu_from_device_name

    name = torch.cuda.get_device_name(device)
    spec = gpu_from_device_name(name)
    if spec is None:
        sys.exit(f"{name!r} is not in stoker/roofline/hardware.py's table: pass its HBM bandwidth as --peak-gb-s")
    return spec.hbm_gb_per_s, f"{spec.name} ({name})"


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def int4pack_peer(q: torch.Tensor, scale: torch.Tensor, offset8: torch.Tensor | None, group: int):
    """torch's tinygemm layout: codes with even k in the high nibble, repacked by
    _convert_weight_to_int4pack; (K / group, N, 2) bf16 scales and zeros, w = (q - 8) s + z,
    so z is our o' = o + 8 s. Returns (fn of x, bytes held) or raises where this torch lacks it."""
    packed = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    weight = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    zeros = torch.zeros_like(scale) if offset8 is None else offset8
    scales_zeros = torch.stack([scale.float().t(), zeros.float().t()], dim=-1).to(torch.bfloat16).contiguous()
    return (lambda x: torch.ops.aten._weight_int4pack_mm(x, weight, group, scales_zeros)), nbytes(weight, scales_zeros)


@dataclass
class SweepRow:
    kind: str  # "w4 group 128 symmetric" / "w8 int8 per channel"
    projection: str
    rows: int
    overrides: dict  # the launchers' keywords (quant_gemv.sweep_tiles), {} = tile_config's rule
    tiles: dict  # what tile_config resolved them to at this shape
    ms: float
    gb_per_s: float
    mbu: float
    rel_err: float  # against reference.gemv_w4 / gemv_w8


def tiles_label(tiles: dict, default: bool) -> str:
    return (f"VEC{tiles['VEC']} N{tiles['BLOCK_N']} warps{tiles['num_warps']} split{tiles['SPLIT_K']}"
            + (" (rule)" if default else ""))


def sweep(args: argparse.Namespace, device: torch.device, projections: dict, rows_list: list[int], peak: float) -> list[SweepRow]:
    """Every config of quant_gemv.sweep_tiles on every projection and M, checked, then timed."""
    from stoker.kernels import quant_gemv
    from stoker.kernels._common import num_sms
    from stoker.kernels.w4a16_linear import hold_scales

    sms = num_sms(torch.cuda.current_device() if device.type == "cuda" else None)  # as the launchers see it
    kinds = (f"w4 group {args.group} {'asymmetric' if args.asymmetric else 'symmetric'}", "w8 int8 per channel")
    results: list[SweepRow] = []
    for proj, (n, k) in projections.items():
        torch.manual_seed(0)
        w = torch.randn(n, k, device=device) / k**0.5  # quantized on the device: gate_up on the host takes seconds
        q, s, o = int4.quantize(w, args.group, symmetric=not args.asymmetric)
        packed, (scale, offset) = int4.pack(q), hold_scales(s, o)
        q8, s8 = formats.quantize_rows(w, "int8")
        del w, q, s, o
        weights = {
            kinds[0]: (4, k // 2, nbytes(packed, scale, offset),
                       lambda x, t: quant_gemv.gemv_w4(x, packed, scale, offset, args.group, **t),
                       lambda x: reference.gemv_w4(x, packed, scale, offset, args.group)),
            kinds[1]: (8, k, nbytes(q8, s8), lambda x, t: quant_gemv.gemv_w8(x, q8, s8, k, **t),
                       lambda x: reference.gemv_w8(x, q8, s8, k)),
        }
        for rows in rows_list:
            x = torch.randn(rows, k, device=device).to(torch.bfloat16)
            for kind, (bits, row_bytes, held, fn, twin_fn) in weights.items():
                twin = twin_fn(x).float()
                moved = held + nbytes(x) + rows * n * 2
                timed: dict[tuple, tuple[float, float]] = {}  # resolved tiles -> (ms, err): one timing each
                for overrides in quant_gemv.sweep_tiles(bits, rows):
                    tiles = quant_gemv.tile_config(rows, n, row_bytes, bits, sms, **overrides)
                    key = tuple(sorted(tiles.items()))
                    if key not in timed:
                        err = float((fn(x, overrides).float() - twin).norm() / twin.norm())
                        if err > 1e-2:  # bf16 output: one rounding, ~2e-3
                            print(f"{kind} {proj} M{rows} {tiles_label(tiles, not overrides)}: relative error {err:.2e} "
                                  "against the twin; not timed")
                            timed[key] = (float("nan"), err)
                            continue
                        timed[key] = (bench(lambda: fn(x, overrides), device, args.sweep_warmup_ms if device.type == "cuda" else 0,
                                             args.sweep_rep_ms), err)
                    ms, err = timed[key]
                    if ms == ms:  # not nan
                        gb_per_s = moved / (ms * 1e-3) / 1e9
                        results.append(SweepRow(kind, proj, rows, overrides, tiles, ms, gb_per_s, gb_per_s / peak, err))
        del packed, scale, offset, q8, s8, weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def sweep_best(results: list[SweepRow]) -> dict:
    """The fastest configs: per (kind, projection, M); per (kind, M), the least time summed over
    the projections (one rule for all); per (kind, projection), the fastest choice of VEC, warps
    and split (resolved) kept for every M, BLOCK_N free per M (a row's result then does not
    depend on its batch)."""
    def entry(r: SweepRow, default_ms: float) -> dict:
        return {"overrides": r.overrides, "tiles": r.tiles, "ms": round(r.ms, 5), "gb_per_s": round(r.gb_per_s, 1),
                "default_ms": round(default_ms, 5), "speedup": round(default_ms / r.ms, 3)}

    by_case: dict[tuple, list[SweepRow]] = {}
    for r in results:
        by_case.setdefault((r.kind, r.projection, r.rows), []).append(r)
    best: dict = {}
    for (kind, proj, rows), rs in by_case.items():
        default = next(r for r in rs if not r.overrides)
        best.setdefault(kind, {}).setdefault(proj, {})[str(rows)] = entry(min(rs, key=lambda r: r.ms), default.ms)
    overall: dict = {}
    for kind in {r.kind for r in results}:
        for rows in sorted({r.rows for r in results if r.kind == kind}):
            cases = {p for (kd, p, m) in by_case if kd == kind and m == rows}
            totals: dict[str, list] = {}
            for r in results:
                if r.kind == kind and r.rows == rows:
                    totals.setdefault(json.dumps(r.overrides, sort_keys=True), []).append(r.ms)
            complete = {key: sum(ms) for key, ms in totals.items() if len(ms) == len(cases)}
            key = min(complete, key=complete.get)
            overall.setdefault(kind, {})[str(rows)] = {"overrides": json.loads(key), "ms_total": round(complete[key], 5),
                                                       "default_ms_total": round(complete["{}"], 5)}
    invariant: dict = {}
    for kind, proj in {(r.kind, r.projection) for r in results}:
        rows_seen = sorted({r.rows for r in results if (r.kind, r.projection) == (kind, proj)})
        per_key: dict[tuple, dict[int, SweepRow]] = {}
        for r in results:
            if (r.kind, r.projection) == (kind, proj):
                key = (r.tiles["VEC"], r.tiles["num_warps"], r.tiles["SPLIT_K"])
                fastest = per_key.setdefault(key, {})
                if r.rows not in fastest or r.ms < fastest[r.rows].ms:
                    fastest[r.rows] = r
        complete = {key: f for key, f in per_key.items() if len(f) == len(rows_seen)}
        key = min(complete, key=lambda c: sum(r.ms for r in complete[c].values()))
        default_total = sum(next(r.ms for r in by_case[(kind, proj, m)] if not r.overrides) for m in rows_seen)
        invariant.setdefault(kind, {})[proj] = {
            "vec": key[0], "num_warps": key[1], "split_k": key[2],
            "block_n_by_rows": {str(m): complete[key][m].tiles["BLOCK_N"] for m in rows_seen},
            "ms_total": round(sum(r.ms for r in complete[key].values()), 5), "default_ms_total": round(default_total, 5)}
    return {"best": best, "best_over_projections": overall, "best_batch_invariant": invariant}


def print_sweep(results: list[SweepRow], summary: dict) -> None:
    cases: dict[tuple, list[SweepRow]] = {}
    for r in results:
        cases.setdefault((r.kind, r.projection, r.rows), []).append(r)
    for (kind, proj, rows), rs in cases.items():
        default_ms = next(r.ms for r in rs if not r.overrides)
        print(f"\n{kind}, {proj}, M = {rows}")
        print(f"  {'config':34} {'ms':>9} {'GB/s':>7} {'MBU':>6} {'vs rule':>7} {'rel err':>8}")
        for r in sorted(rs, key=lambda r: r.ms):
            print(f"  {tiles_label(r.tiles, not r.overrides):34} {r.ms:9.4f} {r.gb_per_s:7.0f} {r.mbu:6.1%} "
                  f"{default_ms / r.ms:6.2f}x {r.rel_err:8.1e}")
    print("\nfastest per (kind, projection, M):")
    for kind, projs in summary["best"].items():
        for proj, by_rows in projs.items():
            for rows, e in by_rows.items():
                print(f"  {kind:26} {proj:8} M{rows}: {tiles_label(e['tiles'], not e['overrides'])}  "
                      f"{e['ms']:.4f} ms ({e['speedup']:.2f}x the rule)")
    print("fastest per (kind, M) over all projections (least total time):")
    for kind, by_rows in summary["best_over_projections"].items():
        for rows, e in by_rows.items():
            print(f"  {kind:26} M{rows}: {e['overrides'] or 'the rule'}  {e['ms_total']:.4f} ms (rule {e['default_ms_total']:.4f})")
    print("fastest batch-invariant choice per (kind, projection) (one VEC, warps, split for every M):")
    for kind, projs in summary["best_batch_invariant"].items():
        for proj, e in projs.items():
            print(f"  {kind:26} {proj:8}: VEC{e['vec']} warps{e['num_warps']} split{e['split_k']} "
                  f"BLOCK_N {e['block_n_by_rows']}  {e['ms_total']:.4f} ms (rule {e['default_ms_total']:.4f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="default: 1 4 8 16 64 256 2048; 1 2 4 with --sweep")
    parser.add_argument("--group", type=int, default=128, choices=[32, 64, 128])
    parser.add_argument("--asymmetric", action="store_true", help="weights with offsets (zero points), float32 scales")
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    parser.add_argument("--peak-gb-s", type=float, default=None, help="HBM bandwidth to divide by (default: the table's)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time the GEMVs' launch configs (quant_gemv.sweep_tiles)")
    parser.add_argument("--sweep-warmup-ms", type=int, default=3)
    parser.add_argument("--sweep-rep-ms", type=int, default=12, help="CUDA-event timing per config (median)")
    args = parser.parse_args()
    if args.rows is None:
        args.rows = [1, 2, 4] if args.sweep else [1, 4, 8, 16, 64, 256, 2048]

    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks/w4a16_gpu.py needs a CUDA GPU (none is visible to torch); nothing was measured. "
              "--smoke runs the script on CPU through the Triton interpreter.")
        return 0
    device = torch.device("cuda" if not args.smoke else "cpu")
    peak, peak_source = peak_gb_per_s(device, args.peak_gb_s)
    projections = {p: PROJECTIONS[p] for p in args.projections}
    rows_list = args.rows
    if args.sweep:
        from stoker.kernels.quant_gemv import GEMV_ROWS

        if args.smoke:
            projections, rows_list = {"smoke": (4, 256)}, [1, 3]
        rows_list = [m for m in rows_list if 0 < m <= GEMV_ROWS]
        start = time.perf_counter()
        results = sweep(args, device, projections, rows_list, peak)
        summary = sweep_best(results)
        print(f"GEMV launch configs on Llama-3-8B projections, x bf16; peak {peak:.0f} GB/s from {peak_source}")
        print_sweep(results, summary)
        print(f"sweep: {len(results)} timings in {time.perf_counter() - start:.1f} s (with compiles)")
        if args.smoke:
            print("(smoke: interpreted on CPU, the times mean nothing)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"peak_gb_per_s": peak, "peak_source": peak_source, "sweep": summary,
                           "rows": [asdict(r) for r in results]}, f, indent=1)
        return 0
    if args.smoke:
        projections, rows_list = {"smoke": (96, 256)}, [1, 33]

    from stoker.kernels.quant_gemv import GEMV_ROWS, dequant_w4, gemv_w4, gemv_w8
    from stoker.kernels.w4a16_linear import hold_scales, w4a16_linear
    from stoker.kernels.w8_linear import w8_linear

    results: list[Row] = []
    for proj, (n, k) in projections.items():
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=gen) / k**0.5
        q, s, o = int4.quantize(w, args.group, symmetric=not args.asymmetric)
        if args.asymmetric:
            s = s * (1 + 2**-20)  # not exact in float16, as zero-point checkpoints' products often are not
        packed, scale, offset = int4.pack(q).to(device), *hold_scales(s.to(device), o.to(device))
        q_dev, s_dev, o_dev = q.to(device), s.to(device), o.to(device)
        q8, s8 = formats.quantize_rows(w, "int8")
        q8, s8 = q8.to(device), s8.to(device)
        qf8, sf8 = formats.quantize_rows(w, "fp8")
        qf8, sf8 = qf8.to(device), sf8.to(device)
        w16 = w.to(device, torch.bfloat16)
        del w
        peers: dict[str, tuple[Callable, int]] = {
            "triton w4a16": (lambda x: w4a16_linear(x, packed, scale, offset, args.group), nbytes(packed, scale, offset)),
            "triton w8": (lambda x: w8_linear(x, q8, s8, k), nbytes(q8, s8)),
            "bf16 F.linear": (lambda x: F.linear(x, w16), nbytes(w16)),
            "dequant twin": (lambda x: reference.int4_linear(x, q_dev, s_dev, o_dev, args.group), nbytes(packed, scale, offset)),
            "gemv w4a16": (lambda x: gemv_w4(x, packed, scale, offset, args.group), nbytes(packed, scale, offset)),
            "gemv w8 int8": (lambda x: gemv_w8(x, q8, s8, k), nbytes(q8, s8)),
            "gemv w8 fp8": (lambda x: gemv_w8(x, qf8, sf8, k), nbytes(qf8, sf8)),
            "dequant+F.linear": (lambda x: F.linear(x, dequant_w4(packed, scale, offset, args.group, x.dtype)),
                                 nbytes(packed, scale, offset)),
        }
        if device.type == "cuda":
            try:
                peers["int4pack"] = int4pack_peer(q_dev, scale, offset, args.group)
            except (RuntimeError, AttributeError) as exc:  # this torch / GPU has no tinygemm int4 path
                print(f"int4pack: not available here ({type(exc).__name__}: {str(exc)[:200]})")
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(device, torch.bfloat16)
            twins = {INT4_PEERS: reference.int4_linear(x, q_dev, s_dev, o_dev, args.group).float(),
                     INT8_PEERS: reference.w8_linear(x, q8, s8, k).float(), FP8_PEERS: reference.w8_linear(x, qf8, sf8, k).float()}
            for impl, (fn, held) in peers.items():
                if impl in GEMV_PEERS and rows > GEMV_ROWS:
                    continue
                # each quantized peer against the twin of its own weights (int4pack rounds scales to bf16)
                twin = next((t for group, t in twins.items() if impl in group), None)
                err = float((fn(x).float() - twin).norm() / twin.norm()) if twin is not None else float("nan")
                if err > 2e-2:
                    print(f"{proj} M{rows} {impl}: relative error {err:.2e} against the twin; not timed")
                    continue
                ms = bench(lambda: fn(x), device)
                moved = held + nbytes(x) + rows * n * 2
                gb_per_s = moved / (ms * 1e-3) / 1e9
                results.append(Row(proj, rows, impl, ms, moved / 1e9, gb_per_s, gb_per_s / peak, err))
        del packed, scale, offset, q_dev, s_dev, o_dev, q8, s8, qf8, sf8, w16, peers
        if device.type == "cuda":
            torch.cuda.empty_cache()

    kind = f"int4 group {args.group} {'asymmetric' if args.asymmetric else 'symmetric'}"
    print(f"Llama-3-8B projections, x bf16, {kind}; peak {peak:.0f} GB/s from {peak_source}")
    print(f"{'proj':8} {'M':>5} {'impl':16} {'ms':>9} {'GB':>7} {'GB/s':>8} {'MBU':>6} {'rel err':>8}")
    for r in results:
        print(f"{r.projection:8} {r.rows:5d} {r.impl:16} {r.ms:9.4f} {r.gb:7.4f} {r.gb_per_s:8.0f} {r.mbu:6.1%} {r.rel_err:8.1e}")
    if args.smoke:
        print("(smoke: interpreted on CPU, the times mean nothing)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_gb_per_s": peak, "peak_source": peak_source, "weights": kind,
                       "rows": [asdict(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
