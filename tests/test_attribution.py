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
    assert sdpa["ms_per_step"] == pytest.approx(-17.4)
    assert sdpa["moved"] == [{"category": "attention", "before_ms": 19.1, "after_ms": 1.9}]
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


def test_small_changes_are_not_called_moves():
    before = {"gemm": 10.0, "elementwise": 5.0, "loss": 1.0}
    after = {"gemm": 9.9, "elementwise": 2.0, "loss": 0.99}
    assert moved_categories(before, after, step_ms=20.0) == [{"category": "elementwise", "before_ms": 5.0, "after_ms": 2.0}]
