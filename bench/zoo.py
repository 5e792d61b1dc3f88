"""The model zoo on one GPU: Lightning's own switches against SpeedLadder(), side by side, per model.

For each model of :mod:`speedkit.demos.zoo`, in one process, at the same batch size:

  fp32      Trainer(precision="32-true"), the model as its user wrote it
  switches  what a user who knows the switches does: precision="bf16-mixed", channels_last on a
            convnet (weights and input batches), torch.compile of the
            library model (``self.model``; the LightningModule where there is none), TF32 matmuls
            (``allow_tf32``, ``set_float32_matmul_precision("high")``), and the library's own SDPA
            switch where it has one (Hugging Face ``attn_implementation="sdpa"``; timm's fused
            attention is on by default)
  speedkit  SpeedLadder() trials in the fp32 Trainer, then the fit's own steps
  rungs     (with --variants) the switches as speedkit's own rungs, applied without trials in the fp32
            Trainer: SpeedLadder(rungs=<configs/defaults.yaml switches:>); beside ``switches`` it tells
            whether speedkit's way of applying them costs what the user's does, apart from any decision

Every variant is timed on the fit's own steps by the same StepTimer (speedkit's measurement session:
CUDA events, one wait per window, the median of windows after warm-up steps); its peak memory is
the device's peak up to its last timed window (for speedkit, since the trials ended).

Rows (bench "zoo"): per model and variant, metric "throughput" (tokens/s or samples/s, with the
fit's window spread as ``noise``) and "peak_memory_gb"; for speedkit, "ratio_vs_switches", and in its
throughput row the trials' ``trials_s``, the baseline's window spread ``baseline_noise`` and its likely
source, and the ladder's own figure against the switches (``ladder_vs_switches``); a variant that fails or is stopped by the
time guard before a timed window, metric "status". Each throughput row counts the graphs Dynamo
compiled in that variant's fit (``graphs_compiled``): a switches figure under fp32 from compiles in
its timed windows shows there. The speedkit report is saved beside the rows as
<date>_<gpu>_zoo_<model>_report.json.

The time guard bounds each variant's fit on its own, counted from the fit's ``on_train_start``: a fit
still running at its deadline is stopped there. For the speedkit variant that is after its trials
(SpeedLadder runs them in its own ``on_train_start``, before the guard's), which keep to the ladder's
own budget and report what they took (``trials_s``): a guard that counted the trials in left hf-t5's
fit one step after trials of 590 s against their 150 s budget (H200, c5f4f53), so that nothing was
measured. On an H200 a model takes 1 to 12 minutes (hf-t5 the longest: its trials recompile it).

Usage: PYTHONPATH=. python bench/zoo.py [--models hf-gpt2,timm-vit] [--steps 10] [--time-guard-s 300] [--rounds 2]
                                        [--variants fp32,switches,speedkit,rungs] [--accumulate 4]
       PYTHONPATH=. python bench/zoo.py --tiny      # CPU smoke test, rows to a temporary directory
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results, gpu_slug  # noqa: E402
from speedkit import compat, config  # noqa: E402
from speedkit.demos.zoo import ZOO, Size, ZooModel  # noqa: E402
from speedkit.lightning import SpeedLadder, StepTimer  # noqa: E402
from speedkit.results import Measurement  # noqa: E402

VARIANTS = ("fp32", "switches", "speedkit")
#: variants run only when asked for (--variants)
EXTRA_VARIANTS = ("rungs",)
#: the switches as speedkit's rungs (the ``rungs`` variant): the ladder's floor, from configs/defaults.yaml
SWITCH_RUNGS = tuple(config.switch_rungs())


@dataclass(frozen=True)
class Plan:
    """How much to run: the CPU smoke test's or the GPU benchmark's."""

    tiny: bool
    steps: int  # optimizer steps per timed window
    warmup: int  # steps before the first timed window (compilation, autotuning, loader start)
    windows: dict[str, int]  # timed windows per variant
    measure: dict[str, Any]  # SpeedLadder's measure settings
    time_guard_s: float  # wall time one variant's fit may take from its train start (after speedkit's trials)
    switch_rungs: tuple[str, ...] = SWITCH_RUNGS  # the ``rungs`` variant's
    ladder_rungs: tuple[str, ...] | None = None  # the speedkit variant's (None: the default ladder)
    accumulate: int = 1  # the user's accumulate_grad_batches, in every variant (steps count optimizer steps)

    @property
    def size(self) -> Size:
        return "tiny" if self.tiny else "full"

    @property
    def accelerator(self) -> str:
        return "cpu" if self.tiny else "gpu"

    @property
    def compile_backend(self) -> str:
        """Inductor on the GPU; on the CPU smoke test Dynamo alone (no C++ code generation)."""
        return "eager" if self.tiny else "inductor"

    def ladder(self) -> list[Any]:
        """The default ladder, its compile rung on :attr:`compile_backend`."""
        return [
            {"name": "compile", "options": {"backend": self.compile_backend}} if r == "compile" else r
            for r in (self.ladder_rungs or config.default_ladder())
        ]


#: SpeedLadder's measure settings for the CPU smoke test: short, deciding nothing
TINY_MEASURE = {
    "warmup": 1,
    "steps": 1,
    "repeats": 2,
    "parity_steps": 2,
    "min_blocks": 2,
    "max_blocks": 2,
    "settle": 0,
    "budget_s": 10.0,
    "holds_windows": 1,
    "telemetry": False,
}


def make_plan(tiny: bool, steps: int | None, time_guard_s: float | None) -> Plan:
    if tiny:
        return Plan(
            True,
            steps or 2,
            1,
            {"fp32": 2, "switches": 2, "speedkit": 2, "rungs": 2},
            TINY_MEASURE,
            time_guard_s or 120.0,
        )
    # the trials bounded at 150 s a model (the bench's fits are a few dozen steps, so the default rule,
    # a share of the planned fit, would give them only its floor)
    return Plan(
        False,
        steps or 10,
        5,
        {"fp32": 2, "switches": 3, "speedkit": 3, "rungs": 3},
        {
            "warmup": 3,
            "steps": 5,
            "repeats": 3,
            "parity_steps": 2,
            "min_blocks": 2,
            "max_blocks": 8,
            "budget_s": 20.0,
            "holds_windows": 2,
            "trials_budget_s": 150.0,
            "trials_min_s": 150.0,
        },
        time_guard_s or 240.0,
    )


class Deadline(pl.Callback):
    """Stops the fit ``guard_s`` wall seconds after its ``on_train_start`` (checked after each training
    batch); placed after SpeedLadder among the callbacks, it counts from the end of the trials."""

    def __init__(self, guard_s: float) -> None:
        self.guard_s = guard_s
        self.deadline = math.inf

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.deadline = time.monotonic() + self.guard_s

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if time.monotonic() > self.deadline:
            trainer.should_stop = True


def channels_last_as_a_user_would(module: pl.LightningModule) -> pl.LightningModule:
    """On a convolutional model (two or more ``nn.Conv2d``): the weights ``channels_last``
    (``module.to(memory_format=torch.channels_last)``) and every 4-D floating batch tensor converted
    after the transfer to the device (``on_after_batch_transfer``), as PyTorch's tutorial has users do."""
    if sum(isinstance(m, nn.Conv2d) for m in module.modules()) < 2:
        return module
    module.to(memory_format=torch.channels_last)
    own = module.on_after_batch_transfer

    def on_after_batch_transfer(batch: Any, dataloader_idx: int) -> Any:
        batch = own(batch, dataloader_idx)
        return torch.utils._pytree.tree_map(
            lambda t: (
                t.contiguous(memory_format=torch.channels_last)
                if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point()
                else t
            ),
            batch,
        )

    module.on_after_batch_transfer = on_after_batch_transfer  # type: ignore[method-assign]
    return module


def compile_as_a_user_would(module: pl.LightningModule, backend: str) -> pl.LightningModule:
    """``self.model = torch.compile(self.model)`` where the module wraps a library model; a GAN's
    ``self.generator`` and ``self.discriminator`` each; else ``torch.compile`` of the LightningModule
    itself (Lightning unwraps it in ``fit``).

    The word-language LSTM (lstm-lm) is compiled the same way, as its user would: Dynamo stops at
    ``nn.LSTM`` (``torch._dynamo.config.allow_rnn`` is off by default) and runs the rest of that forward
    eagerly, cuDNN's LSTM included. Turning ``allow_rnn`` on (Inductor compiles the LSTM) was slower
    on an H200: 16.9 against 13.3 ms a step in this variant."""
    if isinstance(getattr(module, "model", None), nn.Module):
        module.model = torch.compile(module.model, backend=backend)
        return module
    nets = [n for n in ("generator", "discriminator") if isinstance(getattr(module, n, None), nn.Module)]
    if len(nets) == 2:  # a GAN: both nets its step calls, as its user compiles them
        for name in nets:
            setattr(module, name, torch.compile(getattr(module, name), backend=backend))
        return module
    return torch.compile(module, backend=backend)  # type: ignore[return-value]


@contextlib.contextmanager
def tf32_matmuls() -> Iterator[None]:
    """TF32 matmuls as users switch them on, switched back afterwards."""
    precision, allow = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32 = allow


def fit_variant(entry: ZooModel, variant: str, plan: Plan, res: Results) -> tuple[Measurement | None, int, dict[str, Any]]:
    """Train ``entry`` as ``variant`` until its windows are timed (or the deadline); returns the
    timer's measurement, the optimizer steps taken and, for speedkit, the ladder's fields for the row."""
    windows = plan.windows[variant]
    timer = StepTimer(warmup=plan.warmup, window=plan.steps, unit=entry.unit)
    ladder = None
    if variant == "speedkit":
        ladder = SpeedLadder(
            plan.ladder(),
            trials="always",
            measure=plan.measure,
            on_event=lambda line: print(f"  [{entry.name}] {line}", flush=True),
        )
    elif variant == "rungs":
        ladder = SpeedLadder(
            [
                {"name": "compile", "options": {"backend": plan.compile_backend}} if r == "compile" else r
                for r in plan.switch_rungs
            ],
            trials=False,
        )
    module, loader = entry.build(plan.size, **(entry.switches if variant == "switches" else {}))
    precision = "bf16-mixed" if variant == "switches" else "32-true"
    trainer = pl.Trainer(
        accelerator=plan.accelerator,
        devices=1,
        precision=precision,
        accumulate_grad_batches=plan.accumulate,
        max_steps=plan.warmup + plan.steps * windows,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*([ladder] if ladder else []), timer, Deadline(plan.time_guard_s)],
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with tf32_matmuls() if variant == "switches" else contextlib.nullcontext():
        fitted = (
            compile_as_a_user_would(channels_last_as_a_user_would(module), plan.compile_backend)
            if variant == "switches"
            else module
        )
        trainer.fit(fitted, train_dataloaders=loader)
    if variant == "rungs" and ladder is not None:
        return timer.measurement, trainer.global_step, {"kept": list(ladder.applied_changes), "skipped": dict(ladder.skipped)}
    return timer.measurement, trainer.global_step, speedkit_fields(ladder, res, entry.name, plan) if ladder else {}


def release() -> None:
    """Free what the last variant left: loader workers, compiled graphs, cached device memory."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def run_model(name: str, plan: Plan, res: Results, variants: tuple[str, ...] = VARIANTS, rounds: int = 1) -> None:
    """Fit ``name`` as each variant, ``rounds`` times, the order reversed every other round (fp32,
    switches, speedkit, then speedkit, switches, fp32): on a host-bound step separate fits of one
    configuration differ by 10-20% (the host's state drifts through a process), which a ratio of
    single fits cannot tell from a gain; the ratio rows then take the medians over rounds."""
    entry = ZOO[name]
    throughput: dict[str, list[float]] = {}
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            extra: dict[str, Any] = {"model": name, "library": entry.library, "batch_size": entry.batch_size[plan.size]}
            if plan.accumulate > 1:
                extra["accumulate"] = plan.accumulate
            if rounds > 1:
                extra["round"] = r
            t0 = time.perf_counter()
            graphs_before = compat.graph_count()
            try:
                m, steps, fields = fit_variant(entry, variant, plan, res)
            except Exception as exc:  # a variant that breaks is a result too; the others still run
                res.add(variant, "status", None, "failed", **extra, reason=first_line(exc))
                print(f"{name:22s} {variant:9s} FAILED: {first_line(exc)}", flush=True)
                release()
                continue
            # graphs Dynamo compiled in the fit (trials included): a figure under fp32 from recompiles shows here
            extra.update(wall_s=time.perf_counter() - t0, graphs_compiled=compat.graph_count() - graphs_before, **fields)
            if m is None:
                res.add(
                    variant,
                    "status",
                    None,
                    "not measured",
                    **extra,
                    reason=f"the fit ended after {steps} steps (time guard: {plan.time_guard_s:.0f} s from its train start), "
                    "before a timed window",
                )
                print(f"{name:22s} {variant:9s} not measured ({steps} steps before the time guard)", flush=True)
            else:
                throughput.setdefault(variant, []).append(m.throughput)
                res.add(
                    variant,
                    "throughput",
                    m.throughput,
                    m.throughput_unit,
                    **extra,
                    step_ms=m.step_ms,
                    noise=m.spread,
                    windows=len(m.window_ms),
                    data_wait_ms=m.data_wait_ms,
                    host_ms=m.host_ms,
                )
                peak = f"{m.peak_memory_bytes / 1e9:.2f} GB" if m.peak_memory_bytes is not None else "-"
                if m.peak_memory_bytes is not None:
                    res.add(variant, "peak_memory_gb", m.peak_memory_bytes / 1e9, "GB", model=name)
                print(
                    f"{name:22s} {variant:9s} {m.throughput:>14,.0f} {m.throughput_unit:9s} {m.step_ms:9.2f} ms ±{m.spread:5.1%}  "
                    f"between steps {m.data_wait_ms:6.2f} ms  peak {peak:>9s}  "
                    f"({extra['wall_s']:.0f} s)" + (f"  kept {', '.join(fields['kept']) or 'none'}" if fields else ""),
                    flush=True,
                )
            release()
    for variant in ("speedkit", "rungs"):
        if throughput.get(variant) and throughput.get("switches"):
            ratio = statistics.median(throughput[variant]) / statistics.median(throughput["switches"])
            res.add(
                variant,
                "ratio_vs_switches",
                ratio,
                "x",
                model=name,
                rounds=rounds,
                **({"per_round": {v: throughput[v] for v in (variant, "switches")}} if rounds > 1 else {}),
            )
            print(
                f"{name:22s} {variant} / switches = {ratio:.3f}x" + (f" (medians of {rounds} rounds)" if rounds > 1 else ""),
                flush=True,
            )


def speedkit_fields(ladder: SpeedLadder, res: Results, name: str, plan: Plan) -> dict[str, Any]:
    """The ladder's decisions for the speedkit row; its report saved beside the rows."""
    result = ladder.result
    if result is None:
        return {"kept": [], "not_run": ladder.not_run}
    from speedkit.report import write_report

    with tempfile.TemporaryDirectory() as tmp:
        written = write_report(result, tmp, formats=("json",))
        shutil.copyfile(written["json"], res.path.parent / f"{res.date}_{gpu_slug()}_zoo_{name}_report.json")
    failed = [{"rung": r.name, "reason": r.reason} for r in result.rungs[1:] if r.status == "failed"]
    for f in failed:
        print(f"{name:22s} speedkit  rung {f['rung']} FAILED: {f['reason']}", flush=True)
    summary = result.to_dict()["summary"]
    noise = result.run.get("noise") or {}
    return {
        "kept": summary["kept"],
        "failed_rungs": failed,
        "ladder_speedup": summary["speedup"],
        "ladder_vs_switches": (summary.get("vs_switches") or [None])[0],
        "trials_s": result.run.get("trials_s"),
        "baseline_noise": noise.get("baseline_spread"),
        "noise_source": noise.get("source"),
        "trial_order": result.run.get("trial_order"),
        "interrupted": result.interrupted,
        "ladder_measure": "quick" if plan.measure else "defaults",
        "ladder": list(plan.ladder_rungs) if plan.ladder_rungs else "default",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO), help=f"comma-separated, of: {', '.join(ZOO)}")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny models on the CPU, a smoke test; rows go to a temporary directory"
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per timed window (default 10; --tiny 2)")
    parser.add_argument(
        "--time-guard-s",
        type=float,
        default=None,
        help="wall seconds one variant's fit may take from its train start (after the speedkit variant's trials) "
        "(default 240; 600 with --ladder-measure defaults; --tiny 120)",
    )
    parser.add_argument("--results", default=None, help="the JSON-lines file (default: bench/results/<date>_<gpu>.jsonl)")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of: {', '.join(VARIANTS + EXTRA_VARIANTS)} (default: {','.join(VARIANTS)})",
    )
    parser.add_argument(
        "--rungs",
        default=",".join(SWITCH_RUNGS),
        help=f"the rungs variant's rungs, comma-separated (default: {','.join(SWITCH_RUNGS)})",
    )
    parser.add_argument(
        "--ladder",
        default=None,
        help="the speedkit variant's rungs, comma-separated (default: the default ladder of "
        "configs/defaults.yaml); a diagnostic: which rungs' trials leave the fit where it is",
    )
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="the user's accumulate_grad_batches in every variant (default 1): the effective batch is "
        "batch size x accumulate, and speedkit's micro_batch rung may merge micro-batches",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="fit every variant this many times, the order reversed every other round; the ratios "
        "take the medians (separate fits of a host-bound step differ by 10-20%%)",
    )
    parser.add_argument(
        "--lane",
        default=None,
        help="where this process ran on a host shared with other zoo processes (bench/zoo_lanes.py: "
        "'GPU 2 of 4, cores 32-47, 4 lanes'), recorded in every row as lane",
    )
    parser.add_argument(
        "--ladder-measure",
        choices=("quick", "defaults"),
        default="quick",
        help="SpeedLadder's measure settings: the bench's quick ones (short windows, at most 8 blocks "
        "of 20 s) or speedkit's own defaults (configs/defaults.yaml: SpeedLadder() as a user gets it)",
    )
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(ZOO)}")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench/zoo.py needs a CUDA GPU (or --tiny)")
    if args.tiny:
        torch.set_num_threads(1)  # tiny ops on a busy few-core machine otherwise wait at OpenMP barriers
    warnings.filterwarnings("ignore", message=r".*self\.trainer.*not registered.*")
    plan = make_plan(args.tiny, args.steps, args.time_guard_s)
    if args.ladder_measure == "defaults":  # longer comparisons: the fit after them needs a longer guard
        plan = dataclasses.replace(plan, measure={}, time_guard_s=args.time_guard_s or 600.0)
    out = Path(args.results) if args.results else None
    if out is None and args.tiny:
        out = Path(tempfile.mkdtemp(prefix="zoo-tiny-")) / "zoo.jsonl"
    res = Results("zoo", out=out, **({"lane": args.lane} if args.lane else {}))
    plan = dataclasses.replace(
        plan,
        switch_rungs=tuple(r for r in args.rungs.split(",") if r),
        ladder_rungs=tuple(r for r in args.ladder.split(",") if r) if args.ladder else None,
        accumulate=args.accumulate,
    )
    if args.accumulate < 1:
        raise SystemExit(f"--accumulate must be 1 or more, found {args.accumulate}")
    variants = tuple(args.variants.split(","))
    if any(v not in VARIANTS + EXTRA_VARIANTS for v in variants):
        raise SystemExit(f"unknown variant in {args.variants!r}; known: {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be 1 or more, found {args.rounds}")
    for name in names:
        run_model(name, plan, res, variants, args.rounds)
    print("\nsummary:")
    for name in names:
        cells = []
        for variant in variants:
            row = next(
                (
                    r
                    for r in res.rows
                    if r["model"] == name and r["variant"] == variant and r["metric"] in ("throughput", "status")
                ),
                None,
            )
            cells.append(
                f"{variant} {row['value']:,.0f}"
                if row and row["metric"] == "throughput"
                else f"{variant} {row['unit'] if row else '-'}"
            )
        ratio = next(
            (
                r["value"]
                for r in res.rows
                if r["model"] == name and r["variant"] == "speedkit" and r["metric"] == "ratio_vs_switches"
            ),
            None,
        )
        print(f"  {name:22s} " + "  ".join(f"{c:24s}" for c in cells) + (f"  speedkit/switches {ratio:.3f}x" if ratio else ""))
    print(f"results appended to {res.path}")


if __name__ == "__main__":
    main()
