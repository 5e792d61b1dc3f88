"""The ladder: baseline, then rung by rung — check, apply, parity, interleaved timing, keep or revert.

For every rung, in order:

1. ``check`` — does it apply to the run in front of it? If not, say why and go on.
2. ``apply`` — among the rungs kept so far (a handle that can switch it off and on again).
3. parity — from the snapshot's weights, optimizer, schedule and RNG, on the same host-kept
   batches, the loss trajectory must stay, step by step, within the envelope of the numerics now in
   effect around the trajectory before the rung. The envelope is calibrated on the model, once per
   run: how far its loss trajectory moves under one rounding step of that precision on every
   weight, output (at its kernels' own precision) and gradient, the worst of a few draws, times a
   safety factor, never under the floor of ``configs/tolerances.yaml``. A rewrite of the model's
   code is also judged with the precision rungs off, where the envelope is narrow.
4. compare — the configuration with the rung (B) and without it (A) are timed in interleaved
   A B B A blocks in the same period, and judged on the paired differences with a stated
   confidence (:mod:`speedkit.measure.stats`); undecided comparisons get more blocks within a
   time budget.
5. keep if faster by at least ``min_gain`` with that confidence (or leaner in memory by
   ``memory_gain`` and not slower); else undo.

Rungs are tried in the ladder's order, each at its place beneath the kept rungs that come after it;
on a host-bound step (a GPU's host time most of its step) the rungs that cut host work go first, on
a device-bound one the rungs whose only gain is the device's wait for the host go last.
After the rungs, a closing check re-judges kept rungs that ask for it (``Rung.recheck``) with the
later rungs on top, the same way; a second look judges every rung reverted on speed (undecided or
slower), or rejected on numerics under another precision, again on the final configuration, at its
place beneath the rungs kept after it, with the partners it names (``Rung.partners``), alone, and
together with the others still undecided but leaning faster, pass after pass until a pass keeps
nothing (gains that show only together, or only once a later rung removed the noise that hid them);
the user's switches (``configs/defaults.yaml`` ``switches:``) go in first, together, as the floor
every other rung is judged on (:mod:`speedkit.engine.switches`), and the final configuration is
timed against them at the end (decided not faster: the result is the switches); and a final check
times the final configuration against the baseline, interleaved, for the headline figure. The trials keep to a time budget, a share of the fit's planned time (:meth:`speedkit.engine.budget.TrialBudget.plan`).

Every trial starts from the snapshot taken before the ladder, and the snapshot is restored at the
end (weights, optimizer state, schedulers, grad scaler, data generators, RNG), so none of the trial
steps leak into training. A rung that raises is undone and reported as failed; the ladder goes on.
An interruption (Ctrl-C, SIGTERM) or an error the ladder cannot attribute to a rung undoes every
change, restores the snapshot, keeps the rungs finished so far in ``ladder.result`` and re-raises.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from speedkit import compat, distributed
from speedkit.engine import remedy, second_look, switches
from speedkit.engine.baseline import baseline_reference, diagnose_baseline, measure_baseline, trial_order
from speedkit.engine.budget import TrialBudget
from speedkit.engine.cache import CachedDecision, DecisionCache, batch_signature_of, decision_key, key_parts
from speedkit.engine.closing_check import closing_check
from speedkit.engine.diagnose import Diagnosis
from speedkit.engine.parity import ParityCheck, dropout_off
from speedkit.engine.profile_run import profile_configurations
from speedkit.engine.stack import RungProblem, Slot, Stack, agreed_check, agreed_problem
from speedkit.engine.stop import StopRequests, loader_died
from speedkit.engine.timing import Timing, heartbeat
from speedkit.errors import first_line
from speedkit.fork_safety import protect_forked_children
from speedkit.handle import Handle
from speedkit.measure.clock import StepClock
from speedkit.measure.config import MeasureConfig
from speedkit.measure.session import MeasureSession
from speedkit.measure.stats import describe, not_slower
from speedkit.results import (
    SCHEMA_VERSION,
    LadderResult,
    Measurement,
    PairedResult,
    RungResult,
)
from speedkit.rungs.base import Rung
from speedkit.training.snapshot import Snapshot
from speedkit.training.state import TrainState

#: the closing phases whose comparisons draw on the share of the budget held back for them, in order
CLOSING_COMPARISONS = ("the switches", "the final check", "the scaling")


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
            share of the fit's planned time (see :meth:`TrialBudget.plan`).

    The mechanisms are its parts: ``stack`` (the slots of the kept rungs, switched on and off),
    ``parity`` (trajectories and their envelope), ``budget`` (the trials' time) and, during a run,
    ``timing`` (windows and A/B comparisons); the baseline and the trials' order, the second looks and
    the switches floor are verbs of their own modules (:mod:`speedkit.engine.baseline`,
    :mod:`speedkit.engine.second_look`, :mod:`speedkit.engine.switches`).

    After :meth:`run`, the kept rungs stay applied on the restored initial state (``handles``);
    :meth:`revert` undoes them. ``result`` holds the report so far, also after an interruption.
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
    ) -> None:
        self.state = state
        #: the signals that stop the trials at their next safe point, noted while they run
        self.stop = StopRequests()
        #: where decisions are kept (None: the trials climb every time and keep nothing)
        self.cache = cache
        #: the key of this run's decision in the cache (set after the baseline where there is a cache)
        self.cache_key: str | None = None
        #: ``(done, total, label)``: rungs tried of the ladder's, then its closing phases (a progress bar)
        self.on_progress = on_progress or (lambda done, total, label: None)
        #: where the profile's Chrome/Perfetto traces of the baseline and the final configuration go
        #: (the report's folder's ``traces``); None: no traces written
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        #: per kept rung, the rungs kept together with it and the paired speedup of the decision that
        #: kept it last (its climb, a second look, a closing check): the attribution's marginal gains
        self.decisions: dict[str, tuple[tuple[str, ...], float | None]] = {}
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
        self._floor_row: RungResult | None = None
        #: the baseline's step and the floor's (the pace the rungs are judged at), in ms: what the closing
        #: comparisons' cost is estimated from
        self._steps_ms = (math.nan, math.nan)
        self.stack = Stack(state, self.rungs)
        #: steps of every parity trajectory: the configured ones, or more where a rung needs more to be
        #: in effect (a CUDA graph's warm-up and capture), the reference included so the two line up
        self.parity = ParityCheck(state, self.stack, max([self.cfg.parity_steps, *(r.parity_steps_needed() for r in rungs)]))
        self.budget = TrialBudget(self.cfg, self.decision_clock)
        self.result: LadderResult | None = None
        self.session: MeasureSession | None = None
        self.timing: Timing | None = None
        self.snapshot: Snapshot | None = None
        self._candidate: Slot | None = None
        self._current: RungResult | None = None
        self._phase = "the setup"  # what the ladder is doing, for an interruption's report
        #: optimizer steps the fit plans (None: not known): the trials' time budget is a share of them
        self.planned_steps = planned_steps
        self._left = 0  # rungs not yet tried in the climb
        #: what sets the baseline step's pace (None before the trials diagnosed it)
        self.diagnosis: Diagnosis | None = None
        #: host clock when the baseline's parity reference began (the baseline's time counts from it)
        self.baseline_started = 0.0
        #: the most seconds one rung's trial has spent compiling (0.0: none has compiled)
        self._trial_compile_s = 0.0
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
        self.snapshot = self.parity.snapshot = Snapshot(state.model, _optimizers(state), state.step, state.data)
        with self.stop.listening():  # signals are noted (not acted on) until the trials are undone
            self._run_noted(state)
        return self.result

    def _run_noted(self, state: TrainState) -> None:
        """The climb, then the undoing and release of whatever the trials held (:meth:`_close_run`)."""
        assert self.result is not None
        completed = False
        try:
            with state.step.trial():
                self._climb()
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

    def _climb(self) -> None:
        """The baseline, every rung in the trials' order, then the closing phases."""
        result = self.result
        assert result is not None
        reference = baseline_reference(self)
        entry = self._cached_entry() if self.cache is not None else None
        base_m = measure_baseline(self, reference, entry)
        if entry is not None:
            self.phase = "the cache"
            if self._from_cache(entry):
                self._scaling_and_profile(cached=True)
                return
            if entry.baseline or entry.calibration:  # the earlier fit's stood for the baseline's: the climb's own
                self.parity.calibration.clear()
                self.phase = "the baseline"
                base_m = measure_baseline(self, reference)
        pace = base_m  # the step the rungs are judged on: the baseline's, or the floor's
        self._steps_ms = (base_m.step_ms, base_m.step_ms)
        if self.cfg.switches_floor:
            self.phase = "the floor"
            self._left = len(self.rungs)  # the floor's comparison takes its share of the rungs' time
            self._floor_row, reference, floor_m = switches.apply_floor(self, reference, base_m)
            pace = floor_m or base_m
            self._steps_ms = (base_m.step_ms, pace.step_ms)
            if floor_m is not None:  # the closing phases time the final configuration: at most the floor's step
                held = self.budget.at_the_floor(base_m.step_ms, floor_m.step_ms)
                result.run["budget"]["held_for_closing_s"] = round(held, 1)
        self.phase = "the diagnosis"
        self.diagnosis = diagnose_baseline(self, pace)
        self.phase = "the plan"
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
        # the kept rungs' figures against the baseline start from the floor's (on an H200 a GPT-2 whose
        # switches ran 9.95x and a CUDA graph 1.21x on top was headlined 1.21x without a final check)
        floor_gain = self._floor_row.gain_vs_baseline if self._floor_row is not None and self.floor else None
        chain = floor_gain or 1.0
        bundle = [r for r in order if r.name in self.remedy]
        if len(bundle) > 1 and not self.budget.spent():  # the bottleneck's remedy together, then member by member
            self.phase = "the remedy"
            self._left = len(order)
            kept_names, reference = remedy.try_remedy(self, bundle, reference)
            if kept_names:
                chain *= self.decisions[kept_names[0]][1] or 1.0
                # judged member by member after the rest of the order: on an H200 the demo Transformer's
                # leave-one-out (16 s) left data_path and gc_freeze, 25% of its step, no budget
                self._remedy_kept = kept_names
            order = [r for r in order if self.entry(r.name) is None]  # the members judged in it are decided
        for i, rung in enumerate(order, 1):
            self._left = len(order) - i + 1
            self.phase = rung.name
            self.on_event(f"[{i}/{len(self.rungs)}] {rung.name}")
            self.on_progress(i - 1, len(order), rung.name)
            # the bottleneck's own remedy is tried whatever the budget: on a data-bound step it is what pays
            # (on an H200 a ResNet-18 waiting 93% of its step skipped data_path in one run of two, 13.3x in the other)
            # (a device-bound step's "remedy", the kernel rungs on its top categories, is no such bundle: budgeted)
            whatever = rung.name in self.remedy and (self.diagnosis is None or self.diagnosis.kind != "device-bound")
            why_not = None if whatever else self._no_room_for(rung)
            if why_not is not None:
                entry = RungResult(rung.name, "skipped", options=rung.options_dict(), precision=self.state.precision)
                entry.reason = f"not tried: {why_not}"
                result.rungs.append(entry)
                result.run["budget"]["skipped"].append(rung.name)
                self.on_event(f"[{i}/{len(self.rungs)}] {rung.name}: {entry.reason}")
                continue
            compiled_before = compat.compile_seconds()
            entry, losses = self._try(rung, reference, chain)
            compiled = compat.compile_seconds() - compiled_before
            if compiled > 1.0:  # the most a trial has spent compiling
                self._trial_compile_s = max(self._trial_compile_s, compiled)
            result.rungs.append(entry)
            if entry.status == "kept":
                reference = losses
                chain *= entry.gain_vs_previous or 1.0
                self.decisions[rung.name] = ((rung.name,), entry.gain_vs_previous)
            self.on_event(f"[{i}/{len(self.rungs)}] {rung.name}: {entry.status}" + (f" ({entry.reason})" if entry.reason else ""))
        self._left = 0
        self.on_progress(len(order), len(order), "closing check, second look, final check, profile")
        self._close(reference)
        self._store_decision()

    # -- the decision cache ------------------------------------------------------------------
    def _decision_key(self) -> str:
        from speedkit import config

        assert self.result is not None
        parts = key_parts(
            self.state.model,
            _optimizers(self.state) if self.state.optimizer is None else self.state.optimizer,
            batch_signature_of(self.parity.batches[0]) if self.parity.batches else None,
            self.result.environment,
            self.settings,
            [(r.name, r.options_dict()) for r in self.rungs],
            {
                "min_gain": self.cfg.min_gain,
                "detect_gain": self.cfg.detect_gain,
                "confidence": self.cfg.confidence,
                "switches_floor": self.cfg.switches_floor,
                "switches": list(config.switch_rungs()),
            },
        )
        return decision_key(parts)

    def _no_room_for(self, rung: Rung) -> str | None:
        """Why ``rung`` is not begun (None: it is): the rungs' share of the budget is spent, or, where a
        trial has compiled before, what is left of it does not hold the fewest steps of a trial together
        with as long a compile as a trial has taken (a rung beneath compile is compiled anew, charged to
        the budget, never timed: on an H200 one such trial compiled for 66 s past the budget's end). A rung
        that does not apply is let through, to say why."""
        budget = self.budget
        if budget.spent():
            return f"the trials' time budget ({budget.budget_s:.0f} s) was spent"
        if self._trial_compile_s <= 0 or budget.left_for_rungs() >= budget.min_trial_s + self._trial_compile_s:
            return None
        try:
            if agreed_check(rung, self.state) is not None:
                return None
        except Exception:
            return None
        return (
            f"the {max(0.0, budget.left_for_rungs()):.0f} s left of the trials' time budget hold no trial that compiles "
            f"as long as one has here ({self._trial_compile_s:.0f} s)"
        )

    def _cached_entry(self) -> CachedDecision | None:
        """The decision the cache holds for this run's key (None: none; the note says so)."""
        assert self.cache is not None and self.result is not None
        key = self.cache_key = self._decision_key()
        entry = distributed.broadcast(self.cache.load(key) if distributed.rank() == 0 else None)
        self.result.run["cache"] = {"key": key, "dir": str(self.cache.root), "hit": entry is not None, "held": None}
        if entry is None:
            self.on_event(f"cache: no decision for this model and settings (key {key[:8]}): climbing")
        return entry

    def _from_cache(self, entry: CachedDecision) -> bool:
        """Re-check ``entry``, the decision the cache holds for this run's key: its kept rungs applied
        together, their parity against the baseline (within the envelopes the climb calibrated), then
        the final configuration timed alone against its step time in the final check of the fit that
        made the decision. Within that figure's noise (at least ``cache_slack``), the decision holds with
        that final check as its headline; slower, the final configuration is timed against the baseline
        again, paired, and the decision holds unless shown not to pay (under the minimum gain; the user's
        switches alone, the floor, unless shown slower than the baseline). Where the entry holds no
        final check, the paired check is the re-check. Returns whether it held; where it did not,
        everything is undone, the entry forgotten, and the trials climb as without a cache (the report
        says why)."""
        assert self.cache is not None and self.result is not None and self.timing is not None
        result, key = self.result, entry.key
        note = result.run["cache"]
        self.on_event(
            f"cache: re-checking the decision of an earlier fit (key {key[:8]}): {', '.join(entry.kept) or 'none kept'}"
        )
        names = {r.name for r in self.rungs}
        # the switches that apply on the baseline: asked before the cached rungs go in
        floor_only = self.cfg.switches_floor and set(entry.kept) <= {r.name for r in switches.applicable_switches(self)[0]}
        t0, compiled_before, caches_before = self.host_clock(), compat.compile_seconds(), compat.compile_cache_counts()
        restarts_before = compat.dynamo_restarts()
        final_then: Measurement | None = None  # the climb's figure for the final configuration, where it had no final check
        seconds = note["seconds"] = {}  # where the re-check's time went: applying, parity, timing
        try:
            unknown = [n for n in entry.kept if n not in names]
            if unknown:
                raise RungProblem(f"the cached rungs {unknown} are not in this ladder")
            for rung in [r for r in self.rungs if r.name in entry.kept]:
                if entry.chosen and isinstance(entry.chosen.get(rung.name), dict):  # what it measured then
                    rung.reuse(entry.chosen[rung.name])
                self.stack.insert_at_place(rung)
            self.stack.all_on()
            seconds["apply"] = round(self.host_clock() - t0, 2)
            n = len(self.slots)
            parity = None
            if n:
                t0 = self.host_clock()
                # its own trajectory is not needed: where dropout draws differently it is judged with dropout off
                _, parity = self.parity.of([True] * n, [False] * n, self.parity.reference, own_trajectory=False)
                seconds["parity"] = round(self.host_clock() - t0, 2)  # its first steps compile and capture
                if not parity.passed:
                    raise RungProblem(f"numerics changed: loss differs by {parity.max_rel_diff:.2e} > {parity.tolerance:.0e}")
                problem = next((p for p in (agreed_problem(s.handle) for s in self.slots) if p), None)
                if problem:
                    raise RungProblem(problem)
                t0 = self.host_clock()
                self.phase = "the final check"
                decided = PairedResult.from_dict(entry.final_check) if entry.final_check else None
                # the final configuration's figure then: its final check's windows, else (the climb ended
                # without one) the figure it reported from the kept rungs' comparisons
                then = decided.b if decided is not None else Measurement.from_dict(entry.final) if entry.final else None
                if then is not None and self._retimed_holds(then, note):
                    if decided is not None:
                        decided.measured_in = f"the fit that made the cached decision (key {key[:8]}, {_date(entry.created)})"
                        result.final_check = decided
                    else:
                        final_then = then
                else:
                    self._final_check()
                    check = result.final_check
                    # a decision with rungs beyond the user's switches holds unless shown not to pay (under
                    # the minimum gain); one that is the switches alone, unless shown slower than the
                    # baseline (it is the floor, tie or not: climbing again would end on it again)
                    if check is None:
                        raise RungProblem("re-checked against the baseline: not measured")
                    if check.verdict == "not_faster" and (not floor_only or check.high < 1.0):
                        raise RungProblem(
                            f"re-checked against the baseline: {describe(check)}, " + ("slower" if floor_only else "not faster")
                        )
                seconds["timing"] = round(self.host_clock() - t0, 2)
        except Exception as exc:
            self.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
            self.stack.undo_all()
            self.snapshot.restore()
            result.final_check = None
            note["held"] = False
            note["why"] = str(exc) if isinstance(exc, RungProblem) else f"{type(exc).__name__}: {first_line(exc)}"
            if distributed.rank() == 0:
                self.cache.forget(key)
            self.on_event(f"cache: the decision did not hold ({note['why']}): climbing again")
            return False
        check = result.final_check
        group = tuple(s.rung.name for s in self.slots)
        speedup = check.speedup if check is not None else entry.speedup if final_then is not None else None
        for i, slot in enumerate(self.slots):
            self.decisions[slot.rung.name] = (group, speedup)
            last = i == len(self.slots) - 1
            result.rungs.append(
                RungResult(
                    slot.rung.name,
                    "kept",
                    options=slot.rung.options_dict(),
                    precision=self.state.precision,
                    changes=list(slot.handle.changes) + slot.handle.report(),
                    parity=parity,
                    reason=(
                        f"from the decision cache (key {key[:8]}), kept with {', '.join(group)} in an earlier fit"
                        + (
                            f"; {'its final check' if check.measured_in else 're-checked together against the baseline'}: "
                            f"{describe(check)}"
                            if check is not None
                            else f"; the final configuration re-timed within the noise of its figure then "
                            f"({speedup:.3f}x the baseline from the kept rungs' comparisons, no final check)"
                            if final_then is not None and speedup is not None
                            else ""
                        )
                    ),
                    # the headline's figures where that fit had no final check: the last kept row's
                    measurement=final_then if last else None,
                    gain_vs_baseline=speedup if last and final_then is not None else None,
                )
            )
        seconds["compiling"] = round(compat.compile_seconds() - compiled_before, 2)  # within apply, parity and timing
        # the compiled graphs' caches over the re-check (hits, misses: a miss compiles from scratch)
        note["compile_caches"] = compat.compile_cache_counts(since=caches_before)
        # frames Dynamo traced again from their start (at a graph break, or for a float it had to specialize)
        note["traced_again"] = compat.dynamo_restarts() - restarts_before
        note.update(held=True, kept=list(entry.kept), vs_switches=entry.vs_switches, decided_in_s=entry.trials_s)
        spent = ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
        self.on_event(
            f"cache: the decision holds: {', '.join(group) or 'none kept'}" + (f" (re-checked in: {spent})" if spent else "")
        )
        return True

    def _retimed_holds(self, then: Measurement, note: dict[str, Any]) -> bool:
        """The final configuration timed alone (``repeats`` windows of the comparisons' length) against its
        step time in ``then``, its figure in the fit that made the cached decision: whether it is
        no slower than that by more than the two figures' noise (three times the larger spread, at least
        ``cache_slack``, at most half: slower, the paired check decides). Recorded in ``note["retimed"]``."""
        assert self.timing is not None
        cfg = self.cfg
        with distributed.together():
            now = self.timing.alone(self.timing.window_steps, cfg.repeats)
        spreads = [x for x in (now.spread, then.spread) if math.isfinite(x)]
        # a noisy host widens it, up to half the step: beyond that only a paired comparison can tell
        slack = max(cfg.cache_slack, min(0.5, 3 * max(spreads, default=0.0)))
        ratio = now.step_ms / then.step_ms if then.step_ms > 0 else math.inf
        holds = ratio <= 1 + slack
        note["retimed"] = {
            "step_ms": now.step_ms,
            "spread": now.spread,
            "decided_step_ms": then.step_ms,
            "ratio": ratio,
            "slack": slack,
            "holds": holds,
        }
        self.on_event(
            f"cache: the final configuration at {now.step_ms:.2f} ms per step, {ratio:.3f}x its {then.step_ms:.2f} when decided "
            f"(within {slack:.1%}: " + ("holds)" if holds else "slower: timed against the baseline again)")
        )
        return holds

    def _scaling_and_profile(self, cached: bool = False) -> None:
        """The last closing phases, after a climb or a cached decision that held: the scaling across
        ranks and the profile (within what the budget left; ``cached``: none, a re-check takes seconds,
        and where the time goes was profiled by the fit that made the decision)."""
        if self.state.step.world_size() > 1:
            self.phase = "the scaling"
            self._scaling()
        if not self.cfg.profile:
            return
        if cached:
            assert self.result is not None
            note = self.result.run.get("cache") or {}
            self.result.profile = {
                "windows": [],
                "host_syncs": {},
                "note": "not profiled: a cached decision re-checked in seconds; where the time goes before and after "
                f"is in the report of the fit that made it (key {str(note.get('key', ''))[:8]})",
            }
            return
        self.phase = "the profile"
        if self.budget.remaining() > 0:
            profile_configurations(self)
        else:
            self.note_budget("the profile")

    def _store_decision(self) -> None:
        """Keep the decision the climb made (rank 0 writes; a failure to write is a line, never the run's)."""
        if self.cache is None or self.cache_key is None:
            return
        trials_s = round(self.budget.elapsed(), 1)  # the budget's clock is a collective: read on every rank
        if distributed.rank() != 0:
            return
        assert self.result is not None
        versus = self.result.vs_switches()
        check, baseline = self.result.final_check, self.result.baseline
        checked = check is not None and check.b is not None
        final = self.result.final_measurement if self.slots and not checked else None
        entry = CachedDecision(
            key=self.cache_key,
            kept=[s.rung.name for s in self.slots],
            speedup=check.speedup if checked else self.result.headline()[2] if final is not None else None,
            vs_switches=versus[0] if versus else None,
            trials_s=trials_s,
            speedkit=self.result.environment.get("speedkit"),
            calibration={p: dict(c) for p, c in self.parity.calibration.items()},
            baseline={"measurement": asdict(baseline.measurement), "noise": dict(self.result.run.get("noise") or {})}
            if baseline is not None and baseline.measurement is not None
            else None,
            final_check=asdict(check) if checked else None,
            final=asdict(final) if final is not None else None,
            chosen={s.rung.name: c for s in self.slots if (c := s.rung.chosen()) is not None} or None,
        )
        try:
            path = self.cache.store(entry)
            self.on_event(f"cache: decision kept in {path}")
        except OSError as exc:
            self.on_event(f"cache: could not keep the decision ({type(exc).__name__}: {first_line(exc)})")

    def _close(self, reference: list[float]) -> None:
        """After the climb: the closing check, the second look, the switches floor, the final check
        (the headline figure) and the profile."""
        cfg, result = self.cfg, self.result
        assert result is not None
        if self._remedy_kept:  # the remedy's bundle, member by member (leave one out), within the rungs' budget
            self.phase = "the remedy's members"
            second_look.leave_one_out(self, self._remedy_kept)
            self._remedy_kept = []
        self.phase = "the closing check"
        reference = closing_check(self, reference)
        self.phase = "the second look"
        reference = second_look.second_look(self, reference)
        base_ms, pace_ms = self._steps_ms  # the final configuration's step is at most the floor's (its pace)
        if cfg.switches_floor:
            self.phase = "the switches"
            # a comparison only where rungs went on top of the floor (confirm_floor says so otherwise)
            on_top = self._floor_row is not None and self.floor and any(s.rung.name not in self.floor for s in self.slots)
            if not on_top or self._closing_affordable("the final configuration against the switches", pace_ms, pace_ms):
                switches.confirm_floor(self, self._floor_row)
            else:
                assert self._floor_row is not None
                self._floor_row.reason = (
                    f"{self._floor_row.reason}; the final configuration against them not measured within the "
                    "budget: the rungs on top stay on their own decided gains"
                )
        floor_check = self._floor_comparison()
        if cfg.final_check and floor_check is not None:  # the final configuration is the floor: timed already
            result.final_check = floor_check
            self.on_event(f"final check: the final configuration is the user's switches alone, {describe(floor_check)}")
        elif cfg.final_check and self.slots:
            if not self._closing_affordable("the final check", base_ms, pace_ms):
                self.on_event("final check: not measured; the speedup is the product of the kept rungs' paired speedups")
            else:
                self.phase = "the final check"
                try:
                    self._final_check()
                except Exception as exc:  # the rungs were judged already; only the headline figure is missing
                    self.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
                    self.on_event(
                        f"final check failed ({type(exc).__name__}: {first_line(exc)}); "
                        "the speedup is the product of the kept rungs' paired speedups"
                    )
        self._scaling_and_profile()

    def _floor_comparison(self) -> PairedResult | None:
        """Where the final configuration is the user's switches alone (every kept rung is of the floor),
        the floor's comparison against the baseline, made at the start of the climb: the same two
        configurations, interleaved, so the final check itself (the headline; not timed again). None
        otherwise, or where the floor was not timed."""
        if not self.slots or any(s.rung.name not in self.floor for s in self.slots):
            return None
        row = self.entry(self.slots[0].rung.name)
        paired = row.comparison if row is not None else None
        if paired is None or paired.a is None or paired.b is None:
            return None
        return replace(
            paired,
            measured_in="the floor's comparison against the baseline at the start of the climb (the final configuration is the user's switches alone)",
        )

    def _closing_affordable(self, what: str, a_ms: float, b_ms: float) -> bool:
        """Whether the budget left holds a closing comparison between steps of ``a_ms`` and ``b_ms`` at its
        fewest blocks; where not, it is skipped and the report says so (the trials end near their budget
        rather than a comparison's length past it)."""
        if not (math.isfinite(a_ms) and math.isfinite(b_ms)) or self.budget.affords(self.budget.comparison_s(a_ms, b_ms)):
            return True
        self.note_budget(what)
        return False

    def note_budget(self, what: str) -> None:
        assert self.result is not None
        self.result.run["budget"]["skipped"].append(what)
        self.on_event(f"{what} skipped: the trials' time budget ({self.budget.budget_s:.0f} s) is spent")

    # -- one rung --------------------------------------------------------------------------
    def _try(self, rung: Rung, reference: list[float], chain: float) -> tuple[RungResult, list[float]]:
        """Apply ``rung`` at its place in the ladder's order among the kept rungs (on top of them, or
        beneath those that come after it, which are switched off and on again on top of it), check
        its parity against the configuration before it and time it against that configuration."""
        state = self.state
        t0 = self.host_clock()
        entry = self._current = RungResult(rung.name, "not_applicable", options=rung.options_dict(), precision=state.precision)
        place = self.stack.place(rung)
        above = [s.rung.name for s in self.slots[place:]]
        try:
            self.stack.configure([i < place for i in range(len(self.slots))])
            reason = agreed_check(rung, state)
        except Exception as exc:  # a check that crashes is a failed rung, not a failed ladder
            self.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
            reason = None
            entry.status, entry.reason = "failed", f"check raised {type(exc).__name__}: {first_line(exc)}"
        if reason is not None or entry.status == "failed":
            self.stack.all_on()
            entry.reason = entry.reason or reason
            self._current = None
            return entry, reference

        losses = reference
        precision_before = state.precision
        slot: Slot | None = None
        n = len(self.slots) + 1

        def toggle(on: bool) -> None:
            self.stack.configure([True] * n if on else [i != place for i in range(n)])

        try:
            slot = self._candidate = self.stack.insert(place, rung, (True,) * place)
            self.stack.configure([True] * n)  # the kept rungs after it, back on top of it
            entry.changes = list(slot.handle.changes) + ([f"applied beneath {', '.join(above)}"] if above else [])
            entry.rewrite = slot.rewrite_report()
            entry.precision = state.precision
            losses = self._judge_parity(entry, slot, place, reference, toggle, precision_before)
            inert = entry.parity.max_rel_diff == 0.0 and rung.acts_through_numerics
            problem = agreed_problem(slot.handle)
            if problem:
                raise RungProblem(problem)
            if not entry.parity.passed:
                entry.status = "reverted"
                entry.reason = entry.reason or (  # the batches' parity says why where it failed
                    f"numerics changed: loss differs by {entry.parity.max_rel_diff:.2e} (relative) > "
                    f"tolerance {entry.parity.tolerance:.0e} for {entry.parity.precision}"
                )
            elif inert:
                entry.status = "reverted"
                entry.reason = (
                    "no effect here: the loss trajectory is bit-identical with it, so no op ran at its "
                    "precision and it cannot change the step's speed; not timed"
                )
            else:
                shared = not rung.new_shape_cost and (not above or self.stack.shares_batches())
                paired = self.compare(toggle, rung.name, shared_batches=shared)
                problem = agreed_problem(slot.handle)
                if problem:
                    raise RungProblem(problem)
                entry.comparison = paired
                self.last_comparison[rung.name] = paired
                self.judged.add(((rung.name,), tuple(s.rung.name for s in self.slots if s is not slot)))
                entry.measurement = paired.b
                entry.gain_vs_previous = paired.speedup
                entry.gain_vs_baseline = chain * paired.speedup
                entry.status, entry.reason = self.decide(paired, rung.memory_comparable)
                if not rung.memory_comparable:
                    entry.changes.append("note: peak memory is not compared: " + rung.memory_note)
        except Exception as exc:
            self.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
            entry.status = "failed"
            self.failed_beneath[rung.name] = tuple(s.rung.name for s in self.slots if s is not slot)
            if isinstance(exc, torch.OutOfMemoryError):
                entry.reason = "out of memory while trying this rung"
            elif isinstance(exc, RungProblem):
                entry.reason = str(exc)
            else:
                entry.reason = f"{type(exc).__name__}: {first_line(exc)}"[:300]
        finally:
            if slot is not None:
                try:
                    entry.changes += slot.handle.report()
                except Exception as exc:  # what it did is a report line; never the cause of a failure
                    entry.changes.append(f"note: its report raised {type(exc).__name__}: {first_line(exc)}")
            self.snapshot.restore()
            if state.device.type == "cuda":
                torch.cuda.empty_cache()
        self._candidate = self._current = None
        self._keep_or_undo(entry, slot)
        entry.seconds = self.host_clock() - t0
        return entry, losses if entry.status == "kept" else reference

    def _judge_parity(
        self,
        entry: RungResult,
        slot: Slot,
        place: int,
        reference: list[float],
        toggle: Callable[[bool], None],
        precision_before: str,
    ) -> list[float]:
        """The candidate ``slot`` at ``place`` judged on its loss trajectory against ``reference`` (with
        dropout off where it draws its masks from another stream; also with the precision rungs off
        for a rewrite of the model's code): sets ``entry.parity`` and its notes; returns the trajectory."""
        state, rung = self.state, slot.rung
        self.on_event(f"  {rung.name}: parity over {self.parity.steps} steps")
        with heartbeat(self.on_event, f"  {rung.name}: parity"):  # the first steps compile, where a rung compiles
            losses = self.parity.trajectory()
        entry.parity = self.parity.judge(losses, reference)
        if self.parity.draws_differently(place):
            # the same function drawing its dropout masks differently: compare with dropout off
            with dropout_off(state.model):
                candidate = self.parity.trajectory()
                toggle(False)
                try:
                    before = self.parity.trajectory()
                finally:
                    toggle(True)
            entry.parity = self.parity.judge(candidate, before)
            entry.changes.append(
                "note: parity judged with dropout off (the change draws dropout masks from "
                "another random stream, so trajectories with dropout on differ by design)"
            )
        if entry.parity.passed and rung.judged_at_full_precision:
            precise = self.parity.at_full_precision(place)
            if precise is not None:
                entry.changes.append(
                    f"note: also judged with the precision rungs off ({precise.precision}): "
                    f"max rel diff {precise.max_rel_diff:.2e} against {precise.tolerance:.0e}"
                )
                if not precise.passed:
                    entry.parity = precise
        bit_identical = entry.parity.max_rel_diff == 0.0
        if bit_identical and not rung.acts_through_numerics and state.precision != precision_before:
            entry.changes.append("note: applied but had no numerical effect here (loss trajectory bit-identical)")
        # a change that makes the samples draw other random numbers (another worker count under augmentations):
        # the loss trajectory runs on parity batches drawn once, so what must hold is read from the loaders
        batches = rung.batch_parity(state, self.parity.steps * state.step.accumulate)
        if batches is not None:
            entry.changes += [f"note: {line}" for line in batches.lines()]
            if distributed.any_rank(not batches.passed):
                entry.parity = replace(entry.parity, passed=False)
                entry.reason = batches.failure or "the batches differ on another rank where they must not"
        return losses

    def _keep_or_undo(self, entry: RungResult, slot: Slot | None) -> None:
        """After a trial: the kept rungs all on again, the candidate's slot among them where kept, else
        undone (an undo that fails is the rung's failure)."""
        state = self.state
        if entry.status == "kept":
            self.stack.all_on()
        elif slot is not None:
            try:
                if slot in self.slots:
                    self.stack.remove(self.slots.index(slot))
                else:
                    slot.undo()
            except Exception as exc:  # an undo that fails leaves the run in an unknown state: say so loudly
                entry.status = "failed"
                entry.reason = f"{entry.reason}; undo raised {type(exc).__name__}: {exc}"
            entry.precision = state.precision
        else:
            self.stack.all_on()

    def decide(self, paired: PairedResult, memory_comparable: bool = True) -> tuple[str, str]:
        cfg = self.cfg
        if paired.verdict == "faster":
            return "kept", describe(paired)
        if not memory_comparable:  # its peak memory is not what the allocator's peak shows
            return "reverted", (
                f"not shown to pay within the budget: {describe(paired)}" if paired.verdict == "undecided" else describe(paired)
            )
        a_mem = paired.a.peak_memory_bytes if paired.a else None
        b_mem = paired.b.peak_memory_bytes if paired.b else None
        if a_mem and b_mem is not None and b_mem < a_mem * (1 - cfg.memory_gain) and not_slower(paired, cfg.min_gain):
            return "kept", f"{1 - b_mem / a_mem:.0%} less peak memory, not slower ({describe(paired)})"
        if paired.verdict == "undecided":
            return "reverted", f"not shown to pay within the budget: {describe(paired)}"
        return "reverted", describe(paired)

    def compare(
        self, set_candidate: Callable[[bool], None], label: str, shared_batches: bool = True, whole_budget: bool = False
    ) -> PairedResult:
        """Time the current configuration (A) against the candidate (B) (:meth:`Timing.compare`; leaves A
        on) within the comparison's budget: its share of what the trials' budget has left for the rungs
        (:meth:`TrialBudget.for_comparison`; with ``whole_budget``, all of it), or for the switches', the
        final check's and the scaling's comparisons their share of what is left (:meth:`TrialBudget.for_closing`)."""
        assert self.timing is not None

        def budget() -> float:
            if self.phase in CLOSING_COMPARISONS:
                return self.budget.for_closing(len(CLOSING_COMPARISONS) - CLOSING_COMPARISONS.index(self.phase))
            if whole_budget:
                return self.budget.for_comparison(1)
            return self.budget.for_comparison(self._left + 1)

        with distributed.together():  # a comparison that raised on one rank ends on every rank
            return self.timing.compare(set_candidate, label, budget, shared_batches=shared_batches)

    def _scaling(self) -> None:
        """Across several processes: the final configuration's step with DDP's gradient all-reduce (A)
        timed against the same step without it (B), interleaved: B is what one GPU runs with this
        per-rank batch, so B's step time over A's is the scaling efficiency (``run["scaling"]``). Not
        measured where the step cannot leave the all-reduce out (a replayed CUDA graph holds it)."""
        assert self.result is not None
        step, world = self.state.step, self.state.step.world_size()
        self.on_event(f"scaling: the final configuration with and without the gradient all-reduce over {world} ranks")
        entry: dict[str, Any] = {"world_size": world, "efficiency": None}
        fixed = step.gradient_sync_fixed()
        if fixed is not None:  # the same on every rank: the graph stopped on all of them or on none
            entry["note"] = f"the all-reduce cannot be switched off: {fixed}"
            shares = [r["share"] for r in (self.result.run.get("ranks_communication") or {}).get("ranks", [])]
            if shares and all(s is not None for s in shares):
                # were every collective's time exposed, one GPU would run the step without it; the rank whose
                # collectives took least is the one the others wait for: its time in them is the transfers',
                # the others' holds their wait for it (on two H200s 11% on one rank, 79% on the other)
                entry["efficiency_at_least"] = round(1 - min(shares), 4)
            self.on_event(f"scaling: not measured: {entry['note']}")
            self.result.run["scaling"] = entry
            return
        try:
            paired = self.compare(lambda on: step.gradient_sync(not on), "scaling", shared_batches=self.stack.shares_batches())
            assert paired.a is not None and paired.b is not None
            entry.update(
                efficiency=round(paired.b.step_ms / paired.a.step_ms, 4),
                step_ms_synced=paired.a.step_ms,
                step_ms_unsynced=paired.b.step_ms,
                note=(
                    "each rank's step times the slowest rank's; one GPU without DDP also skips DDP's forward "
                    "bookkeeping, which the step without the all-reduce still runs"
                ),
            )
            self.on_event(f"scaling: efficiency {entry['efficiency']:.2f}")
        except Exception as exc:  # the decisions stand; only the scaling figure is missing
            self.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
            entry["note"] = f"{type(exc).__name__}: {first_line(exc)}"
        finally:
            step.gradient_sync(True)
            self.snapshot.restore()
        self.result.run["scaling"] = entry

    # -- the closing phases ----------------------------------------------------------------
    def entry(self, name: str) -> RungResult | None:
        assert self.result is not None
        return next((r for r in self.result.rungs if r.name == name and r.status not in ("closing", "switches")), None)

    def _final_check(self) -> None:
        """The final configuration against the baseline, interleaved: the headline figure."""
        assert self.result is not None
        n = len(self.slots)
        self.on_event(f"final check: {', '.join(s.rung.name for s in self.slots)} against the baseline")
        try:
            self.result.final_check = self.compare(
                lambda on: self.stack.configure([on] * n), "final", shared_batches=self.stack.shares_batches()
            )
        finally:
            self.stack.configure([True] * n)
            self.snapshot.restore()


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


def _date(created: float) -> str:
    """When a cached decision was stored, for the report ("an unknown date" where not recorded)."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created else "an unknown date"


def _optimizers(state: TrainState) -> list[torch.optim.Optimizer]:
    """Every optimizer of the run: the state's, and those its step steps (a manual-optimization GAN's two)."""
    found = list(state.step.all_optimizers())
    if state.optimizer is not None and all(o is not state.optimizer for o in found):
        found.insert(0, state.optimizer)
    return found
