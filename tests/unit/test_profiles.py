"""Efficiency profiles: the engine profile is the fit it claims to be, it predicts public engine
measurements better than kernel peaks (held-out points included), and profile files round-trip."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stoker.roofline import published
from stoker.roofline.calibrate import fit_points, points_loss
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.profiles import ENGINE, KERNEL, get_profile, load_profile, save_profile


def test_new_roofline_modules_import_no_torch() -> None:
    code = ("import sys, stoker.roofline.profiles, stoker.roofline.published, stoker.roofline.kvcapacity, "
            "stoker.roofline.workloads, stoker.roofline.calibrate; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_profile_is_the_fit_of_the_published_points() -> None:
    # Re-run the fit: the constants in profiles.py must be its output, not hand-tuned values.
    assert fit_points(published.fit_points()) == ENGINE


def test_engine_profile_beats_kernel_peak_on_public_measurements() -> None:
    pts = published.POINTS
    engine, kernel = published.summary(pts, ENGINE), published.summary(pts, KERNEL)
    assert len(pts) >= 30
    assert kernel["median_ratio"] > 1.3  # kernel peaks are optimistic for engines (issue 16)
    assert abs(engine["median_ratio"] - 1) < 0.05
    assert engine["within"] >= 20 > kernel["within"]
    # Held out of the fit, the engine profile still lands closer than kernel peaks.
    held = published.held_out_points()
    assert points_loss(held, ENGINE) < points_loss(held, KERNEL)


def test_ceiling_is_never_below_a_public_measurement() -> None:
    for p in published.POINTS:
        assert published.speed_ratio(p, Efficiencies.ideal()) >= 1.0, p.label


def test_every_point_cites_a_source_and_a_known_kind() -> None:
    for p in published.POINTS:
        assert p.source.startswith("github.com/") and p.kind in published.KINDS
    with pytest.raises(ValueError):
        published.PublicPoint("x", "llama-2-7b", "H100", 1, "bf16", "bf16", "bogus", 1, 1, 1, 1.0, "s")


def test_speed_ratio_reads_the_same_way_for_latency() -> None:
    p = published.POINTS[-1]
    assert p.kind == "ttft"
    assert published.speed_ratio(p, KERNEL) == pytest.approx(p.measured / published.predict(p, KERNEL))


def test_profile_file_round_trip_and_errors(tmp_path) -> None:
    f = tmp_path / "mine.yaml"
    eff = ENGINE.replace(memory=0.66, comm_latency_s=5e-6)
    save_profile(eff, f, name="mine", source="test")
    assert load_profile(f) == eff and get_profile(str(f)) == eff
    assert not list(tmp_path.glob(".mine.yaml.*"))  # no temp file left behind
    assert get_profile("kernel") == KERNEL and get_profile(None) == ENGINE
    (tmp_path / "flat.json").write_text('{"memory": 0.5}')
    assert get_profile(str(tmp_path / "flat.json")) == KERNEL.replace(memory=0.5)
    (tmp_path / "bad.yaml").write_text("efficiencies: {memroy: 0.5}\n")
    with pytest.raises(ValueError, match="unknown efficiency key"):
        load_profile(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("fastest")


def test_failed_profile_write_leaves_the_old_file_whole(tmp_path, monkeypatch) -> None:
    import os

    f = tmp_path / "p.yaml"
    save_profile(KERNEL, f)
    before = f.read_text()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        save_profile(ENGINE, f)
    assert f.read_text() == before and [x.name for x in tmp_path.iterdir()] == ["p.yaml"]
