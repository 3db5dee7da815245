"""`stoker doctor`: acceptance checks with a JSON report and a pass/fail per check.

Exit code 0 when no check failed, 1 when one did (checks without a verdict do not fail).
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="acceptance tests: versions, GEMM, memory bandwidth, "
                                             "all-reduce busbw, bit-exact soak, ECC counters")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--soak-minutes", type=float, default=1.0, help="soak duration (default 1 minute)")
    p.add_argument("--gemm-size", type=int, default=None, help="matmul n (default 8192 GPU, 1024 CPU)")
    p.add_argument("--bandwidth-mib", type=int, default=None, help="copy size (default 2048 GPU, 256 CPU)")
    p.add_argument("--allreduce-mib", type=int, default=None, help="all-reduce size (default 256 GPU, 16 CPU)")
    p.add_argument("--world-size", type=int, default=0, help="all-reduce processes (default: all GPUs, 2 on CPU)")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per measurement")
    p.add_argument("--out", default="doctor.json", help="JSON report path (default doctor.json)")
    p.add_argument("--write-device-file", nargs="?", const="", default=None, metavar="PATH",
                   help="CPU: also measure this machine for the roofline (fp32/bf16 matmul peak, streaming read) "
                        "and write the device file `stoker roofline --gpu this` reads (default path: "
                        "$STOKER_DEVICE_FILE or ~/.cache/stoker/this-device.yaml)")
    p.set_defaults(func=run_doctor_cmd)


def run_doctor_cmd(args: argparse.Namespace) -> int:
    import torch

    from stoker.doctor.runner import DoctorConfig, run_doctor, write_report

    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.soak_minutes < 0 or args.iters < 1:
        raise ValueError("--soak-minutes must be >= 0 and --iters >= 1")
    cfg = DoctorConfig(
        device=args.device,
        gemm_size=args.gemm_size or (8192 if gpu else 1024),
        gemm_iters=args.iters,
        bandwidth_mib=args.bandwidth_mib or (2048 if gpu else 256),
        bandwidth_iters=args.iters,
        allreduce_mib=args.allreduce_mib or (256 if gpu else 16),
        allreduce_iters=args.iters,
        world_size=args.world_size,
        soak_seconds=args.soak_minutes * 60,
    )
    report = run_doctor(cfg)
    if args.write_device_file is not None:
        if gpu:
            raise ValueError("--write-device-file measures a CPU; GPUs are in the hardware table (use --device cpu)")
        from stoker.doctor.device import measure_device
        from stoker.roofline.device_file import write_device_file

        dev = measure_device()
        path = write_device_file(dev, args.write_device_file or None)
        report["device_file"] = {"path": str(path), **dev.to_yaml_dict()["devices"][0]}
    write_report(report, args.out)
    for c in report["checks"]:
        verdict = {True: "PASS", False: "FAIL", None: "----"}[c["passed"]]
        print(f"{verdict}  {c['name']:<18} {c['message']}")
    if "device_file" in report:
        d = report["device_file"]
        print(f"----  device_file        {d['fp32_tflops'] * 1e3:.1f} GFLOP/s fp32, {d['hbm_gb_per_s']:.2f} GB/s read, "
              f"{d['threads']} threads: wrote {d['path']} (stoker roofline --gpu this)")
    print(f"{'PASS' if report['passed'] else 'FAIL'}: report written to {args.out}")
    return 0 if report["passed"] else 1
