"""The wall on this CPU: Stoker's own decode and prefill steps, predicted from microbenchmarks
alone, against the same steps measured (issue 16, part 2).

    python benchmarks/predict_cpu.py                         # full sweep, torch's thread count
    python benchmarks/predict_cpu.py --threads 1 --rounds 5
    python benchmarks/predict_cpu.py --device-file this.yaml # a doctor-written device file

1. The device: `stoker doctor`'s figures (roofline/device_file.py), measured here unless a file
   is given: the fp32 matmul peak and the streaming-read roof.
2. Microbenchmarks (stoker/doctor/microbench.py, onmachine.py): the model's projection chain
   at every token count of the sweep, paged attention at one decode and one prefill shape the
   sweep does not use, the fixed part of the chain and of decode attention (near-empty
   shapes), the layers' row kernels and activation copies, the host's input building per
   prompt length, and the host overhead of a near-empty 8-layer model's step, run on cold caches
   (a 4 MiB read before each projection, its own time subtracted), as a real step's host work
   runs between weight streams; decode attention is timed after a cache flush too.
3. `roofline.microfit.fit` -> efficiencies; `predict_step` prices each step with the cost model.
4. The steps: `ModelRunner.execute` of the real engine (issue 2's model shape, random float32
   weights), median over steps and rounds. Nothing from 4 reaches 3.

Target: |measured / predicted - 1| <= 15% at every point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stoker.cpu_runtime import configure_openmp  # noqa: E402

configure_openmp()  # OMP_WAIT_POLICY=PASSIVE as `stoker serve` runs it (before torch loads)

import torch  # noqa: E402

from benchmarks.machine import cpu_model, isa  # noqa: E402
from stoker.doctor.device import measure_device  # noqa: E402
from stoker.doctor.onmachine import Row, run_check, sweep_points  # noqa: E402
from stoker.roofline.device_file import read_device_file, to_spec  # noqa: E402

TARGET = 0.15


def table(rows: list[Row]) -> list[str]:
    out = ["| phase | B | context | predicted ms | (proj / lm_head / attn / rows / host) | measured ms | measured / predicted |",
           "|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        p = r.predicted.parts_s
        parts = " / ".join(f"{p[k] * 1e3:.2f}" for k in ("projections", "lm_head", "attention", "row_ops", "overhead"))
        flag = "" if abs(r.ratio - 1) <= TARGET else " **miss**"
        out.append(f"| {r.point.phase} | {r.point.batch} | {r.point.context_len} | {r.predicted.step_time_s * 1e3:.2f} | "
                   f"{parts} | {r.measured_s * 1e3:.2f} | {r.ratio:.3f}{flag} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, every CPU)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved microbenchmark + step rounds (median; 5: a lone noisy round on a shared VM no longer moves a point by 15%%)")
    ap.add_argument("--device-file", default=None, help="use a doctor-written device file instead of measuring")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device_file = read_device_file(args.device_file) if args.device_file else measure_device()
    device = to_spec(device_file)
    points = sweep_points(args.batch_sizes, args.contexts, args.prefill_lens)
    with tempfile.TemporaryDirectory() as tmp:
        f, mb, rows = run_check(points, device, Path(tmp), rounds=args.rounds)

    print(f"# {cpu_model()} ({isa()}), {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, load average {os.getloadavg()[0]:.2f} at the end")
    print(f"# device: fp32 peak {device_file.fp32_tflops * 1e3:.1f} GFLOP/s, bf16 {device_file.bf16_tflops * 1e3:.1f} "
          f"GFLOP/s, streaming read {device_file.read_gb_per_s:.2f} GB/s, {device_file.memory_gb:.1f} GiB "
          f"(measured with {device_file.threads} threads)")
    print(f"# roofs of the fit (the device's, raised to the best rate a microbenchmark showed): "
          f"{f.device.peak_flops('fp32') / 1e9:.1f} GFLOP/s fp32, {f.device.hbm_gb_per_s:.2f} GB/s read")
    print("# microbenchmarks -> efficiencies (share of the roofline floor):")
    print("#   projection chain: " + ", ".join(f"M={m}: {mb.projection_chain_s[m] * 1e3:.2f} ms (e {f.gemm_eff[m]:.3f})"
                                                for m in sorted(mb.projection_chain_s)))
    b, c, t = mb.decode_attention
    print(f"#   decode attention B={b} ctx={c}: {t * 1e3:.2f} ms (e memory {f.attention_memory:.3f}); prefill attention: "
          + ", ".join(f"{n} tokens {t * 1e3:.1f} ms (e compute {f.attention_compute_eff[n]:.3f})"
                      for n, t in sorted(mb.prefill_attention_s.items())))
    print(f"#   fixed parts (subtracted before the fits; the host probe charges them): projection chain "
          f"{mb.chain_fixed_s * 1e3:.2f} ms, decode attention {mb.decode_attention_fixed_s * 1e3:.2f} ms")
    print("#   host input building beyond one token (prefill): " + ", ".join(
        f"M={k}: {v * 1e3:.2f} ms" for k, v in sorted(f.host_tokens_s.items())))
    print("#   row kernels beyond one row: " + ", ".join(f"M={k}: {v * 1e3:.2f} ms" for k, v in sorted(f.row_ops_s.items())))
    print("#   host overhead per step: " + ", ".join(f"B={k}: {v * 1e3:.2f} ms" for k, v in sorted(f.overhead_s.items())))
    for line in table(rows):
        print(line)
    worst = max(rows, key=lambda r: abs(r.ratio - 1))
    within = sum(abs(r.ratio - 1) <= TARGET for r in rows)
    print(f"# {within} of {len(rows)} points within {TARGET:.0%}; worst {worst.point.phase} B={worst.point.batch} "
          f"ctx={worst.point.context_len}: {worst.ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device_file.to_yaml_dict(),
            "fit_roofs": {"fp32_gflops": f.device.peak_flops("fp32") / 1e9, "read_gb_per_s": f.device.hbm_gb_per_s},
            "fit": {k: ({str(a): b for a, b in v.items()} if isinstance(v, dict) else v)
                    for k, v in f.__dict__.items() if k != "device"},
            "rows": [{"phase": r.point.phase, "batch": r.point.batch, "context_len": r.point.context_len,
                      "predicted_s": r.predicted.step_time_s, "parts_s": r.predicted.parts_s, "measured_s": r.measured_s,
                      "ratio": r.ratio} for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
