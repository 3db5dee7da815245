"""`stoker top`: an nvidia-smi-like live view of GPUs and MIG instances, and who uses them."""

from __future__ import annotations

import time
from typing import Any

from stoker.telemetry.nvml import DeviceSample, sample


def _fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def render_table(samples: list[DeviceSample]) -> Any:
    """A rich Table: one row per GPU or MIG instance."""
    from rich.table import Table

    table = Table(title="stoker top", title_justify="left")
    for col in ("GPU", "MIG", "name", "util", "mem copy", "memory used / total", "power", "temp",
                "SM / mem clock", "processes (* = stoker)"):
        table.add_column(col)
    for s in samples:
        total = None if s.fb_used_mib is None or s.fb_free_mib is None else s.fb_used_mib + s.fb_free_mib
        procs = ", ".join(f"{'*' if p.is_stoker else ''}{p.pid} {p.command.split(' ')[0].rsplit('/', 1)[-1]}"
                          f" {_fmt(p.used_mib, ' MiB')}" for p in s.processes) or "-"
        mig = "-" if s.gpu_instance_profile is None else f"{s.gpu_instance_profile} (GI {s.gpu_instance_id})"
        table.add_row(
            str(s.gpu), mig, s.model_name if s.gpu_instance_profile is None else "",
            _fmt(s.gpu_util_pct, "%"), _fmt(s.mem_copy_util_pct, "%"),
            f"{_fmt(s.fb_used_mib)} / {_fmt(total)} MiB", _fmt(s.power_w, " W", 1),
            _fmt(s.gpu_temp_c, " C"), f"{_fmt(s.sm_clock_mhz)} / {_fmt(s.mem_clock_mhz)} MHz", procs,
        )
    return table


def run_top(nvml: Any, interval_s: float = 1.0, once: bool = False) -> None:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if once:
        console.print(render_table(sample(nvml)))
        return
    with Live(render_table(sample(nvml)), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval_s)
            live.update(render_table(sample(nvml)))
