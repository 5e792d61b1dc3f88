"""The ladder's policy: the order of the phases, and little else.

diagnose → plan → decide → confirm, each phase a verb of its own module taking the ladder (the
:class:`~speedkit.engine.trials.Trials` it satisfies):

1. the baseline: its parity reference, tolerances and measurement, the trials' budget
   (:mod:`speedkit.engine.baseline`); a fit too short to pay back its trials runs none (:meth:`Ladder.too_short`);
2. the decision cache: a decision of an earlier fit of the same model and settings, re-checked in seconds
   (:mod:`speedkit.engine.cache_check`);
3. the floor: the user's switches together, as the user runs them (:mod:`speedkit.engine.switches`);
4. the diagnosis and the plan: what sets the step's pace, which rungs are worth timing and with how
   much of the budget, which go first (:mod:`speedkit.engine.baseline`, :mod:`speedkit.engine.plan`);
5. the climb: the remedy's bundle together (:mod:`speedkit.engine.remedy`), then each rung's trial
   (:mod:`speedkit.engine.climb`, :mod:`speedkit.engine.trial`): applied at its place, its numerics judged,
   timed against the configuration before it (:mod:`speedkit.engine.comparison`), kept or undone;
6. the second looks: a group kept together judged member by member, the kept rungs that ask for it
   judged with the later rungs on top, the rungs reverted on speed judged again on the final
   configuration (:mod:`speedkit.engine.second_look`, :mod:`speedkit.engine.closing_check`);
7. confirm: the final configuration against the switches and the baseline, ending on the better of the
   baseline and the floor where it is not shown faster (:mod:`speedkit.engine.confirm`); the scaling
   across ranks and the profile.

Every decision goes in the run's ledger (``result.ledger``); every printed figure is derived from it
once the decisions are final (:func:`speedkit.figures.account.account`). Every trial starts from the
snapshot taken before the ladder, and the snapshot is restored at the end (weights, optimizer state,
schedulers, grad scaler, data generators, RNG), so none of the trial steps leak into training. A rung
that raises is undone and reported as failed; the ladder goes on. An interruption (Ctrl-C, SIGTERM), a
dead loader or an error the ladder cannot attribute to a rung undoes every change, restores the
snapshot, keeps the rungs finished so far in ``ladder.result`` and re-raises.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from speedkit import compat, distributed
from speedkit.engine import cache_check, remedy, second_look, switches
from speedkit.engine.baseline import (
    TrialsNotRun,
    baseline_pace_s,
    baseline_reference,
    baseline_setup,
    diagnose_baseline,
    measure_baseline,
    planned_bounds,
    trial_order,
)
from speedkit.engine.budget import TrialBudget
from speedkit.engine.cache import CachedDecision, DecisionCache
from speedkit.engine.climb import climb, fresh_compile_s, no_room_for_remedy, note_trial_compile
from speedkit.engine.closing_check import closing_check
from speedkit.engine.confirm import confirm, scaling_and_profile
from speedkit.engine.diagnose import Diagnosis
from speedkit.engine.parity import ParityCheck
from speedkit.engine.stack import Slot, Stack, agreed_check
from speedkit.engine.stop import StopRequests, loader_died
from speedkit.engine.timing import Timing
from speedkit.errors import first_line
from speedkit.fork_safety import protect_forked_children
from speedkit.handle import Handle
from speedkit.kernels import choice as kernel_choice
from speedkit.measure.clock import StepClock
from speedkit.measure.config import MeasureConfig
from speedkit.measure.session import MeasureSession
from speedkit.results import SCHEMA_VERSION, LadderResult, PairedResult, RungResult
from speedkit.rungs.base import Rung
from speedkit.training.snapshot import Snapshot
from speedkit.training.state import TrainState

#: a fit whose planned time is under this many times the trials' budget runs none (it cannot pay them back)
PAYBACK = 10


class Ladder:
    """Climb ``rungs`` on ``state``, measuring each.

    Args:
        state: the training objects (model, optimizer, step, data, device).
        rungs: the rungs to try, in order.
        measure: a :class:`MeasureConfig` or a dict of its fields (defaults from configs).
        recipe: the recipe path, recorded in the report.
        on_event: called with progress lines (the CLI and the callback print them).
        clock: the step clock (tests inject a fake backend); host_clock: the host's (likewise).
        run_info: the run's settings to record (precision, accumulation, clipping, strategy).
        planned_steps: the optimizer steps the fit plans, where known: the trials' time budget is a
            share of the fit's planned time (see :meth:`TrialBudget.plan`), and a fit under
            :data:`PAYBACK` times that budget runs none (``short_fit``).
        cache: where decisions are kept (None: climbs every time, keeps nothing).
        short_fit: True: a fit too short to pay back its trials runs none (:meth:`too_short`; ``SpeedLadder()``'s
            default, not ``trials="always"``); False (the default here): trials whatever the fit's length.

    The mechanisms are its parts: ``stack`` (the slots of the kept rungs, switched on and off),
    ``parity`` (trajectories and their envelope), ``budget`` (the trials' time) and, during a run,
    ``timing`` (windows and A/B comparisons). After :meth:`run`, the kept rungs stay applied on the
    restored initial state (``handles``); :meth:`revert` undoes them. ``result`` holds the report so far,
    also after an interruption.
    """

    def __init__(
        self,
        state: TrainState,
        rungs: list[Rung],
        measure: MeasureConfig | dict[str, Any] | None = None,
        *,
        recipe: str | None = None,
        on_event: Callable[[str], None] | None = None,
        clock: StepClock | None = None,
        host_clock: Callable[[], float] = time.perf_counter,
        run_info: dict[str, Any] | None = None,
        planned_steps: int | None = None,
        trace_dir: Path | str | None = None,
        on_progress: Callable[[int, int, str], None] | None = None,
        cache: DecisionCache | None = None,
        short_fit: bool = False,
    ) -> None:
        self.state = state
        #: a fit too short to pay back its trials runs none (:meth:`too_short`); False: trials whatever its length
        self.short_fit = short_fit
        #: the signals that stop the trials at their next safe point, noted while they run
        self.stop = StopRequests()
        #: where decisions are kept (None: the trials climb every time and keep nothing)
        self.cache = cache
        # the kernels' per-shape measurements are kept beside the decisions, or nowhere with the cache off
        state.notes[kernel_choice.NOTE] = kernel_choice.ChoiceStore(
            cache.root / kernel_choice.STORE_NAME if cache is not None else None
        )
        #: the key of this run's decision in the cache (set after the baseline where there is a cache)
        self.cache_key: str | None = None
        #: a digest of where every parity trajectory starts (the snapshot's state and the parity batches:
        #: :meth:`~speedkit.training.snapshot.Snapshot.digest`), for the decision cache; None: not taken
        self.start_digest: str | None = None
        #: ``(done, total, label)``: rungs tried of the ladder's, then its closing phases (a progress bar)
        self.on_progress = on_progress or (lambda done, total, label: None)
        #: where the profile's Chrome/Perfetto traces of the baseline and the final configuration go
        #: (the report's folder's ``traces``); None: no traces written
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        if state.device.type == "cuda":  # the ladder makes CUDA events and streams: keep forked workers off them
            protect_forked_children()
        self.rungs = list(rungs)
        self.cfg = MeasureConfig.from_dict(measure)
        self.recipe = recipe
        self.on_event = on_event or (lambda line: None)
        self.clock = clock or StepClock(state.device)
        self.host_clock = host_clock
        #: the clock time budgets are counted on: rank 0's under DDP, so every rank's comparisons stop
        #: after the same block and its second looks are skipped alike
        self.decision_clock = distributed.agreed_clock(host_clock)
        self.run_info = dict(run_info or {})
        #: the user's settings as given (``run_info`` is the report's ``run``, which the trials add to):
        #: part of the decision cache's key
        self.settings = dict(self.run_info)
        #: the rungs the diagnosis named as the bottleneck's remedy (tried first, and even past the budget)
        self.remedy: set[str] = set()
        #: the user's switches in effect as the floor every other rung is judged on (empty: no floor)
        self.floor: set[str] = set()
        #: the row of the user's switches (None: the ladder has none)
        self.floor_row: RungResult | None = None
        #: the baseline's step and the floor's (the pace the rungs are judged at), in ms: what the closing
        #: comparisons' cost is estimated from
        self.steps_ms = (math.nan, math.nan)
        self.stack = Stack(state, self.rungs)
        #: steps of every parity trajectory: the configured ones, or more where a rung needs more to be
        #: in effect (a CUDA graph's warm-up and capture), the reference included so the two line up
        self.parity = ParityCheck(state, self.stack, max([self.cfg.parity_steps, *(r.parity_steps_needed() for r in rungs)]))
        self.parity.host_clock = host_clock
        self.budget = TrialBudget(self.cfg, self.decision_clock)
        self.result: LadderResult | None = None
        self.session: MeasureSession | None = None
        self.timing: Timing | None = None
        self.snapshot: Snapshot | None = None
        self._candidate: Slot | None = None  # the slot of the rung being tried (:meth:`trying`)
        self._current: RungResult | None = None  # its row
        self._phase = "the setup"  # what the ladder is doing, for an interruption's report
        #: optimizer steps the fit plans (None: not known): the trials' time budget is a share of them
        self.planned_steps = planned_steps
        #: what sets the baseline step's pace (None before the trials diagnosed it)
        self.diagnosis: Diagnosis | None = None
        #: host clock when the baseline began (its parity batches, flops and timing: its time counts from it)
        self.baseline_started = 0.0
        #: the most seconds one rung's trial has spent compiling (0.0: none has compiled)
        self.trial_compile_s = 0.0
        #: seconds the floor's compile took where it compiled from scratch (0.0: none, or from Inductor's caches)
        self.floor_compile_s = 0.0
        #: the remedy's rungs kept together, judged member by member once the rest of the order is tried
        self._remedy_kept: list[str] = []
        #: each rung's latest comparison alone (its climb's, or a second look's)
        self.last_comparison: dict[str, PairedResult] = {}
        #: (rungs, kept rungs) configurations a second look or closing check has judged already
        self.judged: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
        #: the kept rungs beneath which a rung failed in the climb (it may not fail beneath others:
        #: a CUDA graph refused for a sync that the compiled step no longer makes)
        self.failed_beneath: dict[str, tuple[str, ...]] = {}

    @property
    def phase(self) -> str:
        """What the ladder is doing (an interruption's report names it); setting it also starts the
        phase's time in the budget (a rung's trial counts as "the rungs")."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.stop.check(collective=True)  # a safe point every process reaches together: a signal stops the trials here
        self._phase = value
        self.budget.enter("the rungs" if any(r.name == value for r in self.rungs) else value)

    @property
    def slots(self) -> list[Slot]:
        """The kept rungs' slots, bottom first (:attr:`Stack.slots`)."""
        return self.stack.slots

    @property
    def handles(self) -> list[Handle]:
        return self.stack.handles

    def revert(self) -> None:
        """Undo every kept rung, last first."""
        self.stack.revert()

    def trying(self, entry: RungResult | None, slot: Slot | None = None) -> None:
        """The rung being tried (its row, and its slot once applied): undone and reported as interrupted
        where the trials stop while it is tried; None once its trial is over."""
        self._current, self._candidate = entry, slot

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer of the run: the state's, and those its step steps (a manual-optimization GAN's two)."""
        found = list(self.state.step.all_optimizers())
        if self.state.optimizer is not None and all(o is not self.state.optimizer for o in found):
            found.insert(0, self.state.optimizer)
        return found

    def entry(self, name: str) -> RungResult | None:
        """The row of rung ``name`` (not a closing phase's or the switches' summary row)."""
        assert self.result is not None
        return next((r for r in self.result.rungs if r.name == name and r.status not in ("closing", "switches")), None)

    def note_budget(self, what: str) -> None:
        assert self.result is not None
        self.result.run["budget"]["skipped"].append(what)
        self.on_event(f"{what} skipped: the trials' time budget ({self.budget.budget_s:.0f} s) is spent")

    # -- the run -------------------------------------------------------------------------
    def run(self) -> LadderResult:
        from speedkit.report.environment import collect_environment

        state, cfg = self.state, self.cfg
        self.result = LadderResult(
            schema_version=SCHEMA_VERSION,
            recipe=self.recipe,
            environment=collect_environment(state.device),
            device=str(state.device),
            flops={},
            measure=asdict(cfg),
            rungs=[],
            run=self.run_info,
            parity_calibration=self.parity.calibration,
        )  # filled as tolerances are calibrated
        state.model.train()
        self.budget.start()
        # the snapshot comes first: even starting a DataLoader iterator draws from the RNG
        self.snapshot = self.parity.snapshot = Snapshot(state.model, self.optimizers(), state.step, state.data)
        with self.stop.listening():  # signals are noted (not acted on) until the trials are undone
            self._run_noted(state)
        return self.result

    def _run_noted(self, state: TrainState) -> None:
        """The phases, then the undoing and release of whatever the trials held (:meth:`_close_run`)."""
        assert self.result is not None
        completed = False
        try:
            with state.step.trial():
                self._phases()
            completed = True
        except BaseException as exc:
            stopped = self.stop.stopping(exc) if not isinstance(exc, (KeyboardInterrupt, SystemExit)) else None
            what = f"stopped by {stopped.signal_name or 'its data loader'}" if stopped is not None else type(exc).__name__
            self.result.interrupted = f"{what} during {self.phase}"
            if stopped is not None:
                self.result.run["stopped"] = {"by": stopped.signal_name or "loader", "why": stopped.why, "phase": self.phase}
            if self._current is not None:  # the rung being tried when it happened: undone, said so
                self._current.status = "interrupted"
                self._current.reason = f"{what} while trying it; undone"
                self.result.rungs.append(self._current)
            if stopped is not None and stopped is not exc:
                raise stopped from exc
            raise
        finally:
            self._close_run(completed)

    def _phases(self) -> None:
        """diagnose → plan → decide → confirm (the module's docstring)."""
        result = self.result
        assert result is not None
        baseline_setup(self)
        entry = cache_check.cached_entry(self) if self.cache is not None else None
        short = self.too_short(entry) if self.short_fit else None
        if short is not None:
            result.run["short_fit"] = short
            if entry is not None and cache_check.apply_cached(self, entry, short):
                return
            raise TrialsNotRun(
                f"{short}: no trials; to have them, run `speedkit optimize` on a recipe of this fit, plan a longer fit, "
                'or pass SpeedLadder(trials="always")'
            )
        base_m = measure_baseline(self, entry)
        if entry is not None:
            self.phase = "the cache"
            if cache_check.recheck(self, entry):
                scaling_and_profile(self, cached=True)
                return
            if entry.baseline or entry.calibration:  # the earlier fit's stood for the baseline's: the climb's own
                self.parity.calibration.clear()
                self.phase = "the baseline"
                base_m = measure_baseline(self)
        reference = baseline_reference(self)
        pace = base_m  # the step the rungs are judged on: the baseline's, or the floor's
        self.steps_ms = (base_m.step_ms, base_m.step_ms)
        if self.cfg.switches_floor:
            self.phase = "the floor"
            compiled_before, caches_before = compat.compile_seconds(), compat.compile_cache_counts()
            self.floor_row, reference, floor_m = switches.apply_floor(self, reference, base_m)
            self.floor_compile_s = fresh_compile_s(
                compat.compile_seconds() - compiled_before, compat.compile_cache_counts(since=caches_before)
            )
            pace = floor_m or base_m
            self.steps_ms = (base_m.step_ms, pace.step_ms)
            if floor_m is not None:  # the closing phases time the final configuration: at most the floor's step
                held = self.budget.at_the_floor(base_m.step_ms, floor_m.step_ms)
                result.run["budget"]["held_for_closing_s"] = round(held, 1)
        self.phase = "the diagnosis"
        self.diagnosis = diagnose_baseline(self, pace)
        self.phase = "the plan"
        order = self._plan(pace)
        bundle = [r for r in order if r.name in self.remedy]
        remedy_kept: list[str] = []
        not_together = no_room_for_remedy(self, bundle) if len(bundle) > 1 else None
        if not_together is not None:  # each member tried on its own in the climb, as the budget allows
            result.run["budget"]["skipped"].append(f"the remedy together ({' + '.join(r.name for r in bundle)})")
            self.on_event(f"remedy: {' + '.join(r.name for r in bundle)} not tried together: {not_together}")
        elif len(bundle) > 1:  # the bottleneck's remedy together, then member by member
            self.phase = "the remedy"
            compiled_before = compat.compile_seconds()
            remedy_kept, reference = remedy.try_remedy(self, bundle, reference)
            note_trial_compile(self, compat.compile_seconds() - compiled_before)
            order = [r for r in order if self.entry(r.name) is None]  # the members judged in it are decided
        reference = climb(self, order, reference)
        if remedy_kept:  # judged member by member after the rest of the order: on an H200 the demo
            # Transformer's leave-one-out (16 s) left data_path and gc_freeze, 25% of its step, no budget
            self.phase = "the remedy's members"
            second_look.leave_one_out(self, remedy_kept)
        self.phase = "the closing check"
        reference = closing_check(self, reference)
        self.phase = "the second look"
        second_look.second_look(self, reference)
        confirm(self, *self.steps_ms)
        scaling_and_profile(self)
        cache_check.store_decision(self)

    def too_short(self, cached: CachedDecision | None = None) -> str | None:
        """Why this fit is too short to pay back its trials (None: it is not, or its length is not known):
        its planned optimizer steps at the step time of the baseline's parity reference (an upper bound:
        its first steps include first calls; ``cached``: the baseline's step in the fit that made the
        cached decision, where it holds one) under :data:`PAYBACK` times the trials' budget for that step."""
        planned = self.planned_steps
        if not planned:
            return None
        step_ms = baseline_pace_s(self, cached) * 1e3  # per optimizer step (each of ``accumulate`` micro-batches)
        if step_ms <= 0:
            return None
        budget_s = self.budget.size(step_ms, planned)
        planned_s = planned * step_ms / 1e3
        if planned_s >= PAYBACK * budget_s:
            return None
        return (
            f"the fit is too short to pay back its trials: {planned} planned steps at ~{step_ms:.1f} ms are ~{planned_s:.0f} s, "
            f"under {PAYBACK}x the trials' {budget_s:.0f}-s budget"
        )

    def _plan(self, pace: Any) -> list[Rung]:
        """The rungs to try in order (:func:`trial_order`); those not worth timing are recorded with their
        reason; the budget's split among those the plan will time, by their bounds (:meth:`TrialBudget.plan_rungs`)."""
        result = self.result
        assert result is not None
        order, pruned = trial_order(self, pace, self.diagnosis)
        order = [r for r in order if r.name not in self.floor]  # in effect already, kept as the floor
        pruned = [(r, why) for r, why in pruned if r.name not in self.floor]
        for rung, bound in pruned:  # its own reason where it does not apply at all, else its bound's
            try:
                reason = agreed_check(rung, self.state)
            except Exception as exc:
                reason = f"check raised {type(exc).__name__}: {first_line(exc)}"
            result.rungs.append(
                RungResult(rung.name, "not_applicable", options=rung.options_dict(), reason=reason or f"not timed: {bound}")
            )
        weights = self.budget.plan_rungs(planned_bounds(self, order, self.diagnosis))
        result.run["budget"]["weights"] = {name: round(w, 2) for name, w in weights.items()}
        return order

    def _close_run(self, completed: bool) -> None:
        """Undo every change of a run that did not complete, restore the snapshot, release what the
        trials held (the snapshot's copies, the parity batches, the data source's iterators)."""
        state, result, snapshot = self.state, self.result, self.snapshot
        assert result is not None and snapshot is not None
        if not completed:  # nothing of the ladder may stay on the user's model
            _quiet_dead_loaders()  # workers killed with the process group: their errors never cut the undoing short
            if self._candidate is not None:
                try:
                    self._candidate.undo()
                except Exception:  # keep undoing the rest
                    pass
            self.stack.undo_all()
        result.final_order = [s.rung.name for s in self.slots]
        if self.timing is not None:
            if self.timing.paces:  # the loaders' paces its windows were bounded by
                result.run["loader_pace"] = self.timing.paces
            if self.timing.resized:  # windows sized again by time as the step got faster (or slower)
                result.run.setdefault("noise", {})["resized"] = self.timing.resized
            self.timing.close()
        result.run["trials_s"] = round(self.budget.elapsed(), 3)
        if "budget" in result.run:
            result.run["budget"]["phases"] = self.budget.phase_times()
        snapshot.restore()  # trial steps never leak into the user's training
        if snapshot.restored_attributes:  # what the user's step changes on self, put back
            result.run["attributes_restored"] = sorted(snapshot.restored_attributes)
        if snapshot.unrestored:
            result.run["attributes_not_restored"] = sorted(snapshot.unrestored)
        # the copies of the weights and optimizer state are spent: never hold them through the fit
        self.snapshot = self.parity.snapshot = self.timing = None
        self.parity.batches = []
        if state.data is not None:
            state.data.release()
        # the trials' garbage (snapshots' copies, profiles, measurement windows, the scaffolding of traced
        # graphs), in cycles most of it, collected now in one pass counted as the trials' time: left to the
        # collector, full collections over it ran during the fit's own steps (a 2-GPU FSDP fit whose
        # trials' steps took 161 ms measured its own at 253 ms on average, 161 by the median)
        before = self.budget.elapsed()
        collected = gc.collect()
        result.run["trials_garbage"] = {"objects": collected, "seconds": round(self.budget.elapsed() - before, 3)}
        if state.device.type == "cuda":  # the trials reset the peak-memory counter per window; what
            torch.cuda.reset_peak_memory_stats(state.device)  # the user reads later is their training's


def _quiet_dead_loaders() -> None:
    """Stop the loaders whose workers died (:func:`compat.quiet_dead_workers`), so that their errors,
    raised in the main thread as each worker's exit is noticed, cannot interrupt the undoing of the trials
    (one such error may still land while this runs: it is tried again)."""
    for _ in range(3):
        try:
            compat.quiet_dead_workers()
            return
        except Exception as exc:
            if not loader_died(exc):
                raise
