"""The batch-size sweep against an exhaustive one, on the GPU: is speedkit's choice within 5% of the
best throughput of every candidate size, found in at most 8 trials, and do 200 steps at it fit?

For each target (a zoo model, with the switches a user turns on: bf16-mixed, TF32, torch.compile of
the library model, the library's attention switch; or a recipe file, its ladder applied as
``speedkit fit`` does), at the user's micro-batch and accumulation (``--accumulate``, so that the
effective batch is micro-batch x accumulation and kept):

  speedkit_choice   speedkit.engine.sweep.sweep over the candidates, each size a short timed fit
                    (speedkit.frontend.sweep_runner.timed_fit_trial: warm-up steps, then windows on the step clock)
  exhaustive_best   every candidate size measured the same way; the fastest that fit with the margin
  user              the user's own micro-batch (from the exhaustive pass)
  holds             200 optimizer steps at speedkit's choice: status "fits" or "out of memory"

Rows (bench "batch_sweep"): metric "throughput" per variant (``size``, ``accumulate``, ``trials`` for
speedkit_choice, ``candidates`` for exhaustive_best), and metric "status" for holds. Every size of both
passes is also a row (variant "size", ``fits``, ``peak_memory_gb``). Timings are medians over warmed-up
windows on CUDA events (the step clock); no first call is timed. Both passes run in one process, one
after the other, on the same GPU.

Usage: PYTHONPATH=. python bench/batch_sweep.py --models hf-llama,timm-vit,tv-resnet50 --accumulate 4
       PYTHONPATH=. python bench/batch_sweep.py --recipe recipes/gpt2-small-naive.yaml
       PYTHONPATH=. python bench/batch_sweep.py --tiny --models lstm-lm   # CPU smoke test, rows to a temp dir
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from bench.zoo import channels_last_as_a_user_would, compile_as_a_user_would  # noqa: E402
from speedkit.demos.zoo import ZOO  # noqa: E402
from speedkit.engine.sweep import MARGIN, SweepTrial, candidates, sweep  # noqa: E402
from speedkit.frontend.sweep_runner import recipe_trials, timed_fit_trial  # noqa: E402


def zoo_target(name: str, tiny: bool) -> tuple[int, Any]:
    """The zoo model's own batch size and a ``measure(size, accumulate)`` for it, with the switches."""
    entry = ZOO[name]
    size_name = "tiny" if tiny else "full"

    def trial(size: int, accumulate: int, *, windows: int = 3, warmup: int = 3, window: int = 5) -> SweepTrial:
        def build() -> tuple[Any, dict[str, Any]]:
            module, loader = entry.build(size_name, batch_size=size, **entry.switches)
            module = compile_as_a_user_would(channels_last_as_a_user_would(module), "eager" if tiny else "inductor")
            return module, {"train_dataloaders": loader}

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
        kwargs = {"accelerator": "cpu" if tiny else "gpu", "devices": 1, "precision": "32-true" if tiny else "bf16-mixed"}
        return timed_fit_trial(size, accumulate, build, kwargs, warmup=warmup, window=window, windows=windows)

    return entry.batch_size[size_name], trial


def recipe_target(path: str) -> tuple[int, Any]:
    """The recipe's batch size and its trial function (speedkit sweep's: its ladder applied, seeded)."""
    from speedkit.frontend.recipe import load_recipe

    _, start, trial = recipe_trials(load_recipe(Path(path)))
    return start, trial


def run_target(name: str, start: int, trial: Any, accumulate: int, res: Results, memory: int | None) -> None:
    effective = start * accumulate
    extra = {"model": name, "effective_batch": effective}
    t0 = time.perf_counter()
    chosen = sweep(
        lambda s: trial(s, effective // s),
        start,
        effective=effective,
        memory_bytes=memory,
        on_event=lambda line: print(f"  [{name}] {line}", flush=True),
    )
    sweep_s = time.perf_counter() - t0
    for t in chosen.trials:
        res.add(
            "size",
            "throughput",
            t.throughput,
            t.unit or "-",
            **extra,
            size=t.size,
            accumulate=t.accumulate,
            fits=t.fits,
            reason=t.reason,
            sweep_pass="speedkit",
            peak_memory_gb=t.peak_memory_bytes / 1e9 if t.peak_memory_bytes else None,
        )
    best_trial = chosen.trial(chosen.chosen)
    res.add(
        "speedkit_choice",
        "throughput",
        best_trial.throughput,
        best_trial.unit,
        **extra,
        size=chosen.chosen,
        accumulate=best_trial.accumulate,
        trials=len(chosen.trials),
        sweep_s=sweep_s,
        rule=chosen.rule,
    )
    # every candidate, measured the same way (the ones the sweep measured are measured again: same process, later)
    exhaustive: list[SweepTrial] = []
    for size in candidates(start, effective=effective):
        t = trial(size, effective // size)
        if t.fits and memory and t.peak_memory_bytes is not None and t.peak_memory_bytes > (1 - MARGIN) * memory:
            t = SweepTrial(t.size, t.accumulate, t.throughput, t.unit, t.peak_memory_bytes, False, "over the margin", t.seconds)
        exhaustive.append(t)
        res.add(
            "size",
            "throughput",
            t.throughput,
            t.unit or "-",
            **extra,
            size=t.size,
            accumulate=t.accumulate,
            fits=t.fits,
            reason=t.reason,
            sweep_pass="exhaustive",
            peak_memory_gb=t.peak_memory_bytes / 1e9 if t.peak_memory_bytes else None,
        )
    fitting = [t for t in exhaustive if t.fits and t.throughput]
    best = max(fitting, key=lambda t: t.throughput) if fitting else None
    if best is not None:
        res.add(
            "exhaustive_best",
            "throughput",
            best.throughput,
            best.unit,
            **extra,
            size=best.size,
            accumulate=best.accumulate,
            candidates=len(exhaustive),
        )
    user = next((t for t in exhaustive if t.size == start), None)
    if user is not None and user.throughput:
        res.add("user", "throughput", user.throughput, user.unit, **extra, size=start, accumulate=accumulate)
    again = next((t for t in exhaustive if t.size == chosen.chosen), None)
    if best is not None and again is not None and again.throughput:
        res.add(
            "speedkit_choice",
            "ratio_vs_exhaustive_best",
            again.throughput / best.throughput,
            "x",
            **extra,
            size=chosen.chosen,
            best_size=best.size,
        )
    held = trial(chosen.chosen, effective // chosen.chosen, windows=20, warmup=3, window=10)  # 200 timed steps
    res.add("holds", "status", None, "fits" if held.fits else held.reason, **extra, size=chosen.chosen, steps=203)
    print(
        f"{name:22s} user {start}: {user.throughput if user else 0:,.0f}  speedkit {chosen.chosen} "
        f"({len(chosen.trials)} trials)  exhaustive best {best.size if best else '-'}: "
        f"{best.throughput if best else 0:,.0f}  200 steps: {'fits' if held.fits else held.reason}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help=f"zoo models, comma-separated, of: {', '.join(ZOO)}")
    parser.add_argument("--recipe", action="append", default=[], help="a recipe file (repeatable)")
    parser.add_argument("--accumulate", type=int, default=4, help="the user's accumulate_grad_batches (default 4)")
    parser.add_argument("--tiny", action="store_true", help="tiny zoo models on the CPU, rows to a temporary directory")
    parser.add_argument("--results", default=None, help="the JSON-lines file (default: bench/results/<date>_<gpu>.jsonl)")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench/batch_sweep.py needs a CUDA GPU (or --tiny)")
    out = Path(args.results) if args.results else None
    if args.tiny and out is None:
        out = Path(tempfile.mkdtemp(prefix="batch-sweep-")) / "rows.jsonl"
    res = Results("batch_sweep", out=out)
    memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() and not args.tiny else None
    for name in [m for m in args.models.split(",") if m]:
        start, trial = zoo_target(name, args.tiny)
        run_target(name, start, trial, args.accumulate, res, memory)
    for path in args.recipe:
        start, trial = recipe_target(path)
        run_target(Path(path).stem, start, trial, args.accumulate, res, memory)
    print(f"results appended to {res.path}")


if __name__ == "__main__":
    main()
