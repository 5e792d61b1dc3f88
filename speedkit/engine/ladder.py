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
the user's switches (``configs/defaults.yaml`` ``switches:``) are timed against the final
configuration and the faster kept, so the result is never one measured slower than them; and a
final check times the final configuration against the baseline, interleaved, for the headline
figure. The trials keep to a time budget, a share of the fit's planned time (:meth:`Ladder._plan_budget`).

Every trial starts from the snapshot taken before the ladder, and the snapshot is restored at the
end (weights, optimizer state, schedulers, grad scaler, data generators, RNG), so none of the trial
steps leak into training. A rung that raises is undone and reported as failed; the ladder goes on.
An interruption (Ctrl-C, SIGTERM) or an error the ladder cannot attribute to a rung undoes every
change, restores the snapshot, keeps the rungs finished so far in ``ladder.result`` and re-raises.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from speedkit import compat, config
from speedkit.data.batch import count_items
from speedkit.data.static import signature
from speedkit.errors import SpeedkitError, first_line
from speedkit.fork_safety import protect_forked_children
from speedkit.handle import Handle, changed_in_place
from speedkit.measure.clock import StepClock
from speedkit.measure.config import MeasureConfig
from speedkit.measure.flops import CONVENTION, count_step_flops, peak_tflops
from speedkit.measure.noise import host_bound, noise_source
from speedkit.measure.session import MeasureSession
from speedkit.measure.compare import compare
from speedkit.measure.stats import Comparison, describe, not_slower
from speedkit.results import (
    SCHEMA_VERSION,
    LadderResult,
    Measurement,
    PairedResult,
    Parity,
    RungResult,
)
from speedkit.rungs.base import Rung, active_dropouts
from speedkit.training.snapshot import Snapshot
from speedkit.training.state import TrainState


class TrialsNotRun(SpeedkitError):
    """The trials cannot judge anything on this run (the baseline's own loss is not finite): nothing
    was applied, the state is the user's, the message says why."""


def _rel_diff(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


class _Slot:
    """A kept (or candidate) rung in the stack, switched off and on through its handle: suspended
    and resumed when the handle can redo its changes, else undone and applied again."""

    def __init__(self, rung: Rung, handle: Handle, below: tuple[bool, ...]) -> None:
        self.rung, self.handle = rung, handle
        #: which slots beneath it were on when it was last switched on (applied on top of them)
        self.below = below

    @property
    def on(self) -> bool:
        return self.handle is not None and self.handle.active and not self.handle.suspended

    def disable(self) -> None:
        if not self.on:
            return
        if self.handle.toggleable:
            self.handle.suspend()
        else:
            self.handle.undo()

    def enable(self, state: TrainState) -> None:
        if self.on:
            return
        if self.handle.active and self.handle.suspended:
            self.handle.resume()
            return
        reason = self.rung.check(state)
        if reason is not None:
            raise RuntimeError(f"{self.rung.name} no longer applies: {reason}")
        self.handle = self.rung.apply(state)

    def undo(self) -> None:
        self.handle.undo()


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
            share of the fit's planned time (see :meth:`_plan_budget`).

    After :meth:`run`, the kept rungs stay applied on the restored initial state (``handles``);
    :meth:`revert` undoes them. ``result`` holds the report so far, also after an interruption.
    """

    def __init__(self, state: TrainState, rungs: list[Rung], measure: MeasureConfig | dict[str, Any] | None = None, *,
                 recipe: str | None = None, on_event: Callable[[str], None] | None = None, clock: StepClock | None = None,
                 host_clock: Callable[[], float] = time.perf_counter, run_info: dict[str, Any] | None = None,
                 planned_steps: int | None = None, trace_dir: Path | str | None = None,
                 on_progress: Callable[[int, int, str], None] | None = None) -> None:
        self.state = state
        #: ``(done, total, label)``: rungs tried of the ladder's, then its closing phases (a progress bar)
        self.on_progress = on_progress or (lambda done, total, label: None)
        #: where the profile's Chrome/Perfetto traces of the baseline and the final configuration go
        #: (the report's folder's ``traces``); None: no traces written
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        #: per kept rung, the rungs kept together with it and the paired speedup of the decision that
        #: kept it last (its climb, a second look, a closing check): the attribution's marginal gains
        self._decisions: dict[str, tuple[tuple[str, ...], float | None]] = {}
        if state.device.type == "cuda":  # the ladder makes CUDA events and streams: keep forked workers off them
            protect_forked_children()
        self.rungs = list(rungs)
        self.cfg = MeasureConfig.from_dict(measure)
        self.recipe = recipe
        self.on_event = on_event or (lambda line: None)
        self.clock = clock or StepClock(state.device)
        self.host_clock = host_clock
        self.run_info = dict(run_info or {})
        self.slots: list[_Slot] = []
        #: steps of every parity trajectory: the configured ones, or more where a rung needs more to be
        #: in effect (a CUDA graph's warm-up and capture), the reference included so the two line up
        self._parity_steps = max([self.cfg.parity_steps, *(r.parity_steps_needed() for r in rungs)])
        self._settle_needed = 0  # untimed steps a rebased rung asks for after the next switch
        #: optimizer steps per window of the A/B comparisons: ``steps``, or more where the baseline's
        #: windows vary more than ``noise_target`` (see :meth:`_noise`)
        self._window_steps = self.cfg.steps
        self.result: LadderResult | None = None
        self.session: MeasureSession | None = None
        self._candidate: _Slot | None = None
        self._iterators: dict[int, Iterator[Any]] = {}
        self._parity_batches: list[Any] = []
        #: batches differ in shape (padded to each batch's longest sequence): each A/B block then
        #: times both configurations on the same batches, whose work would otherwise differ more
        #: between windows than most rungs change it
        self._shapes_vary = False
        self._current: RungResult | None = None
        self._phase = "the setup"  # what the ladder is doing, for an interruption's report
        self._reference: list[float] = []
        self._calibration: dict[str, dict[str, float]] = {}
        #: optimizer steps the fit plans (None: not known): the trials' time budget is a share of them
        self.planned_steps = planned_steps
        self._started = 0.0                 # host clock at the start of the trials
        self._budget_s = self.cfg.trials_budget_s
        self._left = 0                      # rungs not yet tried in the climb
        #: each rung's latest comparison alone (its climb's, or a second look's)
        self._last_comparison: dict[str, PairedResult] = {}
        #: (rungs, kept rungs) configurations a second look or closing check has judged already
        self._judged: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
        #: the kept rungs beneath which a rung failed in the climb (it may not fail beneath others:
        #: a CUDA graph refused for a sync that the compiled step no longer makes)
        self._failed_beneath: dict[str, tuple[str, ...]] = {}

    @property
    def handles(self) -> list[Handle]:
        return [s.handle for s in self.slots]

    # -- the run -------------------------------------------------------------------------
    def run(self) -> LadderResult:
        from speedkit.report.environment import collect_environment

        state, cfg = self.state, self.cfg
        self.result = LadderResult(
            schema_version=SCHEMA_VERSION, recipe=self.recipe, environment=collect_environment(state.device),
            device=str(state.device), flops={}, measure=asdict(cfg), rungs=[], run=self.run_info,
            parity_calibration=self._calibration)  # filled as tolerances are calibrated
        state.model.train()
        self._started = self.host_clock()
        # the snapshot comes first: even starting a DataLoader iterator draws from the RNG
        self._snapshot = Snapshot(state.model, state.optimizer, state.step, state.data)
        completed = False
        try:
            with state.step.trial():
                self._climb()
            completed = True
        except BaseException as exc:
            self.result.interrupted = f"{type(exc).__name__} during {self._phase}"
            if self._current is not None:  # the rung being tried when it happened: undone, said so
                self._current.status = "interrupted"
                self._current.reason = f"{type(exc).__name__} while trying it; undone"
                self.result.rungs.append(self._current)
            raise
        finally:
            if not completed:  # nothing of the ladder may stay on the user's model
                for slot in [*self.slots, *([self._candidate] if self._candidate else [])][::-1]:
                    try:
                        slot.undo()
                    except Exception:  # keep undoing the rest
                        pass
                self.slots = []
            self._iterators.clear()
            self.result.run["trials_s"] = round(self.host_clock() - self._started, 3)
            self._snapshot.restore()  # trial steps never leak into the user's training
            if self._snapshot.restored_attributes:  # what the user's step changes on self, put back
                self.result.run["attributes_restored"] = sorted(self._snapshot.restored_attributes)
            if self._snapshot.unrestored:
                self.result.run["attributes_not_restored"] = sorted(self._snapshot.unrestored)
            # the copies of the weights and optimizer state are spent: never hold them through the fit
            self._snapshot = None  # type: ignore[assignment]
            self._parity_batches = []
            if state.data is not None:
                state.data.release()
            if state.device.type == "cuda":  # the trials reset the peak-memory counter per window; what
                torch.cuda.reset_peak_memory_stats(state.device)  # the user reads later is their training's
        return self.result

    def _climb(self) -> None:
        state, cfg, result = self.state, self.cfg, self.result
        assert result is not None
        if state.data is None:
            raise RuntimeError("the ladder needs batches: give the state a data source")
        self._phase = "the baseline"
        accumulate = state.step.accumulate
        self._parity_batches = state.data.parity_batches(self._parity_steps * accumulate)
        self._shapes_vary = len({repr(signature(b)) for b in self._parity_batches}) > 1
        if self._shapes_vary:
            result.run["batch_shapes"] = "vary: each A/B block times both configurations on the same batches"
        first = state.data.to_device(self._parity_batches[0])
        flops = count_step_flops(state.step, first)
        self._snapshot.restore()
        peak, peak_source = peak_tflops(state.device, cfg.mfu_precision, cfg.peak_tflops)
        items, unit = count_items(self._parity_batches[0], cfg.throughput_unit)
        result.flops = {"per_step": flops * accumulate if flops else flops,
                        "convention": CONVENTION.format(precision=cfg.mfu_precision, source=peak_source),
                        "peak_tflops": peak, "peak_source": peak_source, "precision": cfg.mfu_precision}
        self.session = MeasureSession(state.device, clock=self.clock, host_clock=self.host_clock,
                                      flops_per_step=result.flops["per_step"], peak_tflops=peak,
                                      items_per_step=items * accumulate, unit=unit, telemetry=cfg.telemetry)
        self.session.memory_outside_peak = self._memory_outside_peak

        self.on_event("baseline: parity reference")
        t0 = self.host_clock()
        reference = self._reference = self._trajectory()
        broken = next((i for i, loss in enumerate(reference) if not math.isfinite(loss)), None)
        if broken is not None:
            raise TrialsNotRun(f"the training loss is {reference[broken]} at step {broken + 1} of the baseline, before any "
                               "rung: no rung's numerics can be checked against it; fix the model's loss first")
        in_play = {"fp32", state.precision, *(r.precision for r in self.rungs if r.precision)}
        self.on_event(f"baseline: parity tolerances from the model's sensitivity ({', '.join(sorted(in_play))})")
        for precision in sorted(in_play, key=config.PRECISION_ORDER.index):
            self._tolerance(precision)
        self.on_event("baseline: measuring")
        base_m = self._measure_alone()
        result.run["noise"] = self._noise(base_m)
        result.run["budget"] = self._plan_budget(base_m)
        result.rungs.append(RungResult(
            "baseline", "baseline", precision=state.precision, measurement=base_m,
            parity=Parity(len(reference), 0.0, state.precision, reference, reference, 0.0, True),
            gain_vs_previous=1.0, gain_vs_baseline=1.0, seconds=self.host_clock() - t0))
        chain = 1.0
        order = self._trial_order(base_m)
        for i, rung in enumerate(order, 1):
            self._left = len(order) - i + 1
            self._phase = rung.name
            self.on_event(f"[{i}/{len(self.rungs)}] {rung.name}")
            self.on_progress(i - 1, len(order), rung.name)
            entry, losses = self._try(rung, reference, chain)
            result.rungs.append(entry)
            if entry.status == "kept":
                reference = losses
                chain *= entry.gain_vs_previous or 1.0
                self._decisions[rung.name] = ((rung.name,), entry.gain_vs_previous)
            self.on_event(f"[{i}/{len(self.rungs)}] {rung.name}: {entry.status}" + (f" ({entry.reason})" if entry.reason else ""))
        self._left = 0
        self.on_progress(len(order), len(order), "closing check, second look, final check, profile")
        self._phase = "the closing check"
        reference = self._closing_check(reference)
        self._phase = "the second look"
        reference = self._second_look(reference)
        switches = None
        if cfg.switches_floor:
            self._phase = "the switches"
            switches, reference = self._switches_floor(reference)
        if cfg.final_check and self.slots:
            self._phase = "the final check"
            try:
                self._final_check()
            except Exception as exc:  # the rungs were judged already; only the headline figure is missing
                self.on_event(f"final check failed ({type(exc).__name__}: {first_line(exc)}); "
                              "the speedup is the product of the kept rungs' paired speedups")
        if switches is not None and switches.comparison is not None and result.final_check is not None:
            switches.gain_vs_baseline = result.final_check.speedup * switches.comparison.speedup
        if cfg.profile:
            self._phase = "the profile"
            self._profile()

    def _profile(self) -> None:
        """Where the time goes (:mod:`speedkit.profile`): a short profiler window of the baseline and
        of each prefix of the final configuration's rungs (the last one the final configuration),
        host syncs and traces of the first and the last, NVML sampled across them; then each kept
        rung's attribution (:mod:`speedkit.engine.attribution`). Never fails the run: a window that cannot
        be taken leaves the profile's ``note``."""
        from speedkit.engine.attribution import attribute
        from speedkit.measure.nvml import NvmlSampler, timeline
        from speedkit.profile import CATEGORIES, CATEGORY_LABELS, ProfileUnavailable, find_host_syncs, profile_window

        result, state, n = self.result, self.state, len(self.slots)
        assert result is not None
        names = [s.rung.name for s in self.slots]
        profile: dict[str, Any] = {"steps": self.cfg.profile_steps, "categories": list(CATEGORIES),
                                   "labels": dict(CATEGORY_LABELS), "windows": [], "host_syncs": {}, "note": None,
                                   "host_syncs_note": None if state.device.type == "cuda" else
                                   "found on CUDA only (its sync debug mode): a CPU step has no device to wait for"}
        result.profile = profile
        sampler = NvmlSampler.create(state.device) if self.cfg.telemetry else None
        marks: list[tuple[float, str]] = []
        if sampler is not None:
            sampler.start()
        started = time.monotonic()  # the sampler's own start, within microseconds
        try:
            for k in range(n + 1):
                label = "baseline" if k == 0 else "final" if k == n else names[k - 1]
                self.on_event(f"profile: {label}" + (f" ({' + '.join(names[:k])})" if 0 < k < n else ""))
                self._configure([i < k for i in range(n)])
                run_one = self._runner()
                for _ in range(self._settle()):
                    run_one()
                edge = k in (0, n)
                trace = self.trace_dir / f"{label}.json.gz" if edge and self.trace_dir is not None else None
                marks.append((time.monotonic() - started, label))
                window = profile_window(run_one, steps=self.cfg.profile_steps, label=label, device=state.device,
                                        trace_path=trace).to_dict()
                window["rungs"] = names[:k]
                if trace is not None and window.get("trace"):
                    window["trace"] = f"{self.trace_dir.name}/{trace.name}"  # beside the report
                profile["windows"].append(window)
                if edge and state.device.type == "cuda":
                    profile["host_syncs"][label] = find_host_syncs(run_one, state.device)
                    if k == 0 and n == 0:
                        profile["host_syncs"]["final"] = profile["host_syncs"][label]
        except ProfileUnavailable as exc:
            profile["note"] = f"profile stopped at {len(profile['windows'])} of {n + 1} windows: {first_line(exc)}"
        except Exception as exc:  # the decisions stand; only the picture of where the time goes is missing
            profile["note"] = (f"profile stopped at {len(profile['windows'])} of {n + 1} windows: "
                               f"{type(exc).__name__}: {first_line(exc)}")
        finally:
            if sampler is not None:
                sampler.stop()
                result.telemetry_timeline = timeline(sampler.samples, sampler.interval_s, marks)
            self._configure([True] * n)
            self._snapshot.restore()
        if len(profile["windows"]) == n + 1 and n:
            measured = result.final_check.speedup if result.final_check is not None else None
            result.attribution = attribute(names, self._decisions, profile["windows"], measured, CATEGORY_LABELS)

    def _noise(self, baseline: Measurement) -> dict[str, Any]:
        """How much the baseline's windows vary, its likely source, and the window length the
        comparisons use: where the spread is over ``noise_target`` on a device the host drives,
        windows are lengthened (the noise of a window's mean falls with the square root of its steps),
        up to ``max_window_factor`` times. speedkit's own share is removed where it can be: no
        telemetry thread during comparisons, and its loaders' workers kept off the training thread's
        core (``data_path``); the garbage collector's full passes, a share of a host-bound step in a
        large process, are the ``gc_freeze`` rung's to cut, in the trials as in the fit."""
        cfg = self.cfg
        spread = baseline.spread
        factor = 1
        # on a CPU (the step clock is the host's) the noise is mostly other processes and the clock's
        # frequency, which come in spells longer than a window: longer windows would cost without helping
        if spread > cfg.noise_target > 0 and self.clock.name != "perf_counter":
            factor = min(cfg.max_window_factor, math.ceil((spread / cfg.noise_target) ** 2))
        self._window_steps = cfg.steps * max(1, factor)
        noise = {"baseline_spread": spread, "window_steps": self._window_steps,
                 "source": noise_source(baseline, cfg.host_bound_share, cfg.busy_util)}
        if factor > 1:
            self.on_event(f"baseline: windows vary by {spread:.1%} ({noise['source']}): comparisons time windows of "
                          f"{self._window_steps} steps")
        return noise

    # -- the trials' time budget ------------------------------------------------------------------
    def _plan_budget(self, baseline: Measurement) -> dict[str, Any]:
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
        planned = self.planned_steps
        planned_s = planned * baseline.step_ms / 1e3 if planned and math.isfinite(planned) and planned > 0 else None
        if planned_s is None:
            self._budget_s, rule = cfg.trials_budget_s, f"the cap ({cfg.trials_budget_s:.0f} s): the fit's length is not known"
        else:
            self._budget_s = min(cfg.trials_budget_s, max(cfg.trials_min_s, cfg.trials_share * planned_s))
            rule = (f"{cfg.trials_share:.0%} of the fit's planned {planned_s:.0f} s ({planned} steps at the baseline's "
                    f"{baseline.step_ms:.1f} ms), within [{cfg.trials_min_s:.0f}, {cfg.trials_budget_s:.0f}] s")
        return {"budget_s": round(self._budget_s, 1), "rule": rule, "skipped": []}

    def _remaining(self) -> float:
        return self._budget_s - (self.host_clock() - self._started)

    def _comparison_budget(self) -> float:
        """Seconds the next comparison may take: its share of the budget left (the rungs left in the
        climb, the switches and the final check), never more than ``budget_s``; the switches' and the
        final check's own comparisons always get ``budget_s`` (the floor and the headline), as do the
        comparisons made with ``whole_budget`` (:meth:`_compare`)."""
        if self._phase in ("the switches", "the final check"):
            return self.cfg.budget_s
        return min(self.cfg.budget_s, max(0.0, self._remaining()) / (self._left + 2))

    def _note_budget(self, what: str) -> None:
        assert self.result is not None
        self.result.run["budget"]["skipped"].append(what)
        self.on_event(f"{what} skipped: the trials' time budget ({self._budget_s:.0f} s) is spent")

    def _trial_order(self, baseline: Measurement) -> list[Rung]:
        """The order the rungs are tried in: the ladder's, except on a GPU where the baseline shows who
        sets the step's pace. Each rung still goes in at its place in the ladder's order (beneath the
        kept rungs that come after it there), only the order of the trials changes:

        - a host-bound step (the host drives the device, see :func:`speedkit.measure.noise.host_bound`):
          the rungs that cut host work (``Rung.cuts_host_work``: compile, CUDA graphs, the progress bar's
          sync) are tried first, compile first of them: in the host's noise the others' device-side gains do not
          show, beneath them they do;
        - a device-bound step: the rungs whose only gain is the device's wait for the host
          (``Rung.host_side``: the loader's path, the garbage collector, the progress bar's sync, CUDA
          graphs) are tried after the others, on the step they made fast, where a wait can show (on
          GPT-2 in fp32, 340 ms a step on a GPU 99% busy, data_path and gc_freeze measured 1.00x in 20 s
          each; compiled in bf16 the step is 51 ms)."""
        host, step = baseline.host_ms, baseline.step_ms
        # where the step clock is the host's (a CPU), every step is host time: nothing to reorder
        # (nor where the host's time is not known)
        if self.clock.name == "perf_counter" or host is None or not step:
            return list(self.rungs)
        assert self.result is not None
        if not host_bound(baseline, self.cfg.host_bound_share, self.cfg.busy_util):
            later = [r for r in self.rungs if r.host_side]
            order = [r for r in self.rungs if not r.host_side] + later
            if order != list(self.rungs):
                util = (baseline.telemetry or {}).get("util_mean")
                pace = (f"GPU busy {util:.0f}% of the time" if host >= self.cfg.host_bound_share * step and util is not None
                        else f"host {host:.1f} of {step:.1f} ms per step")
                moved = ", ".join(r.name for r in later)
                self.result.run["trial_order"] = f"device-bound baseline ({pace}): {moved} tried last"
                self.on_event(f"device-bound baseline ({pace}): trying {moved} last, on the step the others made fast")
            return order
        # compile first of them: the others are judged on the step it compiled, where the host's noise is
        # least and what they remove shows (a graph break's sync: explicit_mask, 1.04x undecided in eager
        # on Lightning's demo Transformer, 1.26x beneath compile; the progress bar's sync)
        first = sorted((r for r in self.rungs if r.cuts_host_work), key=lambda r: r.name != "compile")
        if not first:
            return list(self.rungs)
        order = first + [r for r in self.rungs if not r.cuts_host_work]
        self.result.run["trial_order"] = (f"host-bound baseline (host {host:.1f} of {step:.1f} ms per step): "
                                          f"{', '.join(r.name for r in first)} tried first")
        self.on_event(f"host-bound baseline ({host:.1f} ms of host time in a {step:.1f} ms step): trying "
                      f"{', '.join(r.name for r in first)} first, the others beneath them")
        return order

    # -- one rung --------------------------------------------------------------------------
    def _try(self, rung: Rung, reference: list[float], chain: float) -> tuple[RungResult, list[float]]:
        """Apply ``rung`` at its place in the ladder's order among the kept rungs (on top of them, or
        beneath those that come after it, which are switched off and on again on top of it), check
        its parity against the configuration before it and time it against that configuration."""
        state = self.state
        t0 = self.host_clock()
        entry = self._current = RungResult(rung.name, "not_applicable", options=rung.options_dict(), precision=state.precision)
        place = self._place(rung)
        above = [s.rung.name for s in self.slots[place:]]
        try:
            self._configure([i < place for i in range(len(self.slots))])
            reason = rung.check(state)
        except Exception as exc:  # a check that crashes is a failed rung, not a failed ladder
            reason = None
            entry.status, entry.reason = "failed", f"check raised {type(exc).__name__}: {first_line(exc)}"
        if reason is not None or entry.status == "failed":
            self._configure([True] * len(self.slots))
            entry.reason = entry.reason or reason
            self._current = None
            return entry, reference

        losses = reference
        precision_before = state.precision
        slot: _Slot | None = None
        n = len(self.slots) + 1

        def toggle(on: bool) -> None:
            self._configure([True] * n if on else [i != place for i in range(n)])

        try:
            slot = self._candidate = _Slot(rung, rung.apply(state), (True,) * place)
            self.slots.insert(place, slot)
            self._configure([True] * n)  # the kept rungs after it, back on top of it
            entry.changes = list(slot.handle.changes) + ([f"applied beneath {', '.join(above)}"] if above else [])
            entry.precision = state.precision
            self.on_event(f"  {rung.name}: parity over {self._parity_steps} steps")
            with self._heartbeat(f"  {rung.name}: parity"):  # the first steps compile, where a rung compiles
                losses = self._trajectory()
            entry.parity = self._parity(losses, reference)
            if self._draws_differently(place):
                # the same function drawing its dropout masks differently: compare with dropout off
                with _dropout_off(state.model):
                    candidate = self._trajectory()
                    toggle(False)
                    try:
                        before = self._trajectory()
                    finally:
                        toggle(True)
                entry.parity = self._parity(candidate, before)
                entry.changes.append("note: parity judged with dropout off (the change draws dropout masks from "
                                     "another random stream, so trajectories with dropout on differ by design)")
            if entry.parity.passed and rung.judged_at_full_precision:
                precise = self._parity_at_full_precision(place)
                if precise is not None:
                    entry.changes.append(f"note: also judged with the precision rungs off ({precise.precision}): "
                                         f"max rel diff {precise.max_rel_diff:.2e} against {precise.tolerance:.0e}")
                    if not precise.passed:
                        entry.parity = precise
            bit_identical = entry.parity.max_rel_diff == 0.0
            inert = bit_identical and rung.acts_through_numerics
            if bit_identical and not inert and state.precision != precision_before:
                entry.changes.append("note: applied but had no numerical effect here (loss trajectory bit-identical)")
            if slot.handle.problem():
                raise _RungProblem(slot.handle.problem())
            if not entry.parity.passed:
                entry.status = "reverted"
                entry.reason = (f"numerics changed: loss differs by {entry.parity.max_rel_diff:.2e} (relative) > "
                                f"tolerance {entry.parity.tolerance:.0e} for {entry.parity.precision}")
            elif inert:
                entry.status = "reverted"
                entry.reason = ("no effect here: the loss trajectory is bit-identical with it, so no op ran at its "
                                "precision and it cannot change the step's speed; not timed")
            else:
                shared = not rung.new_shape_cost and (not above or self._kept_rungs_share_batches())
                paired = self._compare(toggle, rung.name, shared_batches=shared)
                if slot.handle.problem():
                    raise _RungProblem(slot.handle.problem())
                entry.comparison = paired
                self._last_comparison[rung.name] = paired
                self._judged.add(((rung.name,), tuple(s.rung.name for s in self.slots if s is not slot)))
                entry.measurement = paired.b
                entry.gain_vs_previous = paired.speedup
                entry.gain_vs_baseline = chain * paired.speedup
                entry.status, entry.reason = self._decide(paired, rung.memory_comparable)
                if not rung.memory_comparable:
                    entry.changes.append("note: peak memory is not compared: " + rung.memory_note)
        except Exception as exc:
            entry.status = "failed"
            self._failed_beneath[rung.name] = tuple(s.rung.name for s in self.slots if s is not slot)
            if isinstance(exc, torch.OutOfMemoryError):
                entry.reason = "out of memory while trying this rung"
            elif isinstance(exc, _RungProblem):
                entry.reason = str(exc)
            else:
                entry.reason = f"{type(exc).__name__}: {first_line(exc)}"[:300]
        finally:
            if slot is not None:
                try:
                    entry.changes += slot.handle.report()
                except Exception as exc:  # what it did is a report line; never the cause of a failure
                    entry.changes.append(f"note: its report raised {type(exc).__name__}: {first_line(exc)}")
            self._snapshot.restore()
            if state.device.type == "cuda":
                torch.cuda.empty_cache()
        self._candidate = self._current = None
        if entry.status == "kept":
            self._configure([True] * len(self.slots))
        elif slot is not None:
            try:
                if slot in self.slots:
                    self._remove_slot(self.slots.index(slot))
                else:
                    slot.undo()
            except Exception as exc:  # an undo that fails leaves the run in an unknown state: say so loudly
                entry.status = "failed"
                entry.reason = f"{entry.reason}; undo raised {type(exc).__name__}: {exc}"
            entry.precision = state.precision
        else:
            self._configure([True] * len(self.slots))
        entry.seconds = self.host_clock() - t0
        return entry, losses if entry.status == "kept" else reference

    def _parity_of(self, on: list[bool], off: list[bool], reference: list[float]) -> tuple[list[float], Parity]:
        """The configuration ``on`` (switched to, and left on) judged against ``reference``, the
        trajectory of the configuration ``off``; returns its own trajectory and the parity. Where a
        rung on in it draws its dropout masks from another stream (compile, a fused attention), both
        configurations are run again with dropout off and judged on those."""
        self._configure(on)
        losses = self._trajectory()
        if not (any(s.on and s.handle.draws_differently for s in self.slots) and active_dropouts(self.state.model)):
            return losses, self._parity(losses, reference)
        with _dropout_off(self.state.model):
            candidate = self._trajectory()
            self._configure(off)
            try:
                before = self._trajectory()
            finally:
                self._configure(on)
        return losses, self._parity(candidate, before)

    def _place(self, rung: Rung) -> int:
        """Where ``rung`` goes among the kept rungs: after those before it in the ladder's order."""
        order = {r.name: i for i, r in enumerate(self.rungs)}
        return sum(order.get(s.rung.name, -1) < order[rung.name] for s in self.slots)

    def _draws_differently(self, place: int, on: list[bool] | None = None) -> bool:
        """Whether the configuration with the rung at ``place`` draws its dropout masks from another
        random stream than the one without it, so that trajectories with dropout on differ by design:
        the rung itself draws differently (a fused attention), or a rung on above it does, rebuilt on
        top of it (compile: the mask applied as given beneath it is another compiled graph, which
        consumes Inductor's random offsets in another order; a Transformer's loss moved by 1.9e-3
        in fp32 with dropout on, by rounding with it off). ``on``: the slots on (default: all)."""
        on = on if on is not None else [True] * len(self.slots)
        drawing = self.slots[place].handle.draws_differently or any(
            on[i] and self.slots[i].handle.draws_differently for i in range(place + 1, len(self.slots)))
        return bool(drawing and active_dropouts(self.state.model))

    def _parity_at_full_precision(self, place: int) -> Parity | None:
        """The parity of the candidate at ``place`` with the kept precision rungs switched off (None
        when none is on): a rewrite of the model's code is the same function at any precision, and
        only at the precision the run started in is the envelope narrow enough to show a defect
        smaller than bf16's rounding (a dropped attention scale, a wrong gradient)."""
        precise = [s.rung.precision is None or i == place for i, s in enumerate(self.slots)]
        if all(precise):
            return None
        dropout = self._draws_differently(place, precise)
        try:
            with _dropout_off(self.state.model) if dropout else contextlib.nullcontext():
                self._configure(precise)
                with_it = self._trajectory()
                self._configure([p and i != place for i, p in enumerate(precise)])
                without = self._trajectory()
                return self._parity(with_it, without)
        finally:
            self._configure([True] * len(self.slots))

    def _decide(self, paired: PairedResult, memory_comparable: bool = True) -> tuple[str, str]:
        cfg = self.cfg
        if paired.verdict == "faster":
            return "kept", describe(paired)
        if not memory_comparable:  # its peak memory is not what the allocator's peak shows
            return "reverted", (f"not shown to pay within the budget: {describe(paired)}" if paired.verdict == "undecided"
                                else describe(paired))
        a_mem = paired.a.peak_memory_bytes if paired.a else None
        b_mem = paired.b.peak_memory_bytes if paired.b else None
        if a_mem and b_mem is not None and b_mem < a_mem * (1 - cfg.memory_gain) and not_slower(paired, cfg.min_gain):
            return "kept", f"{1 - b_mem / a_mem:.0%} less peak memory, not slower ({describe(paired)})"
        if paired.verdict == "undecided":
            return "reverted", f"not shown to pay within the budget: {describe(paired)}"
        return "reverted", describe(paired)

    # -- closing and final checks ------------------------------------------------------------
    def _closing_check(self, reference: list[float]) -> list[float]:
        """Re-judge each kept rung that asks for it, with the kept rungs after it on top; returns the
        final configuration's loss trajectory."""
        result = self.result
        assert result is not None
        j = 0
        while j < len(self.slots) - 1:
            slot = self.slots[j]
            if not slot.rung.recheck:
                j += 1
                continue
            entry = next(r for r in result.rungs if r.name == slot.rung.name)
            names = ", ".join(s.rung.name for s in self.slots[j + 1:])
            self.on_event(f"closing check: {slot.rung.name} with {names} on top")
            t0 = self.host_clock()
            without = [i != j for i in range(len(self.slots))]
            closing = RungResult(f"closing check: without {slot.rung.name}", "closing", changes=[f"reverted {slot.rung.name}"])
            try:
                losses, closing.parity = self._parity_of(without, [True] * len(self.slots), reference)
                closing.precision = self.state.precision
                if not closing.parity.passed:  # the configuration without it must be the same function
                    raise RuntimeError("the configuration without it changes numerics")
                paired = self._compare(lambda on: self._configure([True] * len(self.slots) if on else without), slot.rung.name,
                                       shared_batches=self._kept_rungs_share_batches())
                status, why = self._decide(paired)
            except Exception as exc:  # put the configuration back and say why the check failed
                paired, status, why = None, "failed", f"{type(exc).__name__}: {first_line(exc)}"
            finally:
                self._snapshot.restore()
            if status == "reverted":  # it no longer pays with the later rungs on top
                self._remove_slot(j)
                self._judged.add(((slot.rung.name,), tuple(s.rung.name for s in self.slots)))
                entry.status = "reverted"
                entry.reason = f"reverted by the closing check: with {names} on top, {why}; before them: {entry.reason}"
                closing.reason = f"final configuration without {slot.rung.name}"
                closing.comparison, closing.measurement = paired, paired.a if paired else None
                closing.seconds = self.host_clock() - t0
                result.rungs.append(closing)
                self.on_event(f"closing check: {slot.rung.name} reverted ({why})")
                reference = losses
                continue
            self._configure([True] * len(self.slots))
            if status == "kept" and paired is not None:  # its gain in the final order, measured
                self._decisions[slot.rung.name] = ((slot.rung.name,), paired.speedup)
            note = f"closing check with {names} on top: {why}" + (", kept" if status == "kept" else ", kept as it was")
            entry.reason = f"{entry.reason}; {note}" if entry.reason else note
            self.on_event(f"closing check: {slot.rung.name} kept")
            j += 1
        return reference

    def _second_look(self, reference: list[float]) -> list[float]:
        """Judge the rungs reverted on speed again, on the final configuration, pass after pass until
        a pass keeps none (``together_passes`` at most): a rung whose gain was hidden in the noise of
        the step in front of it (fused_optimizer on a host-bound eager step) or that pays only with
        rungs kept after it. Each goes in at its place in the ladder, beneath the kept rungs after it
        (switched off, then on again on top of it, rebased), and is judged against the final
        configuration without it, in the order of :meth:`_second_look_groups`: a rung with the
        partners it names (bf16 with channels_last and compile on a convnet), each rung alone (the
        likeliest to pay first), and the rungs still undecided but leaning faster, all together.
        The groups of the first pass are judged whatever the trials' budget has left, each with a
        whole comparison's (``budget_s``: where small gains add up, they are what the budget would be
        spent on first); once it is spent, the rest is skipped. A configuration already judged is
        not judged again."""
        for n in range(self.cfg.together_passes):
            changed, skipped = False, False
            for group in self._second_look_groups():
                key = (tuple(r.name for r in group), tuple(s.rung.name for s in self.slots))
                if key in self._judged or not all(self._worth_another_look(r) for r in group):
                    continue  # judged on this configuration already, or kept since in this pass
                if self._remaining() <= 0 and (n > 0 or len(group) == 1):
                    skipped = True  # the groups of the first pass after it are still judged
                    continue
                self._judged.add(key)
                # a group of the first pass: its likeliest gains, judged once with a whole comparison's
                # budget (at the minimum of blocks, Lightning's demo Transformer's rungs leaning faster
                # measured 1.53x [0.24, 9.58] together over 2 blocks and were reverted, the trials'
                # budget spent on the climb's noisy eager steps)
                kept, reference = self._look_again(group, reference, whole_budget=n == 0 and len(group) > 1)
                changed = changed or kept
            if skipped:
                self._note_budget("second look" if n == 0 and not changed else "second look (the rest)")
                break
            if not changed:
                break
        return reference

    def _worth_another_look(self, rung: Rung) -> bool:
        """Worth another look: measured and reverted for not paying (undecided or slower), or rejected
        on numerics under another precision than the final configuration's (channels_last against an
        fp32 envelope, before bf16 was kept), or failed in the climb beneath other kept rungs than the
        final configuration's (cuda_graph refused for a sync in eager code that the compiled step does
        not make: transformers' check whether a padding mask is all ones), and not kept since."""
        entry = self._entry(rung.name)
        if entry is None or any(s.rung is rung for s in self.slots):
            return False
        if entry.status == "failed":
            beneath = self._failed_beneath.get(rung.name)
            return beneath is not None and beneath != tuple(s.rung.name for s in self.slots)
        if entry.status != "reverted":
            return False
        if entry.comparison is not None:
            return True
        parity = entry.parity  # a rewrite is judged at full precision anyway: its function differs
        return (parity is not None and not parity.passed and parity.precision != self.state.precision
                and not rung.judged_at_full_precision)

    def _entry(self, name: str) -> RungResult | None:
        assert self.result is not None
        return next((r for r in self.result.rungs if r.name == name and r.status not in ("closing", "switches")), None)

    def _second_look_groups(self) -> list[list[Rung]]:
        """Each rung reverted on speed with the partners it names that were reverted too; then, while
        the trials' budget lasts, each rung alone, the highest point estimate first (a rung rejected on
        numerics under another precision, never timed, counts as even); then all those still
        undecided with a gain in their point estimate together: small gains (2-3% each on a noisy
        host-bound step) that no comparison of one could tell from the noise add up to one it can.
        Alone first, so that a rung judged on its own is not kept on another's gain (fused AdamW's
        3% riding on compile's 19% in a group); with the budget spent the singles are skipped and
        the groups still judged."""
        candidates = [r for r in self.rungs if self._worth_another_look(r)]
        groups: list[list[Rung]] = []
        for rung in candidates:
            partners = [p for p in candidates if p.name in rung.partners]
            if partners:
                group = sorted([rung, *partners], key=self.rungs.index)
                if group not in groups:
                    groups.append(group)

        def estimate(rung: Rung) -> float:
            paired = self._last_comparison.get(rung.name)
            return paired.speedup if paired is not None else 1.0

        groups += [[r] for r in sorted(candidates, key=estimate, reverse=True)]
        leaning = [r for r in candidates if self._leans_faster(r)]
        if len(leaning) > 1 and leaning not in groups:
            groups.append(leaning)
        return groups

    def _leans_faster(self, rung: Rung) -> bool:
        """Undecided in its last comparison, with a point estimate above 1."""
        paired = self._last_comparison.get(rung.name)
        return paired is not None and paired.verdict == "undecided" and paired.speedup > 1.0

    def _look_again(self, group: list[Rung], reference: list[float],
                    whole_budget: bool = False) -> tuple[bool, list[float]]:
        """Apply ``group`` at its places in the final configuration and judge it against that
        configuration without it (``whole_budget``: see :meth:`_compare`); keep it if it pays. Returns
        whether it was kept, and the reference trajectory from then on."""
        result = self.result
        assert result is not None
        order = {rung.name: i for i, rung in enumerate(self.rungs)}
        entries = [self._entry(r.name) for r in group]
        first = min(order[r.name] for r in group)
        above = [s.rung.name for s in self.slots if order[s.rung.name] > first]
        where = f"beneath {', '.join(above)}" if above else \
            f"on top of {', '.join(s.rung.name for s in self.slots)}" if self.slots else "on the baseline"
        label = " + ".join(r.name for r in group)
        self.on_event(f"second look: {label} {where}")
        t0, inserted = self.host_clock(), []
        parity: Parity | None = None
        try:
            for rung in group:  # in ladder order: each at its place among the kept rungs
                place = self._place(rung)
                self._configure([i < place for i in range(len(self.slots))])
                reason = rung.check(self.state)
                if reason is not None:
                    raise RuntimeError(f"{rung.name} no longer applies: {reason}")
                self.slots.insert(place, _Slot(rung, rung.apply(self.state), (True,) * place))
                inserted = [i + (i >= place) for i in inserted] + [place]
            n = len(self.slots)
            losses, parity = self._parity_of([True] * n, [i not in inserted for i in range(n)], reference)
            if not parity.passed:
                raise RuntimeError(f"numerics changed: loss differs by {parity.max_rel_diff:.2e} > {parity.tolerance:.0e}")
            for i in inserted:
                if self.slots[i].handle.problem():
                    raise RuntimeError(self.slots[i].handle.problem())
                if self.slots[i].rung.judged_at_full_precision:
                    precise = self._parity_at_full_precision(i)
                    if precise is not None and not precise.passed:
                        raise RuntimeError(f"numerics changed: {self.slots[i].rung.name} moves the loss by "
                                           f"{precise.max_rel_diff:.2e} > {precise.tolerance:.0e} with the precision rungs off")
            without = [i not in inserted for i in range(n)]
            paired = self._compare(lambda on: self._configure([True] * n if on else without), label,
                                   shared_batches=self._kept_rungs_share_batches(), whole_budget=whole_budget)
            status, why = self._decide(paired, all(r.memory_comparable for r in group))
            if len(group) == 1:
                self._last_comparison[group[0].name] = paired
        except Exception as exc:
            paired, status, why = None, "failed", f"{type(exc).__name__}: {first_line(exc)}"
        finally:
            self._snapshot.restore()
        together = f" together with {', '.join(r.name for r in group[1:])}" if len(group) > 1 else ""
        if status == "kept":  # its entry keeps its first figures; the row after says what changed
            assert paired is not None
            for rung in group:
                self._decisions[rung.name] = (tuple(r.name for r in group), paired.speedup)
            for rung, entry in zip(group, entries):
                assert entry is not None
                slot = next(s for s in self.slots if s.rung is rung)
                entry.status, entry.changes = "kept", list(slot.handle.changes) + slot.handle.report()
                partners = [r.name for r in group if r is not rung]
                entry.reason = (f"kept on a second look {where}" + (f", with {', '.join(partners)}" if partners else "")
                                + f": {why}; before them: {entry.reason}")
            result.rungs.append(RungResult(
                f"second look: {label} {where}", "closing", precision=self.state.precision,
                changes=[f"applied {label} {where}"], parity=parity, comparison=paired, measurement=paired.b,
                gain_vs_previous=paired.speedup, reason=f"final configuration with {label}",
                seconds=self.host_clock() - t0))
            kept = True
        else:
            for i in sorted(inserted, reverse=True):
                self._remove_slot(i)
            self._configure([True] * len(self.slots))
            for entry in entries:
                assert entry is not None
                entry.reason = f"{entry.reason}; second look {where}{together}: {why}, reverted"
            kept = False
        for entry in entries:
            assert entry is not None
            entry.seconds = (entry.seconds or 0.0) + (self.host_clock() - t0) / len(group)
        self.on_event(f"second look: {label} {'kept' if kept else 'reverted'} ({why})")
        return kept, (losses if kept else reference)

    # -- the user's switches: the floor ---------------------------------------------------------
    def _switches_floor(self, reference: list[float]) -> tuple[RungResult | None, list[float]]:
        """Time the switches a user turns on by hand (``configs/defaults.yaml`` ``switches:``, those of
        the ladder's rungs that apply on the baseline, together) against the final configuration, and
        keep the faster: the final configuration is never one measured slower than the switches. Where
        the switches win, the ladder starts again from them: the rungs of the climb's final
        configuration that are not switches, and every other rung reverted on speed, are judged on top
        of them (second looks). Returns the ``switches`` row (None when no switch is in the ladder) and
        the reference trajectory from then on."""
        result = self.result
        assert result is not None
        names = config.switch_rungs()
        candidates = [r for r in self.rungs if r.name in names]
        if not candidates:
            return None, reference
        t0 = self.host_clock()
        final = list(self.slots)
        n = len(final)
        self._configure([False] * n)  # which switches apply is asked of the baseline
        switches, notes = [], []
        for rung in candidates:
            try:
                reason = rung.check(self.state)
            except Exception as exc:
                reason = f"check raised {type(exc).__name__}: {first_line(exc)}"
            if reason is None:
                switches.append(rung)
            else:
                notes.append(f"{rung.name}: not applicable ({reason})")
        label = " + ".join(r.name for r in switches) or "none"
        row = RungResult("switches", "switches", reason=f"the switches by hand: {label}", changes=notes)
        result.rungs.append(row)
        kept_names = [s.rung.name for s in final]
        if not switches or [r.name for r in switches] == kept_names:
            self._configure([True] * n)
            if switches:
                row.gain_vs_previous = 1.0
            row.reason += ("; none applies" if not switches else "; the same as the final configuration")
            row.seconds = self.host_clock() - t0
            return row, reference
        self.on_event(f"switches: {label} against the final configuration")
        subset = all(r.name in kept_names for r in switches)
        added: list[_Slot] = []
        parity: Parity | None = None
        try:
            if subset:  # the final configuration with its other rungs off
                mask_switches = [s.rung.name in {r.name for r in switches} for s in self.slots]
            else:  # applied on the baseline beside the final configuration, which is off while they run
                for rung in switches:
                    slot = _Slot(rung, rung.apply(self.state), (False,) * n + (True,) * len(added))
                    self.slots.append(slot)
                    added.append(slot)
                mask_switches = [False] * n + [True] * len(added)
            mask_final = [True] * n + [False] * len(added)
            losses, parity = self._parity_of(mask_switches, [False] * len(self.slots), self._reference)
            row.parity, row.precision = parity, self.state.precision
            problems = [s.handle.problem() for s in self.slots if s.on and s.handle.problem()]
            if not parity.passed:
                raise _RungProblem(f"numerics changed: loss differs from the baseline's by {parity.max_rel_diff:.2e} > "
                                   f"{parity.tolerance:.0e} ({self.state.precision})")
            if problems:
                raise _RungProblem(problems[0])
            self._configure(mask_final)
            paired = self._compare(lambda on: self._configure(mask_switches if on else mask_final), "switches",
                                   shared_batches=not any(s.rung.new_shape_cost for s in self.slots))
        except Exception as exc:  # not a candidate: the final configuration stays, said why
            self._drop(added)
            self._configure([True] * n)
            self._snapshot.restore()
            row.reason += f"; not measured: {exc if isinstance(exc, _RungProblem) else f'{type(exc).__name__}: {first_line(exc)}'}"
            row.seconds = self.host_clock() - t0
            self.on_event(f"switches: {row.reason}")
            return row, reference
        finally:
            self._snapshot.restore()
        row.comparison, row.measurement, row.gain_vs_previous = paired, paired.b, paired.speedup
        # the switches replace the climb's configuration when faster with confidence; between two
        # configurations that both paid against the baseline, also when undecided but ahead by more
        # than the minimum gain (neither is then shown faster; the one ahead is the better bet)
        switches_win = paired.verdict == "faster" or (
            paired.verdict == "undecided" and n > 0 and paired.speedup > 1 + self.cfg.min_gain)
        if not switches_win:
            self._drop(added)
            self._configure([True] * n)
            row.reason += f"; the final configuration against them: {1 / paired.speedup:.3f}x ({describe(paired)})"
            row.seconds = self.host_clock() - t0
            self.on_event(f"switches: the final configuration is {1 / paired.speedup:.3f}x the switches")
            return row, reference
        # the switches win: the climb starts again from them
        if subset:
            for j in reversed(range(n)):
                if not mask_switches[j]:
                    self._remove_slot(j)
        else:
            self._configure(mask_switches)
            for slot in reversed(final):
                self.slots.remove(slot)
                slot.undo()
            for slot in added:
                slot.below = slot.below[n:]
        self._configure([True] * len(self.slots))
        switch_names = {r.name for r in switches}
        # their gain over the baseline: the climb's (its decisions, each group once) times theirs over it
        climb = self._decided_product(kept_names)
        for rung in switches:
            self._decisions[rung.name] = (tuple(r.name for r in switches),
                                          climb * paired.speedup if climb is not None else None)
        for name in kept_names:
            entry = self._entry(name)
            if entry is not None and name not in switch_names:
                entry.status = "reverted"
                entry.reason = (f"{entry.reason}; the switches were faster than the climb's final configuration "
                                f"({paired.speedup:.3f}x): judged again on top of them")
        for rung in switches:
            entry = self._entry(rung.name)
            if entry is not None and entry.status != "kept":
                slot = next(s for s in self.slots if s.rung is rung)
                entry.status, entry.changes = "kept", list(slot.handle.changes) + slot.handle.report()
                entry.reason = f"kept with the switches ({label}, {describe(paired)} over the climb); before: {entry.reason}"
        row.reason += f"; faster than the climb's final configuration ({describe(paired)}): the ladder starts from them"
        self.on_event(f"switches: faster than the climb ({paired.speedup:.3f}x); judging the other rungs on top")
        self._phase = "the second look on the switches"
        reference = self._second_look(losses)
        self._phase = "the switches"
        if len(self.slots) > len(switches):  # rungs kept on top: the headline against the switches, measured
            on_top = [s.rung not in switches for s in self.slots]
            mask_s = [not o for o in on_top]
            try:
                again = self._compare(lambda on: self._configure(mask_s if on else [True] * len(self.slots)), "switches")
                row.comparison, row.measurement, row.gain_vs_previous = again, again.b, again.speedup
            finally:
                self._configure([True] * len(self.slots))
                self._snapshot.restore()
        else:  # the same configuration: its comparison with the climb is in the reason
            row.comparison, row.gain_vs_previous = None, 1.0
            row.reason += "; nothing paid on top of them: the final configuration is the switches"
        row.seconds = self.host_clock() - t0
        return row, reference

    def _decided_product(self, names: list[str]) -> float | None:
        """The product of the decisions that kept ``names`` (a group once); None where one is unknown."""
        if any(n not in self._decisions for n in names):
            return None
        groups = {self._decisions[n][0]: self._decisions[n][1] for n in names}
        if any(v is None for v in groups.values()):
            return None
        return math.prod(groups.values()) if groups else 1.0

    def _drop(self, added: list[_Slot]) -> None:
        """Undo candidate slots appended above the kept ones (they were applied with those off)."""
        for slot in reversed(added):
            if slot in self.slots:
                slot.disable()
                self.slots.remove(slot)
                slot.undo()

    def _remove_slot(self, j: int) -> None:
        """Undo the rung of slot ``j``, the slots above it switched back on without it (rebased)."""
        self._configure([i != j for i in range(len(self.slots))])
        self.slots.pop(j).undo()
        for above in self.slots[j:]:  # what they were applied on no longer has slot j
            above.below = above.below[:j] + above.below[j + 1:]

    def _final_check(self) -> None:
        """The final configuration against the baseline, interleaved: the headline figure."""
        assert self.result is not None
        n = len(self.slots)
        self.on_event(f"final check: {', '.join(s.rung.name for s in self.slots)} against the baseline")
        try:
            self.result.final_check = self._compare(lambda on: self._configure([on] * n), "final",
                                                    shared_batches=self._kept_rungs_share_batches())
        finally:
            self._configure([True] * n)
            self._snapshot.restore()

    def _configure(self, mask: list[bool]) -> None:
        """Switch the kept rungs to ``mask`` (on/off per slot), touching only the slots from the
        first that changes upward (rungs above it may depend on it)."""
        current = [s.on for s in self.slots]
        if current == mask:
            return
        first = next(i for i, (c, m) in enumerate(zip(current, mask)) if c != m)
        for slot in reversed(self.slots[first:]):
            slot.disable()
        for i in range(first, len(self.slots)):
            slot = self.slots[i]
            if not mask[i]:
                continue
            slot.enable(self.state)
            below = tuple(mask[:i])
            if slot.below != below:  # what it wraps changed beneath it while it was off
                slot.handle.rebase()
                self._settle_needed = max(self._settle_needed, slot.handle.settle_steps)
            slot.below = below

    def _settle(self) -> int:
        """Untimed steps after switching configuration: the configured ones, or more where a rung
        that was rebased needs them (and forget that need)."""
        steps, self._settle_needed = max(self.cfg.settle, self._settle_needed), 0
        return steps

    def revert(self) -> None:
        """Undo every kept rung, last first."""
        while self.slots:
            self.slots.pop().undo()

    # -- measuring -------------------------------------------------------------------------
    def _runner(self, batches: list[Any] | None = None) -> Callable[[], None]:
        """One step of the current configuration, fed by the current data source's iterator, or by
        ``batches`` (the block's own, see ``_shapes_vary``) where given."""
        state = self.state
        session = self.session
        assert session is not None
        source = iter(batches) if batches is not None else self._source_iterator()
        return session.runner(lambda micro, i: state.step(micro, i), source, state.step.accumulate)

    def _source_iterator(self) -> Iterator[Any]:
        """The current data source's iterator, made on first use and kept across windows. Beneath
        wrappers that only map batches (channels_last), the source they wrap is iterated and its
        batches mapped: both configurations of a comparison read one stream, and a source serving
        one live iterator at a time (data_path's ring: a second iterator closes the first) is never
        asked for another while the first is in use."""
        data = self.state.data
        assert data is not None
        data, maps = data.unmapped()
        if id(data) not in self._iterators:
            self._iterators[id(data)] = data.iterator()
        batches = self._iterators[id(data)]
        for map_batch in reversed(maps):  # the innermost wrapper's first
            batches = map(map_batch, batches)
        return batches

    def _block_batches(self, same_source: bool) -> list[Any] | None:
        """The batches every window of the next A/B block runs, drawn once (untimed) from the data
        source, where batch shapes vary and both configurations read the same source; else None
        (each window draws its own: a change of the data path is timed on the data it serves)."""
        if not (self._shapes_vary and same_source):
            return None
        source = self._source_iterator()
        return [next(source) for _ in range(self._window_steps * self.state.step.accumulate)]

    def _memory_outside_peak(self) -> int:
        """What the step in effect holds outside the allocator's peak (a kept or tried CUDA graph's
        pool; a suspended graph's pool is not the configuration being timed)."""
        hook = getattr(self.state.step, "memory_outside_peak", None)
        return int(hook()) if callable(hook) else 0

    def _measure_alone(self) -> Measurement:
        cfg, session = self.cfg, self.session
        assert session is not None
        self._snapshot.restore(rng=False)
        return session.measure(self._runner(), warmup=cfg.warmup, steps=cfg.steps, repeats=cfg.repeats)

    def _kept_rungs_share_batches(self) -> bool:
        """Whether the kept rungs may be timed on batches an A/B block shares (none of them does work
        per new input shape)."""
        return not any(s.rung.new_shape_cost for s in self.slots)

    def _compare(self, set_candidate: Callable[[bool], None], label: str, shared_batches: bool = True,
                 whole_budget: bool = False) -> PairedResult:
        """Time the current configuration (A) against the candidate (B) in A B B A blocks until the
        paired decision is made, ``max_blocks`` are spent or its budget is out (:meth:`_comparison_budget`;
        ``whole_budget``: ``budget_s`` whatever the trials' budget has left). Leaves A on.
        ``shared_batches``: where batch shapes vary, the windows of a block may run the same batches.
        The budget counts from the end of the warm-ups: a compilation there (a configuration compiled
        for the first time, or again, e.g. after parity ran it with dropout off) is the trials' time,
        and left the comparison, counted from its start, too few blocks to decide."""
        cfg, session = self.cfg, self.session
        assert session is not None
        self._snapshot.restore(rng=False)
        start = self.host_clock()
        set_candidate(True)
        source_b = self.state.data
        with self._heartbeat(f"  {label}: warm-up"):
            session.warm(self._runner(), max(cfg.warmup, self._settle()))
        set_candidate(False)
        same_source = self.state.data is source_b
        session.warm(self._runner(), self._settle())
        budget = cfg.budget_s if whole_budget else self._comparison_budget()
        shared: list[Any] | None = None

        def start_block(switch: Callable[[bool], bool]) -> None:
            nonlocal shared
            shared = self._block_batches(same_source and shared_batches)
            if shared is not None:  # each configuration meets the block's shapes once, untimed: work the
                for candidate in (True, False):  # first batch of a shape brings (cuBLAS, cuDNN plans) is
                    switch(candidate)  # then timed in neither configuration's windows, not in the first
                    session.warm(self._runner(shared), self._window_steps)

        def look(verdict: Comparison) -> None:
            self.on_event(f"  {label}: {verdict.blocks} blocks: {verdict.speedup:.3f}x "
                          f"[{verdict.low:.3f}, {verdict.high:.3f}] {verdict.verdict.replace('_', ' ')}")

        paired = compare(set_candidate, lambda: session.window(self._runner(shared), self._window_steps), cfg,
                         budget_s=budget, clock=self.host_clock, settle=lambda: session.warm(self._runner(), self._settle()),
                         start_block=start_block, on_look=look)
        return PairedResult(**asdict(paired.comparison), a=session.measurement(paired.a, warmup=cfg.warmup),
                            b=session.measurement(paired.b, warmup=cfg.warmup), seconds=self.host_clock() - start)

    @contextlib.contextmanager
    def _heartbeat(self, label: str, every_s: float = 20.0) -> Iterator[None]:
        """Say "still running" every ``every_s`` seconds of wall time while the block runs (a first
        compile can take minutes with nothing else to show)."""
        done = threading.Event()
        start = time.monotonic()

        def beat() -> None:
            while not done.wait(every_s):
                self.on_event(f"{label}: still running after {time.monotonic() - start:.0f} s")

        thread = threading.Thread(target=beat, daemon=True, name="speedkit-heartbeat")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    # -- parity ----------------------------------------------------------------------------
    def _parity(self, losses: list[float], reference: list[float]) -> Parity:
        """The loss trajectory against the reference, step by step within the envelope of the numerics
        in effect (a change of the function shows at the first steps, where rounding has moved the
        trajectory least)."""
        state = self.state
        per_step = self._tolerance(state.precision)
        moves = [_rel_diff(a, b) for a, b in zip(losses, reference)]
        worst = max(moves, default=0.0)
        passed = all(m <= t for m, t in zip(moves, per_step))
        return Parity(len(losses), max(per_step, default=0.0), state.precision, reference, losses, worst, passed,
                      envelope=per_step[:len(losses)])

    def _tolerance(self, precision: str) -> list[float]:
        """The parity tolerance of ``precision`` on this model, per parity step: ``safety`` times how
        far the baseline trajectory moves, at that step or before, under rounding of that precision
        (see :class:`_RoundingNoise`: every weight, every leaf module's output at its kernels' own
        precision, every gradient), the worst of ``seeds`` draws, never under the configured floor.
        The envelope of a change's class: a precision rung is judged against its precision's own
        rounding; a rung that keeps the precision (a layout, compile, a kernel) against the reduction
        order and kernel choice of the precision in effect. Measured once per precision at the
        baseline, kept in the report's ``parity_calibration``."""
        if precision not in self._calibration:
            floor = config.tolerance(precision, self.state.device.type)
            calibration = config.parity_calibration()
            epsilon = float(calibration["epsilon"][precision])
            safety = float(calibration["safety"])
            seeds = int(calibration.get("seeds", 1))
            envelope = [0.0] * self._parity_steps
            kernels: list[str] = []
            for seed in range(seeds):
                noise = _RoundingNoise(self.state.model, epsilon, seed=seed, epsilons=calibration["epsilon"])
                perturbed = self._trajectory(noise=noise)
                kernels = noise.kernels
                moves = [_rel_diff(a, b) for a, b in zip(perturbed, self._reference)]
                envelope = [max(e, m if math.isfinite(m) else 0.0) for e, m in zip(envelope, moves)]
            # rounding differences, once in the weights, stay: a step's envelope is the worst so far
            envelope = list(itertools.accumulate(envelope, max))
            sensitivity = max(envelope, default=0.0)
            self._calibration[precision] = {
                "epsilon": epsilon, "sensitivity": sensitivity, "safety": safety, "floor": floor, "seeds": seeds,
                "envelope": envelope, "tolerance": max(floor, safety * sensitivity),
                "per_step": [max(floor, safety * e) for e in envelope], "kernels": kernels}
        return list(self._calibration[precision]["per_step"])

    def _trajectory(self, noise: _RoundingNoise | None = None) -> list[float]:
        """Losses of the parity steps from the snapshot (weights, schedule, RNG); one sync at the end;
        with ``noise`` on the model where given (the calibration's)."""
        self._snapshot.restore()
        state, n = self.state, self.state.step.accumulate
        data = state.data
        assert data is not None
        losses = []
        with noise if noise is not None else contextlib.nullcontext():
            for i in range(self._parity_steps):
                micro = [data.to_device(b) for b in self._parity_batches[i * n:(i + 1) * n]]
                losses.append(state.step(micro, i))
        return [float(x) for x in torch.stack(losses).float().cpu()]



class _RoundingNoise:
    """Rounding-level noise on a model, for calibrating parity: every floating-point weight, every
    leaf module's floating-point output and every weight's gradient multiplied by 1 ± ``relative``
    (as if each were rounded once more), signs from private generators (the global RNG is not
    touched).

    A leaf whose kernels compute in a coarser precision than ``relative`` stands for gets that
    precision's noise on its output (``epsilons``, by precision): on CUDA, convolutions while
    ``torch.backends.cudnn.allow_tf32`` is on and Linear layers while float32 matmuls may use TF32
    compute in TF32 — a run "in fp32" is that precise there, and another kernel or layout for them
    (channels_last, compile) moves the loss by their rounding, not by fp32's. ``kernels`` names them.
    """

    def __init__(self, model: torch.nn.Module, relative: float, seed: int = 0,
                 epsilons: dict[str, float] | None = None) -> None:
        self.model, self.relative, self.seed = model, relative, seed
        self.epsilons = {k: float(v) for k, v in (epsilons or {}).items()}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._hooks: list[Any] = []
        #: the leaf kinds given their kernels' coarser precision, e.g. "Conv2d at tf32 (cudnn.allow_tf32)"
        self.kernels: list[str] = []

    def _noisy(self, t: torch.Tensor, relative: float) -> torch.Tensor:
        if t.device not in self._generators:
            self._generators[t.device] = torch.Generator(device=t.device).manual_seed(self.seed)
        signs = torch.randint(0, 2, t.shape, generator=self._generators[t.device], device=t.device, dtype=t.dtype)
        return t * signs.mul_(2 * relative).add_(1 - relative)

    def _kernel_precision(self, module: torch.nn.Module) -> tuple[float, str | None]:
        """The relative rounding of ``module``'s kernels, and why where coarser than ``relative``."""
        tf32 = self.epsilons.get("tf32", 0.0)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cuda":
            return self.relative, None
        if tf32 > self.relative:
            if isinstance(module, torch.nn.modules.conv._ConvNd) and torch.backends.cudnn.allow_tf32:
                return tf32, f"{type(module).__name__} at tf32 (torch.backends.cudnn.allow_tf32)"
            if isinstance(module, torch.nn.Linear) and torch.backends.cuda.matmul.allow_tf32:
                return tf32, f"{type(module).__name__} at tf32 (float32 matmul precision)"
        # a CUDA kernel's reduction order is its own choice (tiles, split-K, atomics, Welford or two
        # passes): another kernel for the same K-long sums moves each by about sqrt(K) fp32 roundings
        k = _reduction_length(module)
        order = self.epsilons.get("fp32", 0.0) * math.sqrt(k)
        if k > 1 and order > self.relative:
            return order, f"{type(module).__name__} at its reduction order (sqrt(K) fp32 roundings for K-long sums)"
        return self.relative, None

    def __enter__(self) -> _RoundingNoise:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.copy_(self._noisy(p, self.relative))
        kernels = set()
        for m in self.model.modules():
            if any(True for _ in m.children()):
                continue
            relative, why = self._kernel_precision(m)
            if why:
                kernels.add(why)
            self._hooks.append(m.register_forward_hook(functools.partial(self._output_hook, relative=relative)))
        self.kernels = sorted(kernels)
        for p in self.model.parameters():
            if p.requires_grad and p.is_floating_point():
                self._hooks.append(p.register_hook(lambda g: self._noisy(g, self.relative)))
        return self

    def _output_hook(self, module: torch.nn.Module, args: Any, output: Any, *, relative: float) -> Any:
        return compat.tree_map(
            lambda t: self._noisy(t, relative) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _reduction_length(module: torch.nn.Module) -> int:
    """How many terms each output of ``module`` sums: a Linear's inputs, a convolution's inputs per
    group times its kernel, a normalization's normalized elements (a custom norm's: its weight's);
    1 for a module that sums nothing (an embedding, an activation)."""
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear):
        return module.in_features
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return module.in_channels // module.groups * math.prod(module.kernel_size)
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return 1
    normalized = getattr(module, "normalized_shape", None)  # LayerNorm, RMSNorm, and their look-alikes
    if normalized:
        return math.prod(normalized)
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm | torch.nn.GroupNorm):
        return 1  # its sums run over the batch: the gradients' noise stands for them
    if "norm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return weight.numel()
    return 1


@contextlib.contextmanager
def _dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """Every dropout rate of ``model`` at 0 inside the block (:func:`active_dropouts`: dropout modules,
    code reading ``dropout.p`` too, and the float rates a model passes to its kernels itself)."""
    saved = [(m, name, getattr(m, name)) for m, name in active_dropouts(model)]
    for m, name, _ in saved:
        setattr(m, name, 0.0)
    changed_in_place()  # a compiled forward guards on the rates (its graphs compile once for 0); a captured graph captures again
    try:
        yield
    finally:
        for m, name, rate in saved:
            setattr(m, name, rate)
        changed_in_place()


class _RungProblem(Exception):
    """A rung's own report that its change stopped working (e.g. compile fell back to eager)."""
