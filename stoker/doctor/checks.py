"""Check results and the pass rule shared by every `stoker doctor` check."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# DCGM's diagnostics pass a measured figure at a fraction of spec; we use 0.75 of the
# hardware table's dense peak (issue 5).
PASS_FRACTION = 0.75


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool | None  # None: measured only, no verdict (CPU, or no spec for this device)
    measured: dict[str, Any] = field(default_factory=dict)
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def against_spec(name: str, value: float, unit: str, spec: float | None, measured: dict[str, Any]) -> CheckResult:
    """Verdict for a throughput figure: pass at >= PASS_FRACTION of spec; no spec, no verdict."""
    measured = {**measured, unit: round(value, 3)}
    if spec is None:
        return CheckResult(name, None, measured, f"{value:.1f} {unit} (no spec to compare against)")
    ratio = value / spec
    measured.update(spec=spec, fraction_of_spec=round(ratio, 4), pass_fraction=PASS_FRACTION)
    verdict = "pass" if ratio >= PASS_FRACTION else "FAIL"
    return CheckResult(name, ratio >= PASS_FRACTION, measured,
                       f"{value:.1f} {unit} = {ratio:.0%} of spec {spec:g} ({verdict} at {PASS_FRACTION:.0%})")
