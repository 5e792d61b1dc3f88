"""Attribution: each kept rung's figure (the account's), its share, the categories it moved between the
profile windows before and after it, and the check that the chain's product agrees with the final check
(3%), or the interaction named with its figures."""

from __future__ import annotations

import math

import pytest

from speedkit.figures.attribution import attribute, moved_categories

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


def _rungs(base_ms: float, *links: tuple[tuple[str, ...], float]) -> list[dict]:
    """The account's rungs in the final order: each link's figure on its first rung, the chain's step times."""
    out, before = [], base_ms
    for names, speedup in links:
        after = before / speedup
        for i, name in enumerate(names):
            group = list(names) if len(names) > 1 else None
            text = f"{speedup:.2f}×" if not group else f"with its group ({' + '.join(names)}): {speedup:.2f}×"
            out.append(
                {
                    "name": name,
                    "group": group,
                    "speedup": speedup if i == 0 else None,
                    "figure": text,
                    "step_before": before,
                    "step_after": after,
                }
            )
        before = after
    return out


def test_each_rung_says_what_it_moved_and_the_gains_multiply_to_the_measured_total():
    rungs = _rungs(60.0, (("sdpa",), 1.41), (("autocast",), 1.42))
    out = attribute(rungs, WINDOWS, product=1.41 * 1.42, measured=2.0, labels=LABELS)
    sdpa, autocast = out["rungs"]
    # its change is the chain's: 60 ms over 1.41, less 60 ms; the windows' categories scaled to it
    assert sdpa["ms_per_step"] == pytest.approx(60.0 / 1.41 - 60.0) and sdpa["step_ms"] == pytest.approx(60.0 / 1.41)
    [moved] = sdpa["moved"]
    assert moved["category"] == "attention" and moved["before_ms"] == pytest.approx(19.1)
    assert moved["after_ms"] == pytest.approx(1.9 * (60.0 / 1.41) / 42.6)
    assert autocast["step_ms"] == pytest.approx(60.0 / 1.41 / 1.42)
    assert sdpa["peak_memory_delta_bytes"] == -13_600_000_000
    assert sdpa["line"] == "sdpa: 1.41×, −17.4 ms per step, attention 19.1 → 1.9 ms, peak memory −13.6 GB"
    assert autocast["moved"][0]["category"] == "gemm" and "peak memory" not in autocast["line"]
    assert out["product"] == pytest.approx(1.41 * 1.42)
    assert out["agrees"] is True and out["interaction"] is None  # 2.002 against 2.0
    shares = [r["share"] for r in out["rungs"]]
    assert sum(shares) == pytest.approx(1.0) and shares[0] == pytest.approx(math.log(1.41) / math.log(1.41 * 1.42))


def test_gains_that_overlap_are_named_as_an_interaction_with_the_rung_that_differs_most():
    # autocast measured 1.9x when it was kept (early, on a GEMM-heavy step), gives 1.42x in the final order
    rungs = _rungs(60.0, (("sdpa",), 1.41), (("autocast",), 1.9))
    out = attribute(rungs, WINDOWS, product=1.41 * 1.9, measured=2.0, labels=LABELS)
    assert out["agrees"] is False
    text = out["interaction"]
    assert "multiply to 2.68× against 2.00×" in text and "most in autocast: 1.90× when it was kept, 1.42×" in text
    assert "cut part of the same time" in text


def test_a_group_kept_together_carries_its_gain_once_and_names_its_group():
    rungs = _rungs(60.0, (("sdpa", "autocast"), 2.0))
    out = attribute(rungs, WINDOWS, product=2.0, measured=2.0, labels=LABELS)
    assert [r["speedup"] for r in out["rungs"]] == [2.0, None]
    assert out["product"] == 2.0 and out["agrees"] is True
    assert out["rungs"][0]["line"].startswith("sdpa: with its group (sdpa + autocast): 2.00×")
    assert out["rungs"][1]["line"].startswith("autocast: with its group (sdpa + autocast): 2.00×")
    assert out["rungs"][1]["group"] == ["sdpa", "autocast"] and out["rungs"][1]["ms_per_step"] is None


def test_a_rung_without_a_figure_or_a_measured_total_is_reported_as_far_as_known():
    rungs = [{"name": "sdpa", "group": None, "speedup": None, "figure": "—", "step_before": None, "step_after": None}]
    out = attribute(rungs, WINDOWS[:2], product=None, measured=None, labels=LABELS)
    assert out["rungs"][0]["speedup"] is None and out["product"] is None and out["agrees"] is None
    with pytest.raises(ValueError, match="expected 3 profile windows"):
        attribute(rungs * 2, WINDOWS[:2], product=None, measured=None)


def test_a_kept_gain_is_never_shown_as_a_loss_where_the_profile_windows_say_otherwise():
    # a host-bound step: the profiler's own overhead made the window with the rung slower (31 against
    # 30 ms) where the paired decision kept it at 1.25x; its line is the chain's, from the baseline's
    # 24 ms, and the categories are read at the chain's step times
    windows = [_window(30.0, 0, host_idle=20.0, gemm=10.0), _window(31.0, 0, host_idle=21.0, gemm=10.0)]
    out = attribute(_rungs(24.0, (("compile",), 1.25)), windows, product=1.25, measured=1.25, labels=LABELS)
    [rung] = out["rungs"]
    assert rung["ms_per_step"] == pytest.approx(24.0 / 1.25 - 24.0) and rung["window_ratio"] < 1
    assert rung["line"].startswith("compile: 1.25×, −4.8 ms per step")
    moved = rung["moved"][0]  # host idle: 16.0 of the chain's 24 ms before, 21/31 of 19.2 ms after
    assert (
        moved["category"] == "host_idle"
        and moved["before_ms"] == pytest.approx(16.0)
        and moved["after_ms"] == pytest.approx(21.0 / 31.0 * 19.2)
    )


def test_small_changes_are_not_called_moves():
    before = {"gemm": 10.0, "elementwise": 5.0, "loss": 1.0}
    after = {"gemm": 9.9, "elementwise": 2.0, "loss": 0.99}
    assert moved_categories(before, after, step_ms=20.0) == [{"category": "elementwise", "before_ms": 5.0, "after_ms": 2.0}]
