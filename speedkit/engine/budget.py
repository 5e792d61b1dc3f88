"""The trials' time budget (:class:`TrialBudget`: a share of the fit's planned time, split among the
comparisons left) and the comparisons' window length from the baseline's noise (:func:`window_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from speedkit.measure.config import MeasureConfig
from speedkit.measure.noise import noise_source
from speedkit.results import Measurement


class TrialBudget:
    """The seconds the trials may take, counted on ``host_clock`` from :meth:`start`."""

    def __init__(self, cfg: MeasureConfig, host_clock: Callable[[], float]) -> None:
        self.cfg, self.host_clock = cfg, host_clock
        self.started = 0.0  # host clock at the start of the trials
        self.budget_s = cfg.trials_budget_s

    def start(self) -> None:
        self.started = self.host_clock()

    def elapsed(self) -> float:
        return self.host_clock() - self.started

    def plan(self, baseline: Measurement, planned_steps: int | None) -> dict[str, Any]:
        """The trials' time budget: ``trials_share`` of the fit's planned time (its planned steps at
        the baseline's step time), never under ``trials_min_s``, never over ``trials_budget_s``; the
        cap alone where the fit's length is not known. It bounds the comparisons (each gets its share
        of what is left, at least ``min_blocks`` blocks) and the second looks (once it is spent, only
        the first pass's groups are judged, the rest is skipped); every rung is still tried (parity and
        ``min_blocks`` blocks), and the switches floor, the final check and the second look's
        first-pass groups run in full (``budget_s`` each), so the trials can overrun it by that
        much, which the report shows.
        Compiled graphs are reused across A and B (a rung is suspended and resumed, not rebuilt)."""
        cfg = self.cfg
        planned = planned_steps
        planned_s = planned * baseline.step_ms / 1e3 if planned and math.isfinite(planned) and planned > 0 else None
        if planned_s is None:
            self.budget_s, rule = cfg.trials_budget_s, f"the cap ({cfg.trials_budget_s:.0f} s): the fit's length is not known"
        else:
            self.budget_s = min(cfg.trials_budget_s, max(cfg.trials_min_s, cfg.trials_share * planned_s))
            rule = (
                f"{cfg.trials_share:.0%} of the fit's planned {planned_s:.0f} s ({planned} steps at the baseline's "
                f"{baseline.step_ms:.1f} ms), within [{cfg.trials_min_s:.0f}, {cfg.trials_budget_s:.0f}] s"
            )
        return {"budget_s": round(self.budget_s, 1), "rule": rule, "skipped": []}

    def remaining(self) -> float:
        return self.budget_s - self.elapsed()

    def for_comparison(self, rungs_left: int) -> float:
        """Seconds the next comparison of the climb, a closing check or a second look may take: its
        share of the budget left (the ``rungs_left`` in the climb, the switches and the final check),
        never more than ``budget_s`` (the switches' and the final check's own comparisons, and those
        given a whole budget, get ``budget_s``)."""
        return min(self.cfg.budget_s, max(0.0, self.remaining()) / (rungs_left + 2))


def window_steps(baseline: Measurement, cfg: MeasureConfig, clock_name: str) -> dict[str, Any]:
    """How much the baseline's windows vary, its likely source, and the window length the
    comparisons use (``window_steps``): where the spread is over ``noise_target`` on a device the host
    drives, windows are lengthened (the noise of a window's mean falls with the square root of its
    steps), up to ``max_window_factor`` times. speedkit's own share is removed where it can be: no
    telemetry thread during comparisons, and its loaders' workers kept off the training thread's
    core (``data_path``); the garbage collector's full passes, a share of a host-bound step in a
    large process, are the ``gc_freeze`` rung's to cut, in the trials as in the fit."""
    spread = baseline.spread
    factor = 1
    # on a CPU (the step clock is the host's) the noise is mostly other processes and the clock's
    # frequency, which come in spells longer than a window: longer windows would cost without helping
    if spread > cfg.noise_target > 0 and clock_name != "perf_counter":
        factor = min(cfg.max_window_factor, math.ceil((spread / cfg.noise_target) ** 2))
    return {
        "baseline_spread": spread,
        "window_steps": cfg.steps * max(1, factor),
        "source": noise_source(baseline, cfg.host_bound_share, cfg.busy_util),
    }
