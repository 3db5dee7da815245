"""`stoker top` (live GPU view) and `stoker telemetry` (Prometheus exporter, dcgm-exporter names).

Without an NVIDIA GPU (or NVML) both print one line saying so and exit 0: there is nothing
to watch, which is not an error.
"""

from __future__ import annotations

import argparse
import sys

NO_GPU_EXIT_CODE = 0


def register(subparsers: argparse._SubParsersAction) -> None:
    top = subparsers.add_parser("top", help="live view of GPUs / MIG instances: utilization, memory, power, "
                                            "temperature, clocks, and which stoker process uses each")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print one table and exit")
    top.set_defaults(func=run_top_cmd)

    tel = subparsers.add_parser("telemetry", help="Prometheus exporter of GPU metrics with dcgm-exporter's names")
    tel.add_argument("--port", type=int, default=9400, help="listen port (default 9400, dcgm-exporter's)")
    tel.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    tel.set_defaults(func=run_telemetry_cmd)


def _no_gpu(command: str, reason: str) -> int:
    print(f"stoker {command}: no NVIDIA GPU visible ({reason}); nothing to show", file=sys.stderr)
    return NO_GPU_EXIT_CODE


def run_top_cmd(args: argparse.Namespace) -> int:
    from stoker.telemetry.nvml import NvmlUnavailable, load_nvml
    from stoker.telemetry.top import run_top

    if args.interval <= 0:
        raise ValueError("--interval must be > 0 seconds")
    try:
        nvml = load_nvml()
    except NvmlUnavailable as exc:
        return _no_gpu("top", str(exc))
    run_top(nvml, args.interval, args.once)
    return 0


def run_telemetry_cmd(args: argparse.Namespace) -> int:
    import time

    from stoker.telemetry.exporter import serve_exporter
    from stoker.telemetry.nvml import NvmlUnavailable

    try:
        serve_exporter(args.port, args.host)
    except NvmlUnavailable as exc:
        return _no_gpu("telemetry", str(exc))
    print(f"stoker telemetry: serving http://{args.host}:{args.port}/metrics", file=sys.stderr)
    while True:
        time.sleep(3600)
