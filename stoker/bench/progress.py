"""Live progress line for a run: sent, completed, failed, current streamed tokens/s.

Rich's `Live` re-renders from its own thread a few times a second by calling `render()`;
the request loop only bumps integers in `LiveCounters`, so the display costs the hot path
nothing. "Current tokens/s" is content chunks per second over the last refresh interval
(one chunk is one token for servers that stream token by token, which all tested do).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from stoker.bench.client import LiveCounters


@dataclass
class BenchProgress:
    total: int
    label: str = "bench"
    enabled: bool = True
    counters: LiveCounters = field(default_factory=LiveCounters)
    _t0: float = field(default_factory=time.perf_counter)
    _last_t: float = 0.0
    _last_chunks: int = 0
    _rate: float = 0.0

    def __post_init__(self) -> None:
        self._live = None

    def render_text(self) -> str:
        """One line of numbers (also what tests check)."""
        now = time.perf_counter()
        if now - self._last_t >= 0.5:  # smooth: re-estimate the rate at most twice a second
            if self._last_t:
                self._rate = (self.counters.chunks - self._last_chunks) / (now - self._last_t)
            self._last_t, self._last_chunks = now, self.counters.chunks
        c = self.counters
        return (f"sent {c.sent}/{self.total}  completed {c.completed}  failed {c.failed}  "
                f"{self._rate:,.0f} tok/s  {now - self._t0:.1f} s")

    def render(self) -> object:
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 1))
        grid.add_row(self.label, ProgressBar(total=self.total or 1,
                                             completed=self.counters.completed + self.counters.failed,
                                             width=30), self.render_text())
        return grid

    def __enter__(self) -> BenchProgress:
        self._t0 = time.perf_counter()
        if self.enabled:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(get_renderable=self.render, console=Console(file=sys.stderr),
                              refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None
