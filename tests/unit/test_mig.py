"""MIG geometry: validation, enumeration, creation order (NVIDIA MIG user guide)."""

from __future__ import annotations

import pytest

from stoker.fleet import mig
from stoker.fleet.mig import Placement as P


def test_profile_ids_match_nvidia_smi_lgip():
    # `nvidia-smi mig -lgip` on H100-80GB: 1g.10gb 19, +me 20, 1g.20gb 15, 2g.20gb 14, 3g.40gb 9, 4g.40gb 5, 7g.80gb 0
    ids = {p.name: p.profile_id for p in mig.profiles("H100-80GB")}
    assert ids == {"1g.10gb": 19, "1g.10gb+me": 20, "1g.20gb": 15, "2g.20gb": 14,
                   "3g.40gb": 9, "4g.40gb": 5, "7g.80gb": 0}
    assert [p.name for p in mig.profiles("A100-40GB")] == [
        "1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
    assert mig.get_profile("H200-141GB", "3g.71gb").mem_slices == 4


@pytest.mark.parametrize("model", mig.MIG_GPU_MODELS)
def test_every_enumerated_layout_is_valid(model):
    layouts = mig.enumerate_layouts(model)
    assert len(layouts) == len(set(layouts)) > 100
    for layout in layouts:
        assert mig.layout_errors(model, layout) == []
        assert sum(mig.get_profile(model, p.profile).sm_slices for p in layout) <= 7
    assert () in layouts


def test_known_valid_layouts():
    m = "H100-80GB"
    assert mig.is_valid_layout(m, [P(0, "7g.80gb")])
    assert mig.is_valid_layout(m, [P(0, "4g.40gb"), P(4, "3g.40gb")])
    assert mig.is_valid_layout(m, [P(0, "3g.40gb"), P(4, "3g.40gb")])
    assert mig.is_valid_layout(m, [P(i, "1g.10gb") for i in range(7)])
    assert mig.is_valid_layout(m, [P(0, "2g.20gb"), P(2, "2g.20gb"), P(4, "2g.20gb"), P(6, "1g.10gb")])


@pytest.mark.parametrize("layout, reason", [
    ([P(1, "3g.40gb")], "valid starts are [0, 4]"),
    ([P(4, "4g.40gb")], "valid starts are [0]"),
    ([P(7, "1g.10gb")], "valid starts"),
    ([P(0, "3g.40gb"), P(2, "2g.20gb")], "overlaps"),
    ([P(0, "4g.40gb"), P(4, "2g.20gb"), P(6, "1g.20gb")], None),  # valid: 4+2+1 SM
    ([P(0, "3g.40gb"), P(4, "2g.20gb"), P(6, "2g.20gb")], "valid starts"),
    ([P(0, "1g.10gb+me"), P(1, "1g.10gb+me")], "at most one"),
    ([P(0, "2g.20gb"), P(2, "2g.20gb"), P(4, "2g.20gb"), P(6, "1g.20gb"), P(7, "1g.10gb")], "valid starts"),
    ([P(0, "9g.90gb")], "unknown MIG profile"),
])
def test_invalid_layouts_rejected_with_reason(layout, reason):
    errors = mig.layout_errors("H100-80GB", layout)
    if reason is None:
        assert errors == []
    else:
        assert errors and any(reason in e for e in errors), errors


def test_sm_budget_rule():
    # 4g + 3g uses all 7 SM slices; the memory is full too. A 1g.20gb at 6 after 4g@0 + 2g@4 is fine,
    # but 4g@0 + 2g@4 + 1g.20gb@6 + nothing else: 7 SMs. Adding SMs beyond 7 must fail.
    errs = mig.layout_errors("A100-80GB", [P(0, "4g.40gb"), P(4, "2g.20gb"), P(6, "1g.10gb"), P(7, "1g.10gb")])
    assert errs  # start 7 is invalid and SMs sum to 8


def test_user_guide_creation_order_example():
    # MIG user guide, A100-40GB: `-cgi 19,19,14,9` fails, `-cgi 9,19,14,19` succeeds.
    with pytest.raises(ValueError, match="profile 9"):
        mig.simulate_creation("A100-40GB", [19, 19, 14, 9])
    made = mig.simulate_creation("A100-40GB", [9, 19, 14, 19])
    assert mig.is_valid_layout("A100-40GB", made)
    assert sorted(p.profile for p in made) == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
    # The planner's order for the same multiset succeeds.
    order = mig.creation_order("A100-40GB", ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"])
    assert order[0] == 9
    mig.simulate_creation("A100-40GB", order)


@pytest.mark.parametrize("model", ["A100-40GB", "H100-80GB"])
def test_creation_order_exists_for_every_feasible_multiset(model):
    for names in mig.feasible_multisets(model):
        order = mig.creation_order(model, names)
        made = mig.simulate_creation(model, order)
        assert sorted(p.profile for p in made) == sorted(names)


def test_unknown_model_and_resource_names():
    with pytest.raises(ValueError, match="no MIG geometry"):
        mig.profiles("T4")
    assert mig.get_profile("H100-80GB", "3g.40gb").resource_name == "nvidia.com/mig-3g.40gb"
    assert mig.get_profile("H100-80GB", "1g.10gb+me").resource_name == "nvidia.com/mig-1g.10gb.me"
    assert mig.layout_for("H100-80GB", ["4g.40gb", "4g.40gb"]) is None
