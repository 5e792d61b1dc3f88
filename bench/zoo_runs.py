"""The zoo fitted again and again, one process per run: does SpeedLadder() decide the same way every
run, within its budget, and beat the user's own switches? (issue 56)

For each zoo model, ``--runs`` runs (default 3), each a fresh process (this script with ``--worker``),
which fits, one after the other, on one GPU:

  switches  (the first ``--switches-runs`` runs of the call, default 1) the user's own switches, as the
            user turns them on: Trainer(precision="bf16-mixed"), TF32 matmuls
            (``set_float32_matmul_precision("high")``, ``allow_tf32``), ``torch.compile`` of the library
            model (``self.model``; the LightningModule where there is none) and the library's own
            attention switch (Hugging Face ``attn_implementation="sdpa"``), nothing else (no channels_last)
  speedkit  ``SpeedLadder()`` with its defaults in the fp32 Trainer; with ``--cache on|off``
            ``cache=True|False`` where SpeedLadder takes a ``cache`` argument (read from its signature)

Each variant is timed on the fit's own optimizer steps by wall clock (``time.perf_counter``, with
``torch.cuda.synchronize`` at the window's two ends): ``--steps`` steps (default 50), ``--warmup``
steps (default 10) after the fit is ready for it, which for speedkit is once the trials are done, the
fit's own steps the ladder times after them are timed and its report, if it writes one, is written
(all three in SpeedLadder's ``on_train_batch_end``, which runs before the timer's). The fit stops there.

Rows (bench "zoo_runs"), one per variant and run: ``model``, ``run``, ``variant``, metric
"throughput" (tokens/s or samples/s: the window's items over its wall time), ``kept`` (speedkit: the
result's kept rungs), ``trials_s``, ``cached``, ``commit``, ``date``, ``device``, ``lane``, the window
(``steps``, ``elapsed_s``, ``step_ms``, the host's per-step ``step_ms_median`` and ``step_ms_spread``,
``graphs_compiled`` in it); a variant that fails, or is stopped by the time guard before its window
ends, metric "status". Speedkit's report is kept as ``<out>/reports/<model>_run<k>.json``.

Lanes (``--lanes N``): N models at a time, one per GPU (``CUDA_VISIBLE_DEVICES``), each with an equal,
contiguous share of the host's cores (the process's CPU affinity, as bench/zoo_lanes.py splits it); a
lane runs its model's runs one after the other. Rows are appended to ``--results`` (default
``bench/results/<date>_<gpu>.jsonl``) and, with the logs, reports and the summary table, kept under
``--out`` (default ``$OUT``): ``zoo_runs.jsonl``, ``zoo_runs.txt`` and ``zoo_runs_logs.tgz`` (logs and
reports; in the device's ``$OUT``, which brings back a few files only, in that file alone).

With ``ZOO_RUNS_WITHOUT=a,b`` in the environment speedkit's variant runs the default ladder less those
rungs (a diagnostic: which trial leaves something behind); with ``ZOO_RUNS_NO_PROFILE=1`` its ladder
profiles nothing after the decisions (``measure={"profile": False}``); with ``ZOO_RUNS_PROFILE_FIT=1``
torch.profiler records each variant's timed window (:class:`WindowProfile`).

With ``ZOO_RUNS_STACKS=1`` in the environment each fit's main thread is sampled (bench/stack_sampler.py):
where its wall time went, by the ladder's phase, in ``logs/<model>_run<k>_<variant>_stacks.txt`` (and
``.collapsed``), with Dynamo's compile times.

A whole zoo takes longer than one device call: ``--detach`` starts the run in a session of its own
(it outlives the call) and returns; ``--collect SECONDS`` in a later call waits for its ``done`` and
packs ``--out`` into ``$OUT/zoo_runs.tgz``. Keep each call well inside the device's per-call limit
(``--collect 500`` in a 600 s call): twice on 2026-11-29 a call that ended within a second of its limit
came back with its files, but the next call found a fresh machine, the detached run gone with the old one.
The detached run works from a copy of the tree (``<out>/tree``, left out of the packed files): each
device call lays the working tree down afresh, which took a run's working directory away on 2026-12-07.

Usage: PYTHONPATH=. python bench/zoo_runs.py --commit C --lanes 2 [--models a,b] [--runs 3]
       PYTHONPATH=. python bench/zoo_runs.py --commit C --lanes 2 --cache fresh --cached-runs 1   # runs 1-3 climb, run 4 re-checks
       PYTHONPATH=. python bench/zoo_runs.py --commit C --lanes 2 --out /tmp/zr --detach; ... --out /tmp/zr --collect 540
       PYTHONPATH=. python bench/zoo_runs.py --tiny --models nanogpt --runs 2   # CPU smoke test, rows to a temporary folder
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import RESULTS, Results, commit, gpu_slug  # noqa: E402
from bench.zoo import TINY_MEASURE as ZOO_TINY_MEASURE  # noqa: E402
from bench.zoo import Deadline, compile_as_a_user_would, first_line, release, tf32_matmuls  # noqa: E402
from bench.zoo_lanes import core_blocks, detach, span, without_tree  # noqa: E402
from speedkit import compat, config  # noqa: E402
from speedkit.data.batch import count_items  # noqa: E402
from speedkit.demos.zoo import ZOO  # noqa: E402
from speedkit.lightning import SpeedLadder  # noqa: E402

BENCH = "zoo_runs"
#: SpeedLadder's measure settings for the CPU smoke test: bench/zoo.py's --tiny ones, without the profile
TINY_MEASURE = {**ZOO_TINY_MEASURE, "profile": False}


# -- the timer ---------------------------------------------------------------------------------------


class WindowProfile(pl.Callback):
    """A diagnostic (``ZOO_RUNS_PROFILE_FIT=1``): torch.profiler over the timer's window (its figures then
    include the profiler's cost, alike for every variant), the host's and the device's op tables written to
    ``path``: where the fit's own steps spend their time, to set beside another variant's."""

    def __init__(self, timer: WallClockWindow, path: Path) -> None:
        self.timer, self.path, self.profiler, self.done = timer, path, None, False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.done or self.timer.start is None:
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.environ.setdefault("TEARDOWN_CUPTI", "1")  # nothing of it left for a later variant
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            return
        if self.timer.elapsed is None:
            return
        self.profiler.stop()
        self.done = True
        steps = self.timer.steps
        table = self.profiler.key_averages()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as f:
            f.write(f"torch.profiler over the window's {steps} steps (totals; divide by {steps} for a step)\n\n")
            f.write(
                "== by host time\n" + table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n"
            )
            if torch.cuda.is_available():
                f.write(
                    "== by device time\n"
                    + table.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
                    + "\n"
                )


class WallClockWindow(pl.Callback):
    """Times ``steps`` optimizer steps of a fit by wall clock, ``warmup`` steps after the fit is ready
    for it, then stops the fit.

    Ready: at the train start without a ladder; with one, once its trials are done and the fit's
    steps it times after them are timed, which is when its report (if any) is written: its
    ``result.holds`` is set then, in its ``on_train_batch_end``, which runs before this one's when the
    ladder comes first among the Trainer's callbacks. A ladder whose trials did not run (``not_run``)
    leaves the fit ready at once.

    The window's two ends wait for the device (``torch.cuda.synchronize``); in between, each optimizer
    step's end is read from the host clock without waiting (``step_ends``), which on a GPU is the
    host's pace: on a step the device sets, it runs ahead by the queue's depth, no more.

    Args:
        steps: optimizer steps timed.
        warmup: optimizer steps after the fit is ready and before the window opens.
        unit: "tokens", "samples" or "auto", as :func:`speedkit.data.count_items` counts a batch's items.
        ladder: the fit's SpeedLadder, if any.
        clock: seconds (tests give a fake one).
    """

    def __init__(
        self, steps: int, warmup: int, unit: str, ladder: Any = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if steps < 1 or warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, found steps={steps}, warmup={warmup}")
        self.steps, self.warmup, self.unit, self.ladder, self.clock = steps, warmup, unit, ladder, clock
        self.ready_step: int | None = None  # the Trainer's global_step when the fit was ready
        self.first_step: int | None = None  # ... when the window opened
        self.start: float | None = None
        self.elapsed: float | None = None  # seconds from the window's start to its last step's end
        self.step_ends: list[float] = []  # host clock at each timed optimizer step's end
        self.items, self.throughput_unit = 0, "samples/s"
        self.graphs_at_start = 0
        self.graphs_compiled: int | None = None  # graphs Dynamo compiled inside the window
        self._last_step = 0

    def _ready(self) -> bool:
        ladder = self.ladder
        if ladder is None:
            return True
        if ladder.result is None:
            return ladder.not_run is not None
        return ladder.result.holds is not None

    def _sync(self, pl_module: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._ready():
            self.ready_step = trainer.global_step
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        stepped, self._last_step = step != self._last_step, step
        if self.elapsed is not None:
            return
        if self.start is not None:  # inside the window
            items, self.throughput_unit = count_items(batch, self.unit)
            self.items += items
            if stepped:
                self.step_ends.append(self.clock())
            if step - self.first_step >= self.steps:
                self._sync(pl_module)
                self.elapsed = self.clock() - self.start
                self.graphs_compiled = compat.graph_count() - self.graphs_at_start
                trainer.should_stop = True
            return
        if self.ready_step is None and self._ready():
            self.ready_step = step
        if self.ready_step is not None and step - self.ready_step >= self.warmup:
            self._sync(pl_module)
            self.start, self.first_step = self.clock(), step
            self.graphs_at_start = compat.graph_count()

    def figures(self) -> dict[str, Any] | None:
        """The window's figures for a row (None: it did not end)."""
        if self.elapsed is None or self.start is None:
            return None
        per_step = [(b - a) * 1e3 for a, b in zip([self.start, *self.step_ends], self.step_ends)]
        median = statistics.median(per_step)
        q = statistics.quantiles(per_step, n=4) if len(per_step) >= 2 else [median, median, median]
        return {
            "value": self.items / self.elapsed,
            "unit": self.throughput_unit,
            "steps": self.steps,
            "first_step": self.first_step,
            "elapsed_s": round(self.elapsed, 4),
            "step_ms": self.elapsed * 1e3 / self.steps,
            "step_ms_median": median,
            "step_ms_spread": (q[2] - q[0]) / median if median > 0 else None,
            "graphs_compiled": self.graphs_compiled,
        }


# -- one run (the worker) ----------------------------------------------------------------------------


def tiny_ladder() -> list[Any]:
    """The default ladder for the CPU smoke tests: compile by Dynamo alone (no C++ code generated)."""
    return [{"name": "compile", "options": {"backend": "eager"}} if r == "compile" else r for r in config.default_ladder()]


def cache_kwargs(cache: str | None, ladder_class: Any = None, folder: Path | None = None) -> dict[str, Any]:
    """``{"cache": True|False}`` for SpeedLadder where it takes ``cache`` (read from its signature), or with
    ``folder`` (``on`` and ``fresh``) ``{"cache": folder}``: the model's own decisions' folder; ``{}``
    without ``--cache`` or where it takes none and the cache is to be off (there is none then).

    Raises:
        SystemExit: ``--cache on`` where SpeedLadder takes no ``cache`` argument (the row would say
            cached of a run that was not).
    """
    ladder_class = SpeedLadder if ladder_class is None else ladder_class
    if cache is None:
        return {}
    if "cache" in inspect.signature(ladder_class.__init__).parameters:
        if cache == "off":
            return {"cache": False}
        return {"cache": str(folder) if folder is not None else True}
    if cache in ("on", "fresh"):
        raise SystemExit(
            f"--cache {cache}: SpeedLadder takes no cache argument at this commit; run without --cache, or --cache off"
        )
    return {}


@dataclass
class Fit:
    """One variant's fit, as the worker made it."""

    variant: str
    timer: WallClockWindow
    steps_taken: int
    wall_s: float
    fields: dict[str, Any] = field(default_factory=dict)


def fit_variant(name: str, variant: str, args: argparse.Namespace) -> Fit:
    """Fit zoo model ``name`` as ``variant`` ("switches" or "speedkit") until its window is timed, its
    time guard passes, or ``--max-steps``."""
    entry = ZOO[name]
    size = "tiny" if args.tiny else "full"
    ladder = None
    folder = Path(args.out) / "cache" / name if args.out and args.cache in ("on", "fresh") else None
    if folder is not None and args.cache == "fresh" and variant == "speedkit":  # nothing read: it climbs, then keeps its decision
        shutil.rmtree(folder, ignore_errors=True)
    if variant == "speedkit":
        began = time.monotonic()
        on_event = lambda line: print(  # noqa: E731  # seconds since the fit began, of them compiling
            f"  [{name} run {args.run} {time.monotonic() - began:6.1f}s c{compat.compile_seconds():5.1f}] {line}", flush=True
        )
        if args.tiny:
            ladder = SpeedLadder(
                tiny_ladder(), trials=True, measure=TINY_MEASURE, on_event=on_event, **cache_kwargs(args.cache, folder=folder)
            )
        else:  # diagnostics: the default ladder less some rungs; no profile phase
            without = set(filter(None, os.environ.get("ZOO_RUNS_WITHOUT", "").split(",")))
            rungs = [r for r in config.default_ladder() if r not in without] if without else None
            measure = {"profile": False} if os.environ.get("ZOO_RUNS_NO_PROFILE") else None
            ladder = SpeedLadder(
                rungs, trials=True, measure=measure, on_event=on_event, **cache_kwargs(args.cache, folder=folder)
            )
    timer = WallClockWindow(args.steps, args.warmup, entry.unit, ladder)
    window_profile = (
        [WindowProfile(timer, Path(args.out) / "logs" / f"{name}_run{args.run}_{variant}_window_profile.txt")]
        if os.environ.get("ZOO_RUNS_PROFILE_FIT") and args.out
        else []
    )
    module, loader = entry.build(size, **(entry.switches if variant == "switches" else {}))
    trainer = pl.Trainer(
        accelerator="cpu" if args.tiny else "gpu",
        devices=1,
        precision="bf16-mixed" if variant == "switches" else "32-true",
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
        # the ladder first: its on_train_batch_end (the fit's steps it times, its report) runs before the timer's
        callbacks=[*([ladder] if ladder else []), timer, *window_profile, Deadline(args.time_guard_s)],
    )
    sampler = None
    if os.environ.get("ZOO_RUNS_STACKS"):  # where the wall time goes, by phase: <out>/logs/<model>_run<k>_<variant>_stacks.txt
        from bench.stack_sampler import StackSampler

        def phase() -> str:
            if timer.start is not None:
                return "fit: the timed window" if timer.elapsed is None else "fit: after the timed window"
            if ladder is None:
                return "fit: before the timed window"
            engine = getattr(ladder, "_ladder", None)
            if ladder.result is not None:
                return "fit: after the trials, before the timed window"
            return f"{engine.phase} (trials)" if engine is not None else "setup"

        sampler = StackSampler(label=phase).start()
    t0 = time.perf_counter()
    if variant == "switches":
        with tf32_matmuls():
            trainer.fit(compile_as_a_user_would(module, "eager" if args.tiny else "inductor"), train_dataloaders=loader)
    else:
        trainer.fit(module, train_dataloaders=loader)
    wall_s = time.perf_counter() - t0
    if sampler is not None and args.out:
        sampler.stop()
        (Path(args.out) / "logs").mkdir(parents=True, exist_ok=True)
        stacks = Path(args.out) / "logs" / f"{name}_run{args.run}_{variant}_stacks.txt"
        sampler.write(stacks)
        try:  # Dynamo's own account of its compile phases, in this process so far
            from torch._dynamo.utils import compile_times, get_compilation_metrics

            restarts = [
                f"  {m.co_name} ({m.co_filename}:{m.co_firstlineno}): {m.dynamo_time_before_restart_s:.2f} s before a restart: "
                + "; ".join(sorted(m.restart_reasons or []))
                for m in get_compilation_metrics()
                if m.restart_reasons
            ]
            with stacks.open("a") as f:
                f.write("\n== torch._dynamo.utils.compile_times()\n" + str(compile_times(repr="str")) + "\n")
                f.write("\n== frames Dynamo traced again from the start, and why\n" + "\n".join(restarts) + "\n")
        except Exception as exc:
            print(f"compile_times: {first_line(exc)}", flush=True)
    fields: dict[str, Any] = (
        {
            "kept": None,
            "trials_s": None,
            "switches": ["bf16-mixed", "tf32", "compile", *(f"{k}={v}" for k, v in entry.switches.items())],
        }
        if ladder is None
        else ladder_fields(ladder, name, args)
    )
    return Fit(variant, timer, trainer.global_step, wall_s, fields)


def ladder_fields(ladder: Any, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The ladder's decisions for the speedkit row; its report written to ``<out>/reports``."""
    result = ladder.result
    if result is None:
        return {"kept": [], "trials_s": None, "not_run": ladder.not_run}
    summary = result.to_dict()["summary"]
    report = None
    if args.out:
        from speedkit.report import write_report

        folder = Path(args.out) / "reports"
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            written = write_report(result, tmp, formats=("json",))
            report = folder / f"{name}_run{args.run}.json"
            report.write_bytes(Path(written["json"]).read_bytes())
    holds = result.holds
    return {
        "kept": [r.name for r in result.kept],
        "trials_s": result.run.get("trials_s"),
        "cache_status": result.run.get("cache"),  # what the ladder says of its cache, where it says anything
        "failed_rungs": [{"rung": r.name, "reason": r.reason} for r in result.rungs[1:] if r.status == "failed"],
        "ladder_speedup": summary["speedup"],
        "ladder_vs_switches": (summary.get("vs_switches") or [None])[0],
        "holds_step_ms": holds.fit.step_ms if holds is not None and holds.fit is not None else None,
        "applied": sorted(ladder.applied_changes),
        "interrupted": result.interrupted,
        "report": str(report) if report else None,
    }


def run_worker(args: argparse.Namespace) -> None:
    """One run of one model: the switches (where asked) then speedkit, a row each."""
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops on a busy few-core machine otherwise wait at OpenMP barriers
    elif not torch.cuda.is_available():
        raise SystemExit("bench/zoo_runs.py needs a CUDA GPU (or --tiny)")
    warnings.filterwarnings("ignore", message=r".*self\.trainer.*not registered.*")
    name = args.models
    entry = ZOO[name]
    cached = args.cache == "on"
    res = Results(
        BENCH,
        out=Path(args.results),
        model=name,
        run=args.run,
        cached=cached,
        cache_mode=args.cache,
        library=entry.library,
        batch_size=entry.batch_size["tiny" if args.tiny else "full"],
        **({"lane": args.lane} if args.lane else {}),
    )
    for variant in ("switches", "speedkit") if args.switches else ("speedkit",):
        t0, graphs_before = time.perf_counter(), compat.graph_count()
        try:
            fit = fit_variant(name, variant, args)
        except Exception as exc:  # a variant that breaks is a result too; the next one still runs
            res.add(variant, "status", None, "failed", kept=None, trials_s=None, reason=first_line(exc))
            print(f"{name:22s} run {args.run} {variant:9s} FAILED: {first_line(exc)}", flush=True)
            release()
            continue
        figures = fit.timer.figures()
        extra = {**fit.fields, "wall_s": round(time.perf_counter() - t0, 2), "fit_graphs": compat.graph_count() - graphs_before}
        status = fit.fields.get("cache_status")
        if cached and isinstance(status, dict) and not status.get("hit"):
            extra["cached"] = False  # a run with the cache on that found no decision climbed: a fresh run
        if figures is None:
            reason = (
                f"the fit ended after {fit.steps_taken} optimizer steps (time guard {args.time_guard_s:.0f} s from the "
                f"train start, or --max-steps {args.max_steps}) before its window of {args.steps} steps ended"
            )
            res.add(variant, "status", None, "not measured", **extra, reason=reason)
            print(f"{name:22s} run {args.run} {variant:9s} not measured: {reason}", flush=True)
        else:
            value, unit = figures.pop("value"), figures.pop("unit")
            res.add(variant, "throughput", value, unit, **figures, **extra)
            kept = fit.fields.get("kept")
            print(
                f"{name:22s} run {args.run} {variant:9s} {value:>14,.1f} {unit:10s} {figures['step_ms']:9.2f} ms/step "
                f"over {args.steps} steps (wall {extra['wall_s']:.0f} s)"
                + (f"  kept {', '.join(kept) or 'none'}, trials {fit.fields['trials_s']} s" if kept is not None else ""),
                flush=True,
            )
        release()


# -- the lanes (the launcher) ---------------------------------------------------------------------


@dataclass
class Lane:
    gpu: str  # its CUDA_VISIBLE_DEVICES
    cores: list[int]
    label: str
    runs: list[tuple[str, int, bool, str | None]] = field(default_factory=list)  # (model, run, with switches, --cache) to run
    proc: subprocess.Popen | None = None
    job: tuple[str, int, bool, str | None] | None = None
    started: float = 0.0
    log: Any = None


def worker_command(
    args: argparse.Namespace, model: str, run: int, switches: bool, rows: Path, lane: str, files: Path, cache: str | None
) -> list[str]:
    """This script as one run's worker, with the launcher's settings: rows to ``rows``, its report under ``files``."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--models",
        model,
        "--run",
        str(run),
        "--results",
        str(rows),
        "--out",
        str(files),
        "--lane",
        lane,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--max-steps",
        str(args.max_steps),
        "--time-guard-s",
        str(args.time_guard_s),
        *(["--switches"] if switches else []),
        *(["--cache", cache] if cache else []),
        *(["--tiny"] if args.tiny else []),
        *(["--progress-bar"] if args.progress_bar else []),
    ]


def run_lanes(args: argparse.Namespace, names: list[str]) -> list[dict[str, Any]]:
    """Every model's runs, ``args.lanes`` models at a time; returns the rows, in order of completion."""
    count = torch.cuda.device_count() if not args.tiny else args.lanes  # --tiny: CPU lanes
    if args.lanes > count:
        raise SystemExit(f"--lanes {args.lanes}: {count} GPU(s) seen")
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="zoo-runs-"))
    # logs and reports: under --out, except in the device's $OUT, which brings back a few files only (packed at the end)
    files = work / "files" if os.environ.get("OUT") and out.resolve() == Path(os.environ["OUT"]).resolve() else out
    (files / "logs").mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else RESULTS / f"{datetime.date.today().isoformat()}_{gpu_slug()}.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    kept_copy = out / "zoo_runs.jsonl"
    blocks = core_blocks(sorted(os.sched_getaffinity(0)), args.lanes)
    where = "CPU lane" if args.tiny else "GPU"
    # a lane's GPU: the g-th of those this process was given (CUDA_VISIBLE_DEVICES=2,3: lanes on GPUs 2 and 3)
    given = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    gpus = given[: args.lanes] if len(given) >= args.lanes else [str(g) for g in range(args.lanes)]
    lanes = [
        Lane(gpus[g], blocks[g], f"{where} {gpus[g]} of {count}, cores {span(blocks[g])}, {args.lanes} lanes")
        for g in range(args.lanes)
    ]
    waiting = list(names)
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPEEDKIT_COMMIT": args.commit, "PYTHONUNBUFFERED": "1"}
    rows: list[dict[str, Any]] = []
    not_run: list[str] = []

    def stamp() -> str:
        return f"[{time.monotonic() - start:5.0f} s]"

    while True:
        for lane in lanes:
            if lane.proc is not None and lane.proc.poll() is not None:
                model, run, _, _ = lane.job  # type: ignore[misc]
                lane.log.close()
                part = work / f"{model}_run{run}.jsonl"
                text = part.read_text() if part.exists() else ""
                rows += [json.loads(line) for line in text.splitlines() if line.strip()]
                for path in (results, *([kept_copy] if kept_copy != results else [])):
                    with open(path, "a") as f:
                        f.write(text)
                print(
                    f"{stamp()} {lane.label}: {model} run {run} rc {lane.proc.returncode} after "
                    f"{time.monotonic() - lane.started:.0f} s, {len(text.splitlines())} rows",
                    flush=True,
                )
                lane.proc = lane.job = None
            if lane.proc is None and not lane.runs and waiting:  # the lane's model is done: the next one
                model = waiting.pop(0)
                first = args.first_run
                lane.runs = [(model, k, k < first + args.switches_runs, args.cache) for k in range(first, first + args.runs)]
                # then the runs that re-check the decision the last of those kept (--cache fresh)
                lane.runs += [(model, k, False, "on") for k in range(first + args.runs, first + args.runs + args.cached_runs)]
            if lane.proc is None and lane.runs:
                left = args.budget_s - (time.monotonic() - start) if args.budget_s else args.run_timeout_s
                if left < 60:
                    not_run += [f"{m} run {k}" for m, k, _, _ in lane.runs]
                    lane.runs = []
                    continue
                model, run, switches, cache = lane.job = lane.runs.pop(0)
                lane.log = open(files / "logs" / f"{model}_run{run}.log", "w")
                lane.proc = subprocess.Popen(
                    [
                        "timeout",
                        str(int(min(args.run_timeout_s, left - 5))),
                        *worker_command(args, model, run, switches, work / f"{model}_run{run}.jsonl", lane.label, files, cache),
                    ],
                    stdout=lane.log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env={**env, "CUDA_VISIBLE_DEVICES": str(lane.gpu)} if not args.tiny else env,
                    preexec_fn=lambda cores=lane.cores: os.sched_setaffinity(0, cores),
                )
                lane.started = time.monotonic()
                print(f"{stamp()} {lane.label}: {model} run {run}{' (switches, then speedkit)' if switches else ''}", flush=True)
        if all(lane.proc is None for lane in lanes) and not waiting and not any(lane.runs for lane in lanes):
            break
        time.sleep(1.0)
    not_run += [f"{m} (all runs)" for m in waiting]
    table = summary(rows) + [f"NOT RUN: {', '.join(not_run)} (--budget-s)"] * bool(not_run)
    table.append(f"rows appended to {results}" + (f" and {kept_copy}" if kept_copy != results else ""))
    (out / "zoo_runs.txt").write_text("\n".join(table) + "\n")
    with tarfile.open(out / "zoo_runs_logs.tgz", "w:gz") as tar:  # every run's log and speedkit report, in one file
        for folder in ("logs", "reports"):
            if (files / folder).exists():
                tar.add(files / folder, arcname=folder)
    print("\n".join(table), flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per model: speedkit's figure and kept set in every run (the climbs' sets compared, then the cached
    runs' against them), the trials' time, and speedkit against
    the switches (the median of the switches runs); a ratio marked ``c`` is a cached run's, ``!`` one
    whose window compiled (``*`` after the model: a switches window did)."""
    lines = ["model                   runs  same kept  trials s (median/max)  speedkit / switches (per run)  kept"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r["metric"] == "throughput"]
        speedkit = sorted((r for r in mine if r["variant"] == "speedkit"), key=lambda r: r["run"])
        switches = [r["value"] for r in mine if r["variant"] == "switches"]
        failed = [f"{r['variant']} run {r['run']}: {r['unit']}" for r in rows if r["model"] == model and r["metric"] == "status"]
        # the climbs' kept sets (order aside: a cached decision is applied in the ladder's order), then the cached runs'
        kept = {tuple(sorted(r["kept"] or ())) for r in speedkit if not r.get("cached")}
        cached = {tuple(sorted(r["kept"] or ())) for r in speedkit if r.get("cached")}
        trials = [r["trials_s"] for r in speedkit if r.get("trials_s") is not None]
        base = statistics.median(switches) if switches else None
        ratios = (
            " ".join(
                f"{r['value'] / base:.2f}x" + "c" * bool(r.get("cached")) + "!" * bool(r.get("graphs_compiled")) for r in speedkit
            )
            if base
            else "-"
        )
        compiled = any(r.get("graphs_compiled") for r in mine if r["variant"] == "switches")
        lines.append(
            f"{model + '*' * compiled:22s} {len(speedkit):5d}  {'yes' if len(kept) == 1 else f'no ({len(kept)})' if kept else '-':9s}  "
            f"{(f'{statistics.median(trials):.0f} / {max(trials):.0f}' if trials else '-'):21s}  {ratios:29s}  "
            + " | ".join(", ".join(k) or "none" for k in kept)
            + (
                f"  (cached: {'the same' if cached <= kept else ' | '.join(', '.join(k) or 'none' for k in cached)})"
                if cached
                else ""
            )
            + (f"  [{'; '.join(failed)}]" if failed else "")
        )
    return lines


def collect(folder: Path, wait_s: float) -> None:
    """Wait up to ``wait_s`` for a detached run's ``done``, then pack ``folder`` into ``$OUT/zoo_runs.tgz``
    (finished or not: what is there comes back) and print its table."""
    if not (folder / "launcher.log").exists():  # a fresh machine (the one that ran it was given back): nothing to wait for
        raise SystemExit(f"--collect: no detached run in {folder} on this machine (its launcher.log is missing)")
    deadline = time.monotonic() + wait_s
    while not (folder / "done").exists() and time.monotonic() < deadline:
        time.sleep(2.0)
    dest = Path(os.environ.get("OUT", "."))
    with tarfile.open(dest / "zoo_runs.tgz", "w:gz") as tar:
        tar.add(folder, arcname=folder.name, filter=without_tree(folder.name))
    table = folder / "zoo_runs.txt"
    print(table.read_text() if table.exists() else (folder / "launcher.log").read_text()[-4000:])
    print(f"{'finished' if (folder / 'done').exists() else 'NOT finished'}; packed {folder} into {dest / 'zoo_runs.tgz'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO), help=f"comma-separated, of: {', '.join(ZOO)}")
    parser.add_argument("--runs", type=int, default=3, help="runs per model, each a fresh process (default 3)")
    parser.add_argument("--first-run", type=int, default=1, help="the first run's number (default 1; e.g. 4 for a cached run)")
    parser.add_argument(
        "--switches-runs",
        type=int,
        default=1,
        help="the first this many runs fit the user's switches before speedkit (default 1)",
    )
    parser.add_argument(
        "--cache",
        choices=("off", "on", "fresh"),
        default=None,
        help="SpeedLadder(cache=False) with 'off'; with 'on' and 'fresh' the model's own decisions' folder "
        "(<out>/cache/<model>), which 'fresh' empties first: the run reads no decision, climbs and keeps its "
        "own, which a later run with 'on' re-checks; rows say cached: true with 'on' and carry cache_mode "
        "(default: SpeedLadder's own default, rows cached: false)",
    )
    parser.add_argument(
        "--cached-runs",
        type=int,
        default=0,
        help="after each model's runs, this many more with --cache on, re-checking the decision its last run kept "
        "(with --cache fresh)",
    )
    parser.add_argument("--lanes", type=int, default=1, help="models run at a time, one per GPU (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps timed per fit (default 50; --tiny 4)")
    parser.add_argument("--warmup", type=int, default=None, help="steps between ready and the window (default 10; --tiny 1)")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="the Trainer's max_steps, what the fit plans (the trials' budget reads it, and a fit under ten times the "
        "budget runs no trials; the fit stops once timed) (default 100000: a fit of hours, as these models are trained)",
    )
    parser.add_argument(
        "--time-guard-s", type=float, default=300.0, help="wall seconds a fit may run after its train start (default 300)"
    )
    parser.add_argument("--run-timeout-s", type=float, default=1500.0, help="wall seconds one run's process may take")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall seconds for the whole call: no run starts within 60 s of it, and a run still going at it is stopped "
        "(its rows say so)",
    )
    parser.add_argument("--progress-bar", action="store_true", help="Lightning's progress bar on, as a user's Trainer has it")
    parser.add_argument("--commit", default=None, help="the commit measured (the device's tree has no history)")
    parser.add_argument("--results", default=None, help="the JSON-lines file rows are appended to")
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="folder for logs, reports, rows and the table (default $OUT)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, a smoke test; rows to a temporary folder")
    parser.add_argument("--detach", action="store_true", help="start in a session of its own and return (needs --out)")
    parser.add_argument("--collect", type=float, default=None, metavar="SECONDS", help="wait for a detached run, pack --out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--switches", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lane", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (4 if args.tiny else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 10)
    args.max_steps = args.max_steps or 100_000
    names = args.models.split(",")
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(ZOO)}")
    if min(args.runs, args.first_run, args.lanes, args.steps) < 1 or args.switches_runs < 0 or args.max_steps <= args.steps:
        raise SystemExit(
            "--runs, --first-run, --lanes and --steps must be 1 or more, --switches-runs 0 or more, --max-steps above --steps"
        )
    if args.cached_runs < 0 or (args.cached_runs and args.cache != "fresh"):
        raise SystemExit(
            "--cached-runs needs --cache fresh (the runs before them keep the decision they re-check), and 0 or more"
        )
    if args.worker:
        run_worker(args)
        return
    cache_kwargs(args.cache)  # --cache on where SpeedLadder has no cache: said now, not in every worker
    if args.collect is not None:
        if not args.out:
            raise SystemExit("--collect needs --out, the detached run's folder")
        collect(Path(args.out), args.collect)
        return
    if args.tiny and not args.out:
        args.out = tempfile.mkdtemp(prefix="zoo-runs-tiny-")
    if args.tiny and not args.results:
        args.results = str(Path(args.out) / "zoo_runs.jsonl")
    if not args.out:
        raise SystemExit("--out is needed (or $OUT): the runs' logs, reports and table go there")
    if args.detach:
        detach(__file__, args.out, sys.argv[1:], REPO)
        return
    args.commit = args.commit or commit()
    start = time.monotonic()
    run_lanes(args, names)
    (Path(args.out) / "done").write_text(f"{time.monotonic() - start:.0f} s\n")


if __name__ == "__main__":
    main()
