"""Where the time goes, on the GPU: SpeedLadder's report with its profile, and SpeedProfiler's cost.

For each zoo model:

  report     ``SpeedLadder()`` (the default ladder, the bench's quick measure settings of
             bench/zoo.py) in a fit with ``SpeedProfiler`` and a CSV logger, its report (report.json,
             report.md, report.html and the baseline's and final configuration's traces) written to
             ``--out/<model>``: the profile windows, host syncs, attribution and NVML timeline there
             are what a user gets.
  overhead   the switches configuration (bf16-mixed, TF32, torch.compile, the library's attention
             switch) fitted without and with ``SpeedProfiler`` in A B B A order (``--rounds`` pairs),
             each fit timed by speedkit's StepTimer (median over warmed-up windows on CUDA events):
             rows ``bench: "speed_profiler_overhead"``, variants ``without`` / ``with``, metric
             ``step_ms``; ``ratio`` (with / without, the median over rounds), the paired comparison of
             the fits' speed with it against without (``paired_speed``: speedkit.measure.compare, one
             A B B A block per two rounds) and the profiler's own reading of its host time per step
             (``overhead_fraction``).

Usage: PYTHONPATH=. python bench/profile_report.py --models lightning-transformer --out $OUT
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from bench.zoo import Deadline, channels_last_as_a_user_would, compile_as_a_user_would, make_plan, release, tf32_matmuls  # noqa: E402
from speedkit.demos.zoo import ZOO  # noqa: E402
from speedkit.lightning import SpeedLadder, SpeedProfiler, StepTimer  # noqa: E402
from speedkit.measure.compare import compare  # noqa: E402
from speedkit.measure.session import Window  # noqa: E402
from speedkit.measure.stats import describe  # noqa: E402


def ladder_report(name: str, out: Path) -> None:
    """SpeedLadder's trials and report for ``name`` in a fit watched by SpeedProfiler."""
    plan = make_plan(False, None, None)
    entry = ZOO[name]
    folder = out / name
    ladder = SpeedLadder(
        plan.ladder(),
        trials="always",
        measure=plan.measure,
        report_dir=folder,
        on_event=lambda line: print(f"  [{name}] {line}", flush=True),
    )
    profiler = SpeedProfiler(log_every_n_steps=5, report_dir=folder)
    module, loader = entry.build("full")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=plan.warmup + plan.steps * 4,
        logger=CSVLogger(folder / "logs"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ladder, profiler, Deadline(plan.time_guard_s)],
    )
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    result = ladder.result
    if result is not None:  # the report as the ladder holds it, beside what SpeedLadder wrote
        import json

        from speedkit.report import to_json_safe

        (folder / "ladder_result.json").write_text(json.dumps(to_json_safe(result.to_dict()), indent=1))
    kept = ", ".join(r.name for r in result.kept) if result else "-"
    print(
        f"{name}: report in {folder} ({time.perf_counter() - t0:.0f} s), kept {kept}; profiler "
        f"{profiler.summary and profiler.summary.get('step_ms_median')} ms/step",
        flush=True,
    )
    release()


def overhead(name: str, rounds: int, res: Results) -> None:
    """The switches fitted without and with SpeedProfiler, A B B A, each timed by StepTimer: the
    paired comparison of :func:`speedkit.measure.compare.compare`, one block per two rounds."""
    entry = ZOO[name]
    times: dict[str, list[float]] = {"without": [], "with": []}
    fractions: list[float] = []
    variant = "without"

    def switch(profiled: bool) -> None:
        nonlocal variant
        variant = "with" if profiled else "without"

    def fit() -> Window:
        timer = StepTimer(warmup=10, window=20)
        profiler = SpeedProfiler(log_every_n_steps=10) if variant == "with" else None
        module, loader = entry.build("full", **entry.switches)
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            precision="bf16-mixed",
            max_steps=10 + 20 * 5,
            logger=CSVLogger(Path(os.environ.get("TMPDIR", "/tmp")) / "sp-overhead"),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer, *([profiler] if profiler else [])],
        )
        with tf32_matmuls():
            trainer.fit(compile_as_a_user_would(channels_last_as_a_user_would(module), "inductor"), train_dataloaders=loader)
        m = timer.measurement
        assert m is not None
        times[variant].append(m.step_ms)
        extra = {"model": name, "noise": m.spread, "windows": len(m.window_ms)}
        if profiler is not None and profiler.summary is not None:
            fractions.append(profiler.summary["overhead_fraction"] or 0.0)
            extra["overhead_fraction"] = profiler.summary["overhead_fraction"]
            extra["profiler_step_ms"] = profiler.summary["step_ms_median"]
        res.add(variant, "step_ms", m.step_ms, "ms", **extra)
        print(
            f"{name} {variant:8s} {m.step_ms:8.3f} ms ±{m.spread:.1%}"
            + (
                f"  profiler's own reading {extra['profiler_step_ms']:.3f} ms, overhead {extra['overhead_fraction']:.4%}"
                if "overhead_fraction" in extra
                else ""
            ),
            flush=True,
        )
        release()
        return Window(ms=m.step_ms, data_wait_ms=m.data_wait_ms or 0.0, host_ms=m.host_ms or 0.0, steps=m.steps)

    blocks = max(1, rounds // 2)
    rule = SimpleNamespace(min_gain=0.0, confidence=0.95, min_blocks=blocks, max_blocks=blocks)
    paired = compare(switch, fit, rule, budget_s=math.inf, clock=time.perf_counter).comparison
    ratio = statistics.median(times["with"]) / statistics.median(times["without"])
    res.add(
        "with",
        "ratio",
        ratio,
        "x",
        model=name,
        rounds=rounds,
        overhead_fraction_median=statistics.median(fractions) if fractions else None,
        paired_speed={
            "speedup": paired.speedup,
            "ci": [paired.low, paired.high],
            "blocks": paired.blocks,
            "verdict": paired.verdict,
        },
    )
    print(
        f"{name}: with / without SpeedProfiler = {ratio:.4f}x (medians of {rounds} fits each); "
        f"paired speed with it: {describe(paired)}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lightning-transformer", help=f"comma-separated, of: {', '.join(ZOO)}")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the reports")
    parser.add_argument(
        "--rounds", type=int, default=2, help="fits of each variant in the overhead comparison (two per A B B A block)"
    )
    parser.add_argument("--skip", default="", help="report or overhead, to leave one out")
    parser.add_argument("--results", default=None, help="the JSON-lines file (default: bench/results/<date>_<gpu>.jsonl)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/profile_report.py needs a CUDA GPU")
    res = Results("speed_profiler_overhead", out=Path(args.results) if args.results else None)
    for name in [m for m in args.models.split(",") if m]:
        if "overhead" not in args.skip:
            overhead(name, args.rounds, res)
        if "report" not in args.skip:
            ladder_report(name, Path(args.out))
    print(f"rows appended to {res.path}")


if __name__ == "__main__":
    main()
