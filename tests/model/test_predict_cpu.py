"""The cost model against the CPU engine's own steps, on this machine (issue 16, part 2).

Efficiencies come from microbenchmarks only (roofline/microfit.py); the steps are the real
engine's `ModelRunner.execute`. benchmarks/predict_cpu.py runs the full sweep and reports the
15% target; this test runs four points of it within ~60 s.
"""

from __future__ import annotations

import pytest
import torch

from stoker.doctor.device import measure_device
from stoker.doctor.onmachine import Point, run_check
from stoker.roofline.device_file import to_spec

# Marked `timing`: `make test` runs it alone, after the parallel suite, since beside a second
# pytest worker on a 2-core machine the other worker's tests loaded the cores unevenly between
# the microbenchmarks and the steps (a CI run saw ratios of 0.55-1.71). The machine may still be
# shared with other jobs: the benchmark, run alone, is where 15% is reported; here the bound is
# 25%, still well under what dropping any term of the model costs (checked below).
BOUND = 0.25

POINTS = [Point("decode", 1, 128), Point("decode", 16, 1024), Point("decode", 64, 256), Point("prefill", 1, 512)]


def _measure(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a busy neighbour then slows, not stalls, each parallel region
    try:
        device = to_spec(measure_device(read_mib=256, gemm_sizes=(512,), iters=5))
        return run_check(POINTS, device, tmp_path, rounds=3, iters=5, step_iters=7)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.timing
def test_steps_predicted_from_microbenchmarks_alone(tmp_path):
    # A burst of load from the other worker can land on the microbenchmarks or on the steps
    # (seen in CI: a batch-1 decode at 1.28x and a prefill at 1.37x in one run, within 10% the
    # next; once, right after the parallel phase, 0.64x then 1.31x, and within 25% in four runs
    # alone after): a miss is measured again, from scratch, up to twice before the check fails.
    reports = []
    for attempt in range(3):
        fit, mb, rows = _measure(tmp_path / f"attempt{attempt}")
        reports.append("\n".join(f"{r.point}: predicted {r.predicted.step_time_s * 1e3:.2f} ms {r.predicted.parts_s}, "
                                  f"measured {r.measured_s * 1e3:.2f} ms, ratio {r.ratio:.3f}" for r in rows))
        if all(abs(r.ratio - 1) <= BOUND for r in rows):
            break
    report = reports[-1]
    for r in rows:
        assert abs(r.ratio - 1) <= BOUND, "\n--- measured again ---\n".join(reports)
    # The weight stream and the KV stream each carry their weight: without either, some point
    # misses by more than the bound. (The host term, ~20% of a batch-1 step here, is too close
    # to the bound to be checked this way on a shared machine; the benchmark shows it.)
    for term in ("projections", "attention"):
        worst = max(abs(r.measured_s / (r.predicted.step_time_s - r.predicted.parts_s[term]) - 1) for r in rows)
        assert worst > BOUND, f"dropping {term} still within {BOUND:.0%}: the check could not see it\n{report}"
    assert 0 < fit.attention_memory <= 1 and all(0 < e <= 1 for e in fit.gemm_eff.values())
    assert set(mb.projection_chain_s) == {1, 16, 64, 512}  # the held-out steps' token counts, no step times
    assert 0 < fit.overhead(1) < rows[0].measured_s
