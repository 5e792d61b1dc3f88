"""Attribution: each kept rung's paired gain, its share, the categories it moved between the profile
windows before and after it, and the check that the gains multiply to the measured total (3%), or
the interaction named with its figures."""

from __future__ import annotations

import math

import pytest

from speedkit.engine.attribution import attribute, moved_categories

LABELS = {"attention": "attention", "gemm": "GEMM", "host_idle": "host-bound idle GPU"}


def _window(step_ms: float, peak: int, **breakdown: float) -> dict:
    cats = {"data_wait": 0.0, "host_idle": 0.0, "gemm": 0.0, "attention": 0.0, "elementwise": 0.0}
    cats.update(breakdown)
    return {"step_ms": step_ms, "peak_memory_bytes": peak, "breakdown_ms": cats}


WINDOWS = [
    _window(60.0, 30_000_000_000, gemm=30.0, attention=19.1, elementwise=10.0),  # baseline
    _window(42.6, 16_400_000_000, gemm=30.0, attention=1.9, elementwise=10.0),  # + sdpa
    _window(30.0, 16_400_000_000, gemm=17.4, attention=1.9, elementwise=10.0),  # + autocast (final)
]


def test_each_rung_says_what_it_moved_and_the_gains_multiply_to_the_measured_total():
    decisions = {"sdpa": (("sdpa",), 1.41), "autocast": (("autocast",), 1.42)}
    out = attribute(["sdpa", "autocast"], decisions, WINDOWS, measured=2.0, labels=LABELS)
    sdpa, autocast = out["rungs"]
    # its change is the paired figure: 60 ms over 1.41, less 60 ms; the windows' categories scaled to it
    assert sdpa["ms_per_step"] == pytest.approx(60.0 / 1.41 - 60.0) and sdpa["step_ms"] == pytest.approx(60.0 / 1.41)
    [moved] = sdpa["moved"]
    assert moved["category"] == "attention" and moved["before_ms"] == pytest.approx(19.1)
    assert moved["after_ms"] == pytest.approx(1.9 * (60.0 / 1.41) / 42.6)
    assert autocast["step_ms"] == pytest.approx(60.0 / 1.41 / 1.42)
    assert sdpa["peak_memory_delta_bytes"] == -13_600_000_000
    assert sdpa["line"] == "sdpa: 1.41x, −17.4 ms per step, attention 19.1 → 1.9 ms, peak memory −13.6 GB"
    assert autocast["moved"][0]["category"] == "gemm" and "peak memory" not in autocast["line"]
    assert out["product"] == pytest.approx(1.41 * 1.42)
    assert out["agrees"] is True and out["interaction"] is None  # 2.002 against 2.0
    shares = [r["share"] for r in out["rungs"]]
    assert sum(shares) == pytest.approx(1.0) and shares[0] == pytest.approx(math.log(1.41) / math.log(1.41 * 1.42))


def test_gains_that_overlap_are_named_as_an_interaction_with_the_rung_that_differs_most():
    # autocast measured 1.9x when it was kept (early, on a GEMM-heavy step), gives 1.42x in the final order
    decisions = {"sdpa": (("sdpa",), 1.41), "autocast": (("autocast",), 1.9)}
    out = attribute(["sdpa", "autocast"], decisions, WINDOWS, measured=2.0, labels=LABELS)
    assert out["agrees"] is False
    text = out["interaction"]
    assert "multiply to 2.68x against 2.00x" in text and "most in autocast: 1.90x when it was kept, 1.42x" in text
    assert "cut part of the same time" in text


def test_a_group_kept_together_carries_its_gain_once():
    decisions = {"sdpa": (("sdpa", "autocast"), 2.0), "autocast": (("sdpa", "autocast"), 2.0)}
    out = attribute(["sdpa", "autocast"], decisions, WINDOWS, measured=2.0, labels=LABELS)
    assert [r["speedup"] for r in out["rungs"]] == [2.0, None]
    assert out["product"] == 2.0 and out["agrees"] is True
    assert out["rungs"][0]["line"].startswith("sdpa (kept with autocast): 2.00x")
    assert out["rungs"][1]["group"] == ["sdpa", "autocast"]


def test_a_rung_without_a_decision_or_a_measured_total_is_reported_as_far_as_known():
    out = attribute(["sdpa"], {}, WINDOWS[:2], measured=None, labels=LABELS)
    assert out["rungs"][0]["speedup"] is None and out["product"] is None and out["agrees"] is None
    with pytest.raises(ValueError, match="expected 3 profile windows"):
        attribute(["sdpa", "autocast"], {}, WINDOWS[:2], measured=None)


def test_a_kept_gain_is_never_shown_as_a_loss_where_the_profile_windows_say_otherwise():
    # a host-bound step: the profiler's own overhead made the window with the rung slower (31 against
    # 30 ms) where the paired decision kept it at 1.25x; its line is the decision's, scaled to the final
    # check's baseline step time, and the categories are read at the paired step times
    windows = [_window(30.0, 0, host_idle=20.0, gemm=10.0), _window(31.0, 0, host_idle=21.0, gemm=10.0)]
    out = attribute(["compile"], {"compile": (("compile",), 1.25)}, windows, measured=1.25, labels=LABELS, baseline_ms=24.0)
    [rung] = out["rungs"]
    assert rung["ms_per_step"] == pytest.approx(24.0 / 1.25 - 24.0) and rung["window_ratio"] < 1
    assert rung["line"].startswith("compile: 1.25x, −4.8 ms per step")
    moved = rung["moved"][0]  # host idle: 16.0 of the paired 24 ms before, 21/31 of 19.2 ms after
    assert (
        moved["category"] == "host_idle"
        and moved["before_ms"] == pytest.approx(16.0)
        and moved["after_ms"] == pytest.approx(21.0 / 31.0 * 19.2)
    )


def test_small_changes_are_not_called_moves():
    before = {"gemm": 10.0, "elementwise": 5.0, "loss": 1.0}
    after = {"gemm": 9.9, "elementwise": 2.0, "loss": 0.99}
    assert moved_categories(before, after, step_ms=20.0) == [{"category": "elementwise", "before_ms": 5.0, "after_ms": 2.0}]
