"""The trials' one time budget (:class:`TrialBudget`) and the comparisons' window length (:func:`window_steps`).

One budget covers everything the trials do after :meth:`TrialBudget.start`: the baseline, the
diagnosis, every rung's parity, (re)compiles and comparison, the second looks, the switches, the final
check and the profile. Its size is a rule of the baseline's step time (:meth:`TrialBudget.plan`);
a share of it is held back for the closing phases (the switches, the final check, the profile), and
the rest is split among the rungs the plan will time, weighted by their bounds (:meth:`TrialBudget.plan_rungs`:
a rung that does not apply takes no share). Once the share for the rungs is spent, no
further rung is begun (each says it was not tried, and why), second looks stop, and the closing
phases run on what is held back for them. The time each phase took is recorded (``phases``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from speedkit.measure.config import MeasureConfig
from speedkit.measure.noise import noise_source
from speedkit.results import Measurement

#: profile windows held back for: the baseline, the final configuration and up to four kept rungs between
PROFILE_WINDOWS = 6
#: seconds one profile window takes beyond its steps (the profiler's start, stop and trace processing)
PROFILE_WINDOW_OVERHEAD_S = 1.0


class TrialBudget:
    """The seconds the trials may take, counted on ``host_clock`` from :meth:`start`, and the seconds
    each phase took (``phases``)."""

    def __init__(self, cfg: MeasureConfig, host_clock: Callable[[], float]) -> None:
        self.cfg, self.host_clock = cfg, host_clock
        self.started = 0.0  # host clock at the start of the trials
        self.budget_s = cfg.trials_budget_s
        #: held back for the closing phases (set by :meth:`plan`)
        self.reserve_s = 0.0
        #: the fewest seconds a rung's trial takes (set by :meth:`plan`)
        self.min_trial_s = 0.0
        self._parity_steps = cfg.parity_steps  # a rung's parity trajectory (set by :meth:`plan`)
        #: the comparisons' window length in steps (set by :meth:`plan`)
        self.window_steps: int | None = None
        #: seconds per phase, in the order first entered
        self.phases: dict[str, float] = {}
        #: the rungs the plan will time and their weights in the split of the rungs' time (:meth:`plan_rungs`)
        self.weights: dict[str, float] = {}
        #: the rungs tried already (their weight has left the split)
        self.done: set[str] = set()
        self._phase: str | None = None
        self._phase_from = 0.0
        #: seconds from the start at which the closing phases began (None: not yet, :meth:`begin_closing`)
        self.closing_from: float | None = None

    def start(self) -> None:
        self.started = self._phase_from = self.host_clock()

    def elapsed(self) -> float:
        return self.host_clock() - self.started

    def enter(self, phase: str) -> None:
        """The trials go on in ``phase``: the time since the last call is the previous phase's."""
        now = self.host_clock()
        if self._phase is not None:
            self.phases[self._phase] = self.phases.get(self._phase, 0.0) + now - self._phase_from
        self._phase, self._phase_from = phase, now

    def phase_times(self) -> dict[str, float]:
        """Seconds per phase so far, the current one included, rounded for the report."""
        times = dict(self.phases)
        if self._phase is not None:
            times[self._phase] = times.get(self._phase, 0.0) + self.host_clock() - self._phase_from
        return {name: round(seconds, 2) for name, seconds in times.items()}

    def plan(
        self, baseline: Measurement, planned_steps: int | None, window_steps: int | None = None, parity_steps: int | None = None
    ) -> dict[str, Any]:
        """The budget's size, by rule:

        - ``trials_budget_s`` (110 s) for a step of up to ``budget_step_ms`` (100 ms);
        - a longer step: that many seconds per ``budget_step_ms`` of step time (the same number of
          windows and parity steps), up to ``trials_budget_max_s``;
        - where the fit's planned length is known: at most ``trials_share`` of it (its planned steps at
          the baseline's step time), never under ``trials_min_s``.

        Held back for the closing phases: the switches' and the final check's comparisons at the
        fewest blocks (``min_blocks`` A B B A blocks of ``window_steps`` steps each) and the profile's
        windows, at most half the budget. A rung is begun only while the rungs' share has room for its
        fewest steps (``min_trial_s``: its parity trajectory, warm-up and ``min_blocks`` blocks at the
        baseline's step time; a compile on top is not known in advance)."""
        cfg = self.cfg
        step_ms = baseline.step_ms if baseline.step_ms and math.isfinite(baseline.step_ms) else 0.0
        size, rule = self.size(step_ms, planned_steps, explain=True)
        self.budget_s = size
        self.window_steps = window_steps or cfg.steps
        self._parity_steps = parity_steps or cfg.parity_steps
        self.reserve_s = self._closing_s(step_ms, step_ms)
        self.min_trial_s = self._fewest_trial_s(step_ms)
        return {
            "budget_s": round(self.budget_s, 1),
            "rule": rule,
            "held_for_closing_s": round(self.reserve_s, 1),
            "skipped": [],
        }

    def size(self, step_ms: float, planned_steps: int | None, explain: bool = False) -> Any:
        """The budget's size for a step of ``step_ms`` in a fit of ``planned_steps`` (:meth:`plan`'s rule);
        with ``explain``, ``(seconds, the rule in words)``."""
        cfg = self.cfg
        by_step = cfg.trials_budget_s * max(1.0, step_ms / cfg.budget_step_ms)
        size = min(cfg.trials_budget_max_s, by_step)
        if step_ms > cfg.budget_step_ms:
            rule = (
                f"{cfg.trials_budget_s:.0f} s per {cfg.budget_step_ms:.0f} ms of step ({step_ms:.1f} ms), "
                f"at most {cfg.trials_budget_max_s:.0f} s"
            )
        else:
            rule = f"{cfg.trials_budget_s:.0f} s for a step of up to {cfg.budget_step_ms:.0f} ms ({step_ms:.1f} ms)"
        planned_s = (
            planned_steps * step_ms / 1e3 if planned_steps and math.isfinite(planned_steps) and planned_steps > 0 else None
        )
        if planned_s is not None and cfg.trials_share * planned_s < size:
            size = max(cfg.trials_min_s, cfg.trials_share * planned_s)
            rule += (
                f"; {cfg.trials_share:.0%} of the fit's planned {planned_s:.0f} s ({planned_steps} steps), "
                f"at least {cfg.trials_min_s:.0f} s"
            )
        return (size, rule) if explain else size

    def _closing_s(self, base_ms: float, pace_ms: float) -> float:
        """Seconds held back for the closing phases, at most half the budget: the final configuration
        against the switches (both at ``pace_ms``, the floor's step) and against the baseline
        (``base_ms``) at their fewest blocks, and the profile's windows (the baseline's, the rest at the
        floor's pace), each with the profiler's own start and stop (on an H200, 7 windows of a 3 ms step
        took 8.6 s, not 0.1 s)."""
        cfg = self.cfg
        closing = (self.comparison_s(pace_ms, pace_ms) if cfg.switches_floor else 0.0) + (
            self.comparison_s(base_ms, pace_ms) if cfg.final_check else 0.0
        )
        steps = cfg.profile_steps + 1
        profile_s = (
            PROFILE_WINDOWS * PROFILE_WINDOW_OVERHEAD_S + steps * (base_ms + (PROFILE_WINDOWS - 1) * pace_ms) / 1e3
            if cfg.profile
            else 0.0
        )
        return min(0.5 * self.budget_s, closing + profile_s)

    def _fewest_trial_s(self, pace_ms: float) -> float:
        """A rung's fewest seconds at ``pace_ms`` a step: its parity trajectory (with and without it) and
        a comparison at the fewest blocks."""
        return self.comparison_s(pace_ms, pace_ms) + 2 * self._parity_steps * pace_ms / 1e3

    def at_the_floor(self, base_ms: float, pace_ms: float) -> float:
        """Hold back for the closing phases at the floor's step time ``pace_ms`` (the user's switches,
        measured), not the baseline's: they time the final configuration, which is at most as slow
        (a 340 ms fp32 step whose switches run at 53 ms had 60 s held where 26 s is what they take).
        A rung's fewest steps (:attr:`min_trial_s`) are then the floor's too, on which the rungs are
        tried: at the baseline's, a 1.5 s fp32 step whose switches ran at 163 ms on two H200s counted
        114 s for a trial that takes 12, and no rung was begun with 110 s of the budget left.
        Returns the seconds now held."""
        if math.isfinite(base_ms) and math.isfinite(pace_ms) and 0 < pace_ms < base_ms:
            self.reserve_s = self._closing_s(base_ms, pace_ms)
            self.min_trial_s = self._fewest_trial_s(pace_ms)
        return self.reserve_s

    def comparison_s(self, a_ms: float, b_ms: float) -> float:
        """Seconds a comparison at the fewest blocks takes between steps of ``a_ms`` and ``b_ms``: its
        warm-up and settling at the slower, then ``min_blocks`` A B B A blocks of windows (each with its
        settling steps)."""
        cfg = self.cfg
        window = self.window_steps or cfg.steps
        slower = max(a_ms, b_ms) / 1e3
        return slower * (cfg.warmup + 2 * cfg.settle) + 2 * cfg.min_blocks * (window + cfg.settle) * (a_ms + b_ms) / 1e3

    def remaining(self) -> float:
        """Seconds left of the whole budget."""
        return self.budget_s - self.elapsed()

    def begin_closing(self) -> None:
        """The closing phases begin: from now they own what is held back for them (``reserve_s``), whatever
        the phases before took (a remedy tried past the rungs' share, a compile longer than expected: on
        an H100 the demo Transformer's remedy compiled for 60 s, the final check found 3 s left and was
        skipped, and the chain's figure, 44% under what the fit ran, stood for it)."""
        if self.closing_from is None:
            self.closing_from = self.elapsed()

    def closing_left(self) -> float:
        """Seconds left for the closing phases: what is left of the budget, or, once they began, of what
        was held back for them, whichever is more (the trials then end at most ``reserve_s`` past the
        rungs' overrun, never a closing comparison's length past the budget otherwise)."""
        remaining = self.remaining()
        if self.closing_from is None:
            return remaining
        return max(remaining, self.reserve_s - (self.elapsed() - self.closing_from))

    def left_for_rungs(self) -> float:
        """Seconds left for the rungs' trials and second looks: the budget less what is held back."""
        return self.remaining() - self.reserve_s

    def spent(self) -> bool:
        """The rungs' share has no room for another rung's fewest steps: no further rung is begun, no
        second look taken."""
        return self.left_for_rungs() < self.min_trial_s

    def plan_rungs(self, bounds: dict[str, float | None]) -> dict[str, float]:
        """Weigh the rungs the plan will time (those that apply, not pruned) by their bound (the most each
        can gain: :func:`speedkit.engine.plan.gain_bound`; None where the diagnosis cannot bound it): the
        rungs' time is split among them by these weights (:meth:`for_comparison`), so that a rung that
        can gain 30% gets more blocks than one bounded at 2%, and a rung that does not apply gets none.
        Returns the weights."""
        self.weights = {name: rung_weight(bound) for name, bound in bounds.items()}
        self.done = set()
        return dict(self.weights)

    def done_with(self, *names: str) -> None:
        """``names`` were tried (or found not to apply): their weight leaves the split."""
        self.done.update(names)

    def for_comparison(self, name: str | None, whole: bool = False) -> float:
        """Seconds the comparison deciding rung ``name`` may take: its weight's share of the rungs' time left
        among the rungs the plan will still time, itself included (a rung the plan did not weigh, or a
        comparison of several, weighs as one unbounded rung); ``whole``: all of it. Never more than
        ``budget_s``."""
        left = max(0.0, self.left_for_rungs())
        if whole:
            return min(self.cfg.budget_s, left)
        remaining = {n: w for n, w in self.weights.items() if n not in self.done}
        own = remaining.get(name, rung_weight(None)) if name is not None else rung_weight(None)
        total = sum(remaining.values()) + (0.0 if name in remaining else own)
        return min(self.cfg.budget_s, left * own / total) if total > 0 else min(self.cfg.budget_s, left)

    def for_group(self, names: list[str]) -> float:
        """Seconds the comparison of several rungs together may take (the remedy's bundle): their weights'
        share of the rungs' time left; the rungs are tried then (their weight leaves the split)."""
        left = max(0.0, self.left_for_rungs())
        remaining = {n: w for n, w in self.weights.items() if n not in self.done}
        own = sum(remaining.get(n, 0.0) for n in names) or rung_weight(None)
        total = sum(remaining.values()) + (0.0 if any(n in remaining for n in names) else own)
        self.done_with(*names)
        return min(self.cfg.budget_s, left * own / total) if total > 0 else min(self.cfg.budget_s, left)

    def for_floor(self) -> float:
        """Seconds the user's switches' comparison against the baseline may take: the share of a heavily
        weighted rung among the few a plan usually times (a third of the rungs' time), never more than
        ``budget_s``."""
        return min(self.cfg.budget_s, max(0.0, self.left_for_rungs()) / 3)

    def for_closing(self, phases_left: int) -> float:
        """Seconds a closing phase's comparison may take: its share of the whole budget left among the
        ``phases_left`` closing comparisons (itself included), never more than ``budget_s``."""
        return min(self.cfg.budget_s, max(0.0, self.closing_left()) / max(1, phases_left))


#: the bound at which a rung weighs as one (an unbounded rung's weight), and the range of weights
WEIGHT_AT_BOUND = 1.10
WEIGHT_RANGE = (0.25, 2.0)


def rung_weight(bound: float | None) -> float:
    """A rung's weight in the split of the comparisons' time: ``ln(bound) / ln(1.10)`` within
    :data:`WEIGHT_RANGE` (a rung bounded at 30% weighs 2, one at 2% a quarter); one where it is not
    bounded."""
    if bound is None or not math.isfinite(bound) or bound <= 1.0:
        return 1.0 if bound is None or not math.isfinite(bound) else WEIGHT_RANGE[0]
    low, high = WEIGHT_RANGE
    return max(low, min(high, math.log(bound) / math.log(WEIGHT_AT_BOUND)))


def window_steps(baseline: Measurement, cfg: MeasureConfig, clock_name: str) -> dict[str, Any]:
    """The comparisons' window length, by time: at least ``window_s`` seconds at the baseline's step
    time, at least ``min_window_steps`` and at most ``max_window_steps`` steps (a 340 ms step gets
    windows of 3 steps, not the baseline's 10: blocks of 14 s had left a data-bound step's budget no
    room for the one rung that could help it). Longer windows do not cut the
    noise of a block much (on H200s, blocks of 40-step windows varied by 5.7% against 3.9% at 10: the
    noise comes in spells longer than a window), so precision is bought with more paired blocks, whose
    number the comparison's design sizes from the baseline's spread (returned as ``baseline_spread``,
    the planned noise). Also the spread's likely source."""
    step_s = baseline.step_ms / 1e3 if baseline.step_ms and math.isfinite(baseline.step_ms) else 0.0
    steps = steps_for_window(step_s * 1e3, cfg)
    return {
        "baseline_spread": baseline.spread,
        "window_steps": steps,
        "window_s": round(steps * step_s, 3),
        "source": noise_source(baseline, cfg.host_bound_share, cfg.busy_util),
    }


def steps_for_window(step_ms: float, cfg: MeasureConfig) -> int:
    """Steps in a window of at least ``window_s`` at ``step_ms`` a step, within ``min_window_steps`` (two at
    most for a step of ``slow_step_ms`` or more) and ``max_window_steps`` (``steps`` where the step time is
    unknown: 0)."""
    by_time = math.ceil(cfg.window_s * 1e3 / step_ms) if step_ms > 0 else cfg.steps
    fewest = min(cfg.min_window_steps, 2) if step_ms >= cfg.slow_step_ms else cfg.min_window_steps  # a slow step: 2
    return max(fewest, min(cfg.max_window_steps, by_time))
