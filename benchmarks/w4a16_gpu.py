"""MBU of the Triton W4A16 GEMM on Llama-3-8B's projections, beside its peers on the same GPU.

    python benchmarks/w4a16_gpu.py                        # M = 1, 16, 64, 256, 2048; needs a GPU
    python benchmarks/w4a16_gpu.py --rows 1 8 --group 32 --asymmetric --json w4.json
    python benchmarks/w4a16_gpu.py --smoke                # tiny shapes on CPU via the interpreter:
                                                          # exercises this script, times nothing useful

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


def bench(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # smoke mode: one warm call, one timed call
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256, 2048])
    parser.add_argument("--group", type=int, default=128, choices=[32, 64, 128])
    parser.add_argument("--asymmetric", action="store_true", help="weights with offsets (zero points), float32 scales")
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    parser.add_argument("--peak-gb-s", type=float, default=None, help="HBM bandwidth to divide by (default: the table's)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    if not torch.cuda.is_available() and not args.smoke:
        print("benchmarks/w4a16_gpu.py needs a CUDA GPU (none is visible to torch); nothing was measured. "
              "--smoke runs the script on CPU through the Triton interpreter.")
        return 0
    device = torch.device("cuda" if not args.smoke else "cpu")
    peak, peak_source = peak_gb_per_s(device, args.peak_gb_s)
    projections = {p: PROJECTIONS[p] for p in args.projections}
    rows_list = args.rows
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
