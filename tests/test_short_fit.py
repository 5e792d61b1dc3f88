"""Trials sized to the fit: a fit too short to pay back its trials (its planned steps at the baseline's
step time under ten times the trials' budget) runs none. It applies the decision the cache holds for its
model and settings where there is one (without timing it), else trains as set up; one line says why and
how to get trials (``speedkit optimize``, a longer fit, or ``SpeedLadder(trials="always")``)."""

from __future__ import annotations

import warnings

import pytest
from test_lightning import QUICK, Recorder, _fit_user_model

from speedkit.engine.ladder import PAYBACK
from speedkit.errors import ConfigError
from speedkit.lightning import SpeedLadder

RUNGS = ["fused_optimizer", "gc_freeze"]


def _fit(ladder, max_steps):
    recorder = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_user_model(ladder, recorder, max_steps=max_steps)
    return recorder, [str(w.message) for w in caught if "speedkit" in str(w.message)]


def test_a_fit_too_short_to_pay_back_its_trials_runs_none_and_says_how_to_get_them(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ladder = SpeedLadder(rungs=RUNGS, trials=True, measure=QUICK)
    plain = Recorder()
    _fit_user_model(plain, max_steps=6)
    recorded, said = _fit(ladder, max_steps=6)
    assert ladder.result is None and ladder.handles == [] and not ladder.applied_changes
    assert "too short to pay back its trials" in ladder.not_run and f"under {PAYBACK}x the trials'" in ladder.not_run
    [line] = [s for s in said if "too short" in s]
    assert "speedkit optimize" in line and "a longer fit" in line and 'SpeedLadder(trials="always")' in line
    assert line.endswith("SpeedLadder() applies no rungs.")
    # trained as set up: the same losses as the fit without speedkit (the parity reference's steps put back)
    assert recorded.losses == plain.losses


def test_a_short_fit_applies_the_decision_an_earlier_fit_cached_without_timing_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # a forced decision, so that the earlier fit keeps what this test needs it to
    monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("kept", "forced by the test"))
    earlier = SpeedLadder(rungs=RUNGS, trials="always", measure=QUICK)
    _fit(earlier, max_steps=6)
    decided = [r.name for r in earlier.result.kept]
    assert decided and earlier.result.run["cache"]["hit"] is False
    lines: list[str] = []
    short = SpeedLadder(rungs=RUNGS, trials=True, measure=QUICK, on_event=lines.append)
    _fit(short, max_steps=6)
    result = short.result
    assert [r.name for r in result.kept] == decided and list(short.applied_changes) == decided
    note = result.run["cache"]
    assert note["held"] is True and note["applied_untimed"] is True and "too short" in result.run["short_fit"]
    assert any("applying the decision of an earlier fit without timing it" in line for line in lines), lines
    # no comparison ran in this fit: its figures are the earlier fit's, said where they were measured
    assert result.run["budget"] if "budget" in result.run else True
    assert all(r.comparison is None for r in result.rungs if r.status == "kept")
    assert "the fit that made the cached decision" in (result.figures()["check"] or {}).get("measured_in", "")


def test_trials_always_runs_them_whatever_the_fits_length_and_a_bad_value_is_one_clear_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ladder = SpeedLadder(rungs=RUNGS, trials="always", measure=QUICK, cache=False)
    _fit(ladder, max_steps=6)
    assert ladder.result is not None and ladder.not_run is None and "short_fit" not in ladder.result.run
    with pytest.raises(ConfigError, match='expected True, False, "always" or None'):
        SpeedLadder(trials="sometimes")
