"""SpeedLadder: climb the quick-win ladder inside the user's own Lightning ``fit``.

``SpeedLadder()`` runs **trials**: at ``on_train_start`` — the strategy, precision plugin,
optimizers, schedulers and train loader set up, before the first real training step — the ladder
climbs its rungs on the Trainer's own step (:class:`~speedkit.lightning.step.LightningStep`: the
user's strategy, precision, clipping, accumulation, hooks; under manual optimization the module's whole
``training_step``, :mod:`speedkit.lightning.manual_step`) fed by the Trainer's own loader. It keeps
what pays, puts weights, optimizer state, schedulers, grad scaler, RNG states and the data order
back exactly, and lets Lightning train with the kept configuration. The next real steps are timed
on the same clock, and the report says whether the ladder's figure held.

``SpeedLadder(rungs=[...])`` applies the given rungs without trials (typically ``optimized.yaml``'s
kept rungs): those that act on the model or process flags in ``setup``, before the strategy wraps
the model, those that need the optimizer in ``on_fit_start``.

Under DDP every rank runs the trials in step and decides alike (:mod:`speedkit.distributed`: the
slowest rank's step times, the ranks' mean loss, rank 0's clock, failures shared); rank 0 alone logs
and writes the report. The decisions go in the checkpoint: a fit resumed from it re-applies the kept
rungs without trials (``load_state_dict`` runs before the strategy wraps the model).

Nothing stays behind: ``teardown``, ``on_exception`` (Lightning calls no teardown after an
exception), Ctrl-C and SIGTERM during the trials all undo every change.

The callback is a layer of hooks; the ladder, the rungs and the measurement know nothing of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from speedkit import compat, config
from speedkit import rungs as rung_registry
from speedkit.engine.baseline import TrialsNotRun
from speedkit.engine.cache import DecisionCache
from speedkit.engine.ladder import Ladder
from speedkit.engine.stop import TrialsStopped
from speedkit.errors import ConfigError
from speedkit.fork_safety import collect_garbage
from speedkit.handle import Handle
from speedkit.lightning.data import bind_source, watch_fit_iterator_start
from speedkit.lightning.hook_timer import HookTimer
from speedkit.lightning.manual_step import fit_step
from speedkit.lightning.sharded import sharding
from speedkit.lightning.step import LightningSource
from speedkit.lightning.steps import OptimizerSteps
from speedkit.measure.config import MeasureConfig
from speedkit.measure.holds import judge_holds, left_out_at_most
from speedkit.measure.session import MeasureSession, Window
from speedkit.results import LadderResult
from speedkit.rungs.base import Rung
from speedkit.training.state import TrainState
from speedkit.training.step import StepWrapper

if TYPE_CHECKING:
    from speedkit.report.beside import ReportProcess


def log_event(line: str) -> None:
    """SpeedLadder's default progress line: Lightning's rank-zero info log."""
    rank_zero_info(f"speedkit: {line}")


class SpeedLadder(Callback):
    """Make the Trainer's run faster, with trials (default) or with given rungs.

    Args:
        rungs: rung names, ``{name, options}`` mappings or Rung instances, in order. None: the
            default ladder of ``configs/defaults.yaml``, with trials.
        trials: measure each rung and keep what pays (default: True when ``rungs`` is None). A fit too
            short to pay back its trials (its planned time under ten times their budget) runs none: it
            applies a cached decision where there is one, else trains as set up, and says so in one line;
            ``"always"``: trials whatever the fit's length.
        measure: overrides of ``configs/defaults.yaml``'s ``measure:`` (steps per window, confidence...).
        report_dir: write ``report.json`` and ``report.md`` there once the fit's own steps are timed.
        stop_after_holds: stop the fit once its own steps are timed (``speedkit optimize`` does).
        on_event: called with progress lines (default: Lightning's rank-zero info log).
        cache: keep the trials' decision and re-check it in a later fit of the same model and settings
            instead of climbing again (:mod:`speedkit.engine.cache`): True (default) keeps it under
            ``$SPEEDKIT_CACHE_DIR`` or ``~/.cache/speedkit``, a folder path keeps it there, False
            climbs every time. ``speedkit cache clear`` forgets every decision.

    Raises:
        ConfigError: an unknown rung, a bad option or a bad measure setting, at construction.

    Example::

        trainer = Trainer(callbacks=[SpeedLadder()])                      # trials, default ladder
        trainer = Trainer(callbacks=[SpeedLadder(rungs=["tf32", "compile"])])  # given rungs, no trials
    """

    def __init__(
        self,
        rungs: Sequence[str | dict | Rung] | None = None,
        *,
        trials: bool | str | None = None,
        measure: dict[str, Any] | MeasureConfig | None = None,
        report_dir: str | Path | None = None,
        stop_after_holds: bool = False,
        on_event: Callable[[str], None] | None = None,
        cache: bool | str | Path = True,
    ) -> None:
        super().__init__()
        if not isinstance(cache, (bool, str, os.PathLike)):
            raise ConfigError("cache", f"expected True, False or a folder path, found {type(cache).__name__} {cache!r}")
        #: where decisions are kept: True the default folder, a path that folder, False none
        self.cache = cache
        if trials is not None and not isinstance(trials, bool) and trials != "always":
            raise ConfigError(
                "trials",
                f'expected True, False, "always" or None (trials when no rungs are given), found {trials!r}',
            )
        if on_event is not None and not callable(on_event):
            raise ConfigError("on_event", f"expected a function taking one line of text, found {type(on_event).__name__}")
        if report_dir is not None and not isinstance(report_dir, (str, os.PathLike)):
            raise ConfigError("report_dir", f"expected a folder path, found {type(report_dir).__name__} {report_dir!r}")
        if trials is False and rungs is None:
            raise ConfigError(
                "trials",
                "False applies the rungs given, without measuring them, and none were given; pass "
                "rungs=[...] (e.g. the kept rungs of optimized.yaml), or leave trials on to try the default ladder",
            )
        self.trials = rungs is None if trials is None else bool(trials)
        #: a fit too short to pay back its trials runs none (False: ``trials="always"``)
        self.short_fit = trials != "always"
        self.rungs = rung_registry.make_all(rungs if rungs is not None else list(config.default_ladder()), "rungs")
        #: the checkpoint's key: the callback as constructed (a resume that switches to the kept rungs keeps it)
        self._key = self._generate_state_key(rungs=[r.name for r in self.rungs], trials=self.trials)
        #: the rungs a resumed fit re-applied from its checkpoint's decisions, without trials (None: not resumed so)
        self.resumed: list[str] | None = None
        self.measure = MeasureConfig.from_dict(measure)
        self.report_dir = Path(report_dir) if report_dir is not None else None
        #: where the profile's traces go (default: ``report_dir/traces``; ``speedkit optimize``: its --out's)
        self.trace_dir: Path | None = None
        self.stop_after_holds = stop_after_holds
        #: the optimizer steps the real run plans, where the fit in front of the trials is not that run
        #: (``speedkit optimize``); None: the fit's own (``trainer.estimated_stepping_batches``)
        self.planned_steps: int | None = None
        self.on_event = on_event or log_event  # a module-level function: the callback pickles (ddp_spawn)
        #: ``(done, total, label)`` of the trials, for a progress bar (``speedkit optimize`` sets it)
        self.on_progress: Callable[[int, int, str], None] | None = None
        self.handles: list[Handle] = []
        self.skipped: dict[str, str] = {}
        #: every change applied during the run, kept after teardown undoes them (for reports)
        self.applied_changes: dict[str, list[str]] = {}
        #: what each change applied in the fit said of its work once the fit's steps ran (a graph's captures,
        #: replays and eager steps), read when teardown undoes it
        self.fit_reports: dict[str, list[str]] = {}
        #: the same as numbers (:attr:`speedkit.handle.Handle.counts`), per change that counts its work
        self.fit_counts: dict[str, dict[str, Any]] = {}
        #: the trials' report (None without trials); ``result.holds`` once the fit's steps are timed
        self.result: LadderResult | None = None
        #: the exception that ended the fit (Ctrl-C, SIGTERM, an error), if one did
        self.exception: BaseException | None = None
        #: why the trials did not run in this fit (several processes, manual optimization), if they did not
        self.not_run: str | None = None
        self._state: TrainState | None = None
        self._ladder: Ladder | None = None
        self._probe: _HoldsProbe | None = None
        self._report_process: ReportProcess | None = None  # the report being written beside the fit
        self._steps = OptimizerSteps()  # where the fit's optimizer steps start and end (for the probe)
        self._unwatch: Callable[[], None] | None = None  # the first train iterator's watch (data_path)
        self._bound: list[tuple[Handle, int]] = []  # the fit's bindings, and how many of their changes were reported
        self._rank_zero = True  # this process is global rank 0 (set at setup): it alone speaks and writes
        self._fit: tuple[pl.Trainer, pl.LightningModule] | None = None  # the fit being set up (a resume applies into it)

    @property
    def state_key(self) -> str:
        return self._key

    @property
    def applied(self) -> list[str]:
        return [h.rung for h in self.handles if h.active]

    # -- hooks ---------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._rank_zero = trainer.is_global_zero
        if stage == "fit":  # this fit's record, not an earlier fit's (one callback may serve several fits)
            self.applied_changes, self.skipped = {}, {}
            if self.trials:
                self.result, self.not_run = None, None
        self._fit = (trainer, pl_module) if stage == "fit" else None
        if stage != "fit" or self.trials:
            return
        step = fit_step(trainer, pl_module)
        self._state = TrainState(model=pl_module, optimizer=None, device=step.device, step=step)
        self._apply_stage("setup")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch_first_iterator(trainer)
        if self.trials or self._state is None:
            return
        self._state.optimizer = self._state.step.optimizer
        self._apply_stage("fit_start")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_watch()
        if not self.trials:
            self._apply_train_start(trainer, pl_module)
            return
        self.result, self.not_run = None, None
        if not pl_module.automatic_optimization and trainer.world_size > 1:
            self.not_run = (
                f"manual optimization across {trainer.world_size} processes: the trials run a manual-optimization "
                "training_step in one process only (their DDP guards need to hold the optimizer step)"
            )
        if self.not_run is not None:
            self._warn_not_run()
            return
        self._run_trials(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._probe is not None:
            self._steps.batch_started(trainer)
            self._probe.batch_started()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._probe is None:
            return
        if self._probe.batch_ended(self._steps.batch_ended(trainer)):
            self._finish_holds(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probe is not None:
            self._finish_holds(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.exception = exception
        self._join_report()
        if isinstance(exception, (SIGTERMException, KeyboardInterrupt)):  # its workers died with the process group:
            with contextlib.suppress(Exception):  # the fit's teardown then meets no "worker killed" error
                compat.quiet_dead_workers()
        if self._probe is not None:
            self._probe.close()
        self._probe = None
        self._stop_watch()
        self._undo_all()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._probe is not None:
            self._finish_holds(trainer)
        self._stop_watch()
        self._undo_all()
        self._join_report()  # the report, written beside the fit, is whole once the fit ends
        self._state = None
        if stage == "fit" and self.trials and self.result is None and self.not_run is None and trainer.num_training_batches == 0:
            self.not_run = (
                "the fit has no training batches (limit_train_batches is 0)"
                if trainer.limit_train_batches == 0
                else "the train loader yields no batches: its dataset is smaller than one batch with drop_last=True, or empty"
            )
            self._warn_not_run()

    def _say(self, line: str) -> None:
        """A progress line, from rank 0 only (every rank runs the same trials and fit)."""
        if self._rank_zero:
            self.on_event(line)

    def _warn_not_run(self) -> None:
        rank_zero_warn(f"speedkit: {self.not_run}; SpeedLadder() applies no rungs.", category=UserWarning)

    # -- state -----------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """The decisions: the rungs in effect (``kept``, in the ladder's order), and what they changed
        and why others were skipped (for the report)."""
        return {
            "rungs": [r.name for r in self.rungs],
            "trials": self.trials,
            "kept": self._decisions(),
            "applied": dict(self.applied_changes),
            "skipped": dict(self.skipped),
        }

    def _decisions(self) -> list[str] | None:
        """The rungs this fit runs with, in the ladder's order: the trials' kept ones, else those applied
        (given or resumed); None before anything was decided."""
        if self.result is not None:
            return [r.name for r in self.result.kept]
        if self.trials:
            return None
        applied = set(self.applied)
        return [r.name for r in self.rungs if r.name in applied]

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed fit re-applies the checkpoint's decisions without trials: the kept rungs (those
        that act on the model now, before the strategy wraps it, the others at their stage), on every
        rank alike. A checkpoint of a fit without decisions (an older one) leaves the trials on."""
        self.skipped = dict(state_dict.get("skipped", {}))
        self.applied_changes = dict(state_dict.get("applied", {}))
        kept = state_dict.get("kept")
        if not self.trials or kept is None:
            return
        by_name = {r.name: r for r in self.rungs}
        rungs, unknown = [], []
        for name in kept:
            if name in by_name:
                rungs.append(by_name[name])
            elif name in rung_registry.names():
                rungs.append(rung_registry.make(name))
            else:
                unknown.append(name)
        if unknown:
            rank_zero_warn(
                f"speedkit: the checkpoint's kept rungs {unknown} are not known here; the others are re-applied",
                category=UserWarning,
            )
        self.rungs, self.trials, self.resumed = rungs, False, [r.name for r in rungs]
        self._say(f"resumed: re-applying the checkpoint's decisions without trials: {', '.join(self.resumed) or 'none kept'}")
        if self._fit is None:
            return
        trainer, pl_module = self._fit
        step = fit_step(trainer, pl_module)
        self._state = TrainState(model=pl_module, optimizer=None, device=step.device, step=step)
        self._apply_stage("setup")

    # -- trials ----------------------------------------------------------------------------
    def _run_trials(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = fit_step(trainer, pl_module)
        source = LightningSource(trainer, pl_module)
        state = TrainState(model=pl_module, optimizer=step.optimizer, device=step.device, step=step, data=source)
        run_info = {
            "precision": str(trainer.precision),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "gradient_clip_val": trainer.gradient_clip_val,
            "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "optimization": "automatic" if pl_module.automatic_optimization else "manual",
            "optimizer": ", ".join(type(o).__name__ for o in step.all_optimizers()) or None,
            "lr_schedulers": [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs],
        }
        self._state = state
        trace_dir = self.trace_dir or (self.report_dir / "traces" if self.report_dir is not None else None)
        self._ladder = Ladder(
            state,
            self.rungs,
            self.measure,
            on_event=self._say,  # across several processes every rank climbs in step; rank 0 speaks
            run_info=run_info,
            planned_steps=self.planned_steps if self.planned_steps is not None else _planned_steps(trainer),
            trace_dir=trace_dir if trainer.is_global_zero else None,
            on_progress=self.on_progress if trainer.is_global_zero else None,
            cache=None if self.cache is False else DecisionCache(None if self.cache is True else self.cache),
            short_fit=self.short_fit,
        )
        try:
            self.result = self._ladder.run()
        except TrialsNotRun as exc:  # the fit goes on as the user set it up, nothing applied
            self.result, self.not_run, self._state = None, str(exc), None
            self._warn_not_run()
            return
        except TrialsStopped as stopped:  # a signal or a dead loader: everything is undone and restored
            self.result = self._ladder.result
            self._trials_stopped(trainer, stopped)
            return
        finally:
            if self.not_run is None:
                self.result = self._ladder.result
        self.handles = list(self._ladder.handles)
        # the trials decided every rung again: a record loaded from a resumed checkpoint is not this fit's
        self.applied_changes, self.skipped = {}, {}
        for entry in (r for r in self.result.rungs if r.status != "baseline"):
            if entry.status == "kept":
                self.applied_changes[entry.name] = list(entry.changes)
            elif entry.status in ("not_applicable", "skipped", "failed"):
                self.skipped[entry.name] = entry.reason or entry.status
        self._bind_fit(trainer, pl_module, state, step, source)  # after: its lines add to the kept rungs' changes
        # the fit starts the kept rungs afresh (a graph warms up and captures again in its first steps)
        settle = max((h.settle_steps for h in self.handles), default=0)
        self._probe = _HoldsProbe(
            self.measure, self.result, step.device, warmup=max(self.measure.warmup, settle), trainer=trainer
        )
        self._steps = OptimizerSteps()
        from speedkit.report.markdown import trials_time

        kept = ", ".join(r.name for r in self.result.kept) or "none"
        self._say(f"trials done{trials_time(self.result.run)}: kept {kept}; training with them from the restored initial state")

    def _trials_stopped(self, trainer: pl.Trainer, stopped: TrialsStopped) -> None:
        """The trials stopped (undone, the model and optimizer restored): the partial report is written,
        one line says why, and the fit ends as that signal ends it without speedkit (SIGTERM: Lightning's
        ``SIGTERMException``; SIGINT: ``KeyboardInterrupt``). After the requeue signal, its own handler
        (Lightning's checkpoint) runs now, on the restored model, and the fit runs as the user set it up,
        as it does after a loader that died in the trials."""
        ladder = self._ladder
        assert ladder is not None
        self.not_run, self._state, self.handles = f"the trials were stopped: {stopped.why}", None, []
        result = self.result
        phase = (result.interrupted or "").split(" during ", 1)[-1] if result is not None else "the trials"
        written = self._write_report() if result is not None else None
        by = stopped.signal_name or "a data loader that died"
        ends = {"SIGTERM": "the fit ends as on SIGTERM", "SIGINT": "the fit ends as on Ctrl-C"}.get(
            stopped.signal_name or "", "the fit goes on as set up"
        )
        rank_zero_warn(
            f"speedkit: the trials were stopped by {by} during {phase}; nothing of them is kept (the model and "
            f"optimizer are as before them){f', partial report in {written}' if written else ''}; {ends}.",
            category=UserWarning,
        )
        if stopped.signal_name == "SIGTERM":
            raise SIGTERMException() from None
        if stopped.signal_name == "SIGINT":
            raise KeyboardInterrupt from None
        ladder.stop.run_deferred()

    def _write_report_beside_the_fit(self) -> None:
        """The report written by a process of its own while the fit trains on (:class:`ReportProcess`):
        written inside the step where the fit check ended, it stopped the fit 1.4-3.6 s on an H200 (0.3 s
        on a CPU, most of it matplotlib), in the window anyone timing their fit reads; on a thread it held
        Python's lock and slowed 12 ms CPU steps to 130-270 ms. Waited for at the fit's teardown (or its
        exception), so the report is whole when ``fit`` returns."""
        if self.report_dir is None or self.result is None or not self._rank_zero:
            return
        self._join_report()
        from speedkit.report.beside import ReportProcess

        try:
            self._report_process = ReportProcess(self.result, self.report_dir)
        except Exception:  # no process could be started: written here, as before
            self._write_report()

    def _join_report(self) -> None:
        """Wait for the report written beside the fit; its failure is a warning, never the fit's."""
        process, self._report_process = self._report_process, None
        if process is None:
            return
        failed = process.wait()
        if failed is not None:
            rank_zero_warn(
                f"speedkit: the report could not be written ({failed}); its results are in SpeedLadder.result",
                category=UserWarning,
            )

    def _write_report(self) -> Path | None:
        """The report of ``self.result`` in ``report_dir`` (rank 0; None where there is no folder or it
        failed: a warning, never the fit's failure)."""
        if self.report_dir is None or self.result is None or not self._rank_zero:
            return None
        from speedkit.errors import OutputError
        from speedkit.report import write_report

        try:
            write_report(self.result, self.report_dir)
        except OutputError as exc:  # the user's fit goes on; the results stay in ladder.result
            rank_zero_warn(
                f"speedkit: {exc}; the report was not written (nothing half-written is left), "
                "its results are in SpeedLadder.result",
                category=UserWarning,
            )
            return None
        except Exception as exc:  # a report that cannot be rendered never stops the user's fit
            rank_zero_warn(
                f"speedkit: the report could not be written ({type(exc).__name__}: {exc}); its results are in SpeedLadder.result",
                category=UserWarning,
            )
            return None
        return Path(self.report_dir)

    def _bind_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: TrainState, step: Any, source: Any) -> None:
        """Kept rungs that wrap the step or the batch source changed what the trials ran; Lightning's
        own loop runs the fit, so each wrapper binds itself into it (a graphed step, a prefetching
        loader). A binding that fails leaves the fit as Lightning runs it, and says why."""
        # the batch source first: a step that regroups the fit's batches (micro_batch) wraps the loader it serves
        for wrapper, original, what in ((state.data, source, "batch source"), (state.step, step, "step")):
            if wrapper is original or wrapper is None:
                continue
            try:
                handle = (
                    bind_source(wrapper, trainer, pl_module) if what == "batch source" else wrapper.bind_fit(trainer, pl_module)
                )
            except Exception as exc:  # the fit goes on as Lightning runs it
                line = (
                    f"the kept {what} wrapper {type(wrapper).__name__} could not bind into the fit: {type(exc).__name__}: {exc}"
                )
                self.skipped[f"bind_{what.replace(' ', '_')}"] = line
                rank_zero_warn(f"speedkit: {line}", category=UserWarning)
                continue
            if handle is not None:
                self.handles.append(handle)
                self.applied_changes.setdefault(handle.rung, []).extend(handle.changes)
                self._bound.append((handle, len(handle.changes)))
                for change in handle.changes:
                    self._say(change if change.startswith("fit: ") else f"fit: {change}")

    def _finish_holds(self, trainer: pl.Trainer) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()
        if probe is None or self.result is None:
            return
        self.result.holds = probe.judge()
        profiler = next((c for c in trainer.callbacks if type(c).__name__ == "SpeedProfiler"), None)
        if profiler is not None and getattr(profiler, "monitor", None) is not None:  # the fit so far, by its own clock
            self.result.fit_monitor = {
                **profiler.monitor.summary(),
                "note": f"the fit's first {trainer.global_step} optimizer steps (SpeedProfiler), when this report was written",
            }
        holds = self.result.holds
        back = self._back_to_the_floor(holds)  # on every rank alike: each timed the same windows
        if not trainer.is_global_zero:  # every rank timed the fit's steps together; rank 0 reports them
            if self.stop_after_holds:
                trainer.should_stop = True
            return
        if holds.gap is not None:
            verdict = f"flagged: {holds.cause}" if holds.flagged else "holds"
            self._say(
                f"the fit's own steps: {holds.fit.step_ms:.2f} ms/step against the ladder's "  # type: ignore[union-attr]
                f"{holds.ladder.step_ms:.2f} ({holds.gap:+.1%}): {verdict}" + (f" ({holds.note})" if holds.note else "")  # type: ignore[union-attr]
            )
        if back is not None:
            self._say(back)
        self._write_report_beside_the_fit()
        if self.stop_after_holds:
            trainer.should_stop = True

    def _back_to_the_floor(self, holds: Any) -> str | None:
        """Where the fit's own steps ran slower than the floor did in the trials (the user's switches'
        figure, beyond the threshold of the fit check and three times the measured noise), the rungs on top
        of the floor are undone inside the fit, through their handles (the weights and the optimizer state
        stay as they are: training goes on from them), the decision recorded and said. Returns the line
        to say (None: the final configuration stays)."""
        result = self.result
        if result is None or holds is None or holds.fit is None or not result.floor:
            return None
        figures = result.figures()
        links = figures["links"]
        floor_link = links[0] if links and links[0]["floor"] else None
        on_top = [n for link in links[1:] for n in link["names"]] if floor_link is not None else []
        floor_ms = floor_link["step_ms"] if floor_link is not None else None
        if not on_top or not floor_ms:
            return None
        spreads = [
            x for x in (holds.fit.spread, (figures["baseline"] or {}).get("spread")) if isinstance(x, float) and math.isfinite(x)
        ]
        threshold = max(self.measure.holds_threshold, 3 * max(spreads, default=0.0))
        gap = holds.fit.step_ms / floor_ms - 1
        result.run["fit_check_vs_floor"] = {
            "floor_step_ms": floor_ms,
            "fit_step_ms": holds.fit.step_ms,
            "gap": gap,
            "threshold": threshold,
        }
        if gap <= threshold:
            return None
        undone, failed = [], []
        for handle in reversed(list(self.handles)):
            if handle.rung not in on_top:
                continue
            try:
                handle.undo()
                undone.append(handle.rung)
            except Exception as exc:  # keep undoing the rest; the fit goes on
                failed.append(f"{handle.rung}: {type(exc).__name__}: {exc}")
            self.handles.remove(handle)
        why = (
            f"the fit's own steps ran {holds.fit.step_ms:.2f} ms against the floor's {floor_ms:.2f} in the trials "
            f"({gap:+.1%}, beyond {threshold:.1%})"
        )
        result.decide("the fit check", on_top, False, [], why)
        for row in result.rungs:
            if row.name in on_top and row.status == "kept":
                row.status = "reverted"
                row.reason = f"{row.reason}; reverted in the fit: {why}"
        result.final_order = [n for n in result.final_order if n not in on_top]
        # the final check timed the configuration left: the floor's own comparison with the baseline is the
        # final configuration's now (the headline is the final check's where there is one)
        floor_check = next(
            (r.comparison for r in result.rungs if r.name in result.floor and r.status == "kept" and r.comparison is not None),
            None,
        )
        result.final_check = (
            dataclasses.replace(floor_check, measured_in="the floor's comparison with the baseline (the fit went back to it)")
            if floor_check is not None and floor_check.b is not None
            else None
        )
        result.run["fit_check_vs_floor"].update(back_to_the_floor=True, undone=sorted(set(undone)), failed=failed)
        ladder = self._ladder  # the decision the trials cached did not hold in the fit: forgotten, a later fit climbs
        if ladder is not None and ladder.cache is not None and ladder.cache_key is not None and self._rank_zero:
            with contextlib.suppress(OSError):
                ladder.cache.forget(ladder.cache_key)
                result.run["fit_check_vs_floor"]["cache"] = "the decision the trials kept is forgotten"
        return (
            f"back to the floor: {why}; {', '.join(on_top)} undone inside the fit, training goes on from the same state "
            f"with {', '.join(result.final_order)}" + (f" (undo failed: {'; '.join(failed)})" if failed else "")
        )

    # -- given rungs, no trials ------------------------------------------------------------------
    def _apply_stage(self, stage: str) -> None:
        state = self._state
        assert state is not None
        sharded = self._fit is not None and sharding(self._fit[0].strategy) is not None
        for rung in self.rungs:
            # under a sharding strategy the model is sharded after setup (configure_model): a rung that
            # must see the sharded modules (compile, block by block) applies as the fit starts
            if ((sharded and rung.lightning_stage_sharded) or rung.lightning_stage) != stage:
                continue
            reason = rung.check(state)
            if reason is not None:
                self._skip(rung, reason)
                continue
            try:
                handle = rung.apply(state)
            except Exception as exc:  # a rung that fails to apply is reported and skipped; training goes on
                self._skip(rung, f"failed to apply: {type(exc).__name__}: {exc}")
                continue
            self.handles.append(handle)
            self.applied_changes[rung.name] = list(handle.changes)

    # -- rungs that need the train loader (data_path) ----------------------------------------------
    def _watch_first_iterator(self, trainer: pl.Trainer) -> None:
        """Lightning makes the first epoch's train iterator before on_train_start; a rung that serves
        the fit from another loader makes it again from the RNG and generator states recorded here."""
        if any(r.lightning_stage == "train_start" for r in self.rungs):
            self._stop_watch()
            self._unwatch = watch_fit_iterator_start(trainer)

    def _stop_watch(self) -> None:
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()

    def _apply_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Given rungs, no trials: those that need the train loader apply once it exists, then every
        step and source wrapper the rungs made binds into the fit."""
        state = self._state
        if state is None:
            return
        source = None
        if any(r.lightning_stage == "train_start" for r in self.rungs):
            source = state.data = LightningSource(trainer, pl_module)
            self._apply_stage("train_start")
        # every wrapper binds here, once the train loader exists (a step that merges micro-batches
        # serves the loader's batches; a graphed step's binding needs nothing earlier)
        base = state.step
        while isinstance(base, StepWrapper):
            base = base.inner
        self._bind_fit(trainer, pl_module, state, base, source)

    def _skip(self, rung: Rung, reason: str) -> None:
        self.skipped[rung.name] = reason
        rank_zero_warn(f"speedkit: rung {rung.name!r} not applied: {reason}", category=UserWarning)

    def _undo_all(self) -> None:
        bound, self._bound = self._bound, []
        for handle, reported in bound:  # what a binding did during the fit (e.g. a reloaded loader served)
            for change in handle.changes[reported:]:
                self.applied_changes.setdefault(handle.rung, []).append(change)
                self._say(change)
        errors = []
        for handle in self.handles:
            try:
                lines = [line for line in handle.report() if line]
                counts = handle.counts()
            except Exception as exc:  # noqa: BLE001 - a report is not worth a failed teardown
                lines, counts = [f"its report raised {type(exc).__name__}: {exc}"], {}
            if counts:
                self.fit_counts[handle.rung] = dict(counts)
            if lines:
                self.fit_reports.setdefault(handle.rung, []).extend(lines)
                for line in lines:
                    self._say(f"fit: {handle.rung}: {line}")
        while self.handles:
            try:
                self.handles.pop().undo()
            except Exception as exc:  # keep undoing the rest
                errors.append(exc)
        if self._ladder is not None:
            self._ladder.stack.slots = []
        # what the trials made (sources, prefetchers, sessions: CUDA events among them) is let go of
        # here and freed in this process, not by a DataLoader worker forked later (fork_safety)
        self._ladder = None
        if torch.cuda.is_initialized():
            collect_garbage()
        if errors:
            raise errors[0]


class _HoldsProbe:
    """Times the fit's own optimizer steps after the trials, on the same clock as the ladder.

    A window in which ``torch.compile`` compiled (the fit met inputs its guards had not seen in the
    trials: another range of a dynamic size, a value it specialized on) times the compilation, not
    the step: it is left out and another window timed in its place, up to ``left_out_at_most`` such
    windows. Where every window compiled, those windows are the figure and the compilation its cause.
    """

    host_clock: Callable[[], float] = staticmethod(time.perf_counter)  # tests put a fake clock here

    def __init__(self, cfg: MeasureConfig, result: LadderResult, device: torch.device, warmup: int, trainer: pl.Trainer) -> None:
        base = result.baseline.measurement
        self.cfg, self.result, self.warmup = cfg, result, warmup
        self.session = MeasureSession(
            device,
            flops_per_step=result.flops.get("per_step"),
            peak_tflops=result.flops.get("peak_tflops"),
            items_per_step=base.items_per_step if base else 1,
            unit=base.throughput_unit if base else "samples/s",
            host_clock=self.host_clock,
            across_ranks=True,  # under DDP: the slowest rank's windows, as the ladder's were
        )
        self.windows: list[Window] = []
        self.compiling: list[Window] = []  # windows left out: they compiled
        self.between: dict[int, dict[str, float]] = {}  # id(window): seconds of Lightning's actions between its steps
        self.session.begin_steps(cfg.steps, warmup=warmup)
        # Lightning's per-batch actions between the fit's steps are timed through its profiler, wrapped
        self.trainer, self.hooks = trainer, HookTimer(trainer.profiler, clock=self.host_clock)
        trainer.profiler = self.hooks

    def close(self) -> None:
        """Give the Trainer its own profiler back."""
        if self.trainer.profiler is self.hooks:
            self.trainer.profiler = self.hooks.inner

    def batch_started(self) -> None:
        self.session.batch_started()
        self.hooks.step_started()

    def batch_ended(self, step_done: bool) -> bool:
        """True once enough windows are timed (or enough left out for compiling)."""
        window = self.session.batch_ended(step_done)
        if window is not None:
            self.between[id(window)] = self.hooks.take()
        elif step_done and self.session.steps_seen == self.warmup:  # the first window opens: start afresh
            self.hooks.take()
        self.hooks.step_ended()
        if window is not None:
            (self.compiling if window.compiled_graphs else self.windows).append(window)
        return len(self.windows) >= self.cfg.holds_windows or len(self.compiling) >= left_out_at_most(self.cfg.holds_windows)

    def between_ms(self, windows: list[Window]) -> dict[str, float]:
        """ms per step of each of Lightning's actions between the steps of ``windows``, largest first."""
        steps = sum(w.steps for w in windows)
        total: dict[str, float] = {}
        for w in windows:
            for action, seconds in self.between.get(id(w), {}).items():
                total[action] = total.get(action, 0.0) + seconds
        per_step = {a: s * 1e3 / steps for a, s in sorted(total.items(), key=lambda kv: -kv[1])} if steps else {}
        return {a: ms for a, ms in per_step.items() if ms >= 0.005}  # hooks that do nothing are left out

    def judge(self) -> Any:
        cfg = self.cfg
        ladder = self.result.final_measurement
        if cfg.holds_windows == 0:
            return judge_holds(ladder, None, cfg.holds_threshold, "not measured (measure.holds_windows is 0)")
        windows, compiled = self.windows, None
        if not windows and not self.compiling:
            needed = self.warmup + cfg.steps
            untimed = "measure.warmup" if self.warmup == cfg.warmup else "the kept rungs' warm-up"
            return judge_holds(
                ladder,
                None,
                cfg.holds_threshold,
                f"not measured: the fit ran {self.session.steps_seen} optimizer steps after the trials; timing "
                f"one window needs {needed} ({untimed} + measure.steps)",
            )
        notes = []
        if len(self.windows) < cfg.holds_windows and len(self.compiling) < left_out_at_most(cfg.holds_windows):
            notes.append(
                f"{len(self.windows)} of {cfg.holds_windows} windows{' without compiling' if self.compiling else ''} "
                "(the fit ended)"
            )
        if self.compiling:
            graphs = sum(w.compiled_graphs for w in self.compiling)
            what = (
                f"torch.compile compiled {graphs} new graph{'s' if graphs > 1 else ''} in {len(self.compiling)} of the fit's "
                f"timed windows: the fit met inputs its guards had not seen in the trials (TORCH_LOGS=recompiles names "
                f"the guard)"
            )
            if windows:
                notes.insert(0, f"{what}; those windows are left out, as a compilation is paid once per new guard, not per step")
            elif notes:  # the fit ended
                windows, compiled = self.compiling, what
            else:
                windows, compiled = self.compiling, f"{what}, in every window timed: it compiles again as the inputs change"
        return judge_holds(
            ladder,
            self.session.measurement(windows, warmup=self.warmup),
            cfg.holds_threshold,
            "; ".join(notes) or None,
            compiled,
            shapes_vary="batch_shapes" in self.result.run,
            between_ms=self.between_ms(windows),
        )


def _planned_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps the fit plans (None where Lightning cannot tell: an endless fit, an
    iterable loader of unknown length)."""
    try:
        steps = trainer.estimated_stepping_batches
    except Exception:  # a loader without a length, or a Trainer not yet able to tell
        return None
    return int(steps) if isinstance(steps, (int, float)) and math.isfinite(steps) and steps > 0 else None
