"""Where a zoo model's step goes, per configuration of the user's switches: a diagnostic for a
``switches`` figure under its ``fp32`` one (bench/zoo.py). It prints and writes a text report; it
appends no rows (bench/zoo.py is the record).

For each variant, one Lightning fit of the zoo model as bench/zoo.py builds it, the switches taken
one by one so that the one that costs shows:

  fp32          Trainer(precision="32-true"), the model as its user wrote it
  bf16          precision="bf16-mixed" alone
  bf16+cl       bf16-mixed with channels_last weights and batches (a convolutional model)
  bf16+compile  bf16-mixed with torch.compile of the library model
  switches      bench/zoo.py's switches: bf16-mixed, channels_last, compile, TF32 matmuls

After ``--warmup`` untimed steps (compilation, autotuning, the loader's start), the step clock times
``--windows`` windows of ``--steps`` steps (median, CUDA events), then torch.profiler records
``--steps`` more steps. Per variant the report gives: the step time; the GPU's busy share of the
profiled wall time (the union of kernel intervals) and its kernel time per step; the host's waits on
the device (synchronising calls: their count and time per step); the CPU operators of most self time
and the kernels of most device time.

Usage: PYTHONPATH=. python bench/zoo_profile.py --model tv-resnet50 [--variants fp32,switches] [--out DIR]
       PYTHONPATH=. python bench/zoo_profile.py --model lstm-lm --tiny     # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import commit, gpu_slug  # noqa: E402
from bench.zoo import channels_last_as_a_user_would, compile_as_a_user_would, release, tf32_matmuls  # noqa: E402
from speedkit.demos.zoo import ZOO  # noqa: E402
from speedkit.lightning import StepTimer  # noqa: E402

#: variant -> (precision, channels_last, compile, tf32)
VARIANTS: dict[str, tuple[str, bool, bool, bool]] = {
    "fp32": ("32-true", False, False, False),
    "bf16": ("bf16-mixed", False, False, False),
    "bf16+cl": ("bf16-mixed", True, False, False),
    "bf16+compile": ("bf16-mixed", False, True, False),
    "switches": ("bf16-mixed", True, True, True),
}
#: runtime calls in which the host waits for the device
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


class ProfileSteps(pl.Callback):
    """torch.profiler over ``steps`` training batches from batch ``start`` (the fit's own steps)."""

    def __init__(self, start: int, steps: int, cuda: bool) -> None:
        self.start, self.steps, self.cuda = start, steps, cuda
        self.prof: torch.profiler.profile | None = None
        self.wall_s = 0.0
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.start and self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            if self.cuda:
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.prof is not None and not self.wall_s and trainer.global_step >= self.start + self.steps:
            if self.cuda:
                torch.cuda.synchronize()
            self.wall_s = time.perf_counter() - self._t0
            self.prof.__exit__(None, None, None)
            trainer.should_stop = True


def is_annotation(event: Any) -> bool:
    """A GPU-side user annotation (``record_function`` ranges mirrored on the device, such as
    ``Optimizer.step#SGD.step``), not device work."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith(("Optimizer.", "ProfilerStep#"))


def busy_share(kernels: list[tuple[float, float]], wall_us: float) -> float:
    """The share of ``wall_us`` in which at least one kernel ran (intervals in microseconds)."""
    covered, end = 0.0, -1.0
    for s, e in sorted(kernels):
        if e <= end:
            continue
        covered += e - max(s, end)
        end = e
    return covered / wall_us if wall_us else 0.0


def analyse(prof: torch.profiler.profile, steps: int, wall_s: float, top: int) -> tuple[dict[str, Any], str]:
    events = prof.events()
    # the device's own work: kernels, copies and sets; not the GPU-side user annotations (ranges such as
    # ``Optimizer.step#SGD.step`` that span a whole step and would count it busy), each interval once
    kernels = sorted(
        {
            (e.name, e.time_range.start, e.time_range.end)
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not is_annotation(e)
        }
    )
    kernels = [(start, end) for _, start, end in kernels]
    kernel_us = sum(e - s for s, e in kernels)
    syncs = [e for e in events if e.name in SYNC_CALLS]
    sync_us = sum(e.cpu_time_total for e in syncs)
    summary = {
        "profiled_steps": steps,
        "wall_ms_per_step": 1e3 * wall_s / steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step": kernel_us / 1e3 / steps,
        "gpu_busy_share": busy_share(kernels, wall_s * 1e6),
        "sync_calls_per_step": len(syncs) / steps,
        "sync_ms_per_step": sync_us / 1e3 / steps,
    }
    averages = prof.key_averages()
    tables = [
        "CPU operators by self CPU time:",
        averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=70),
    ]
    if kernels:
        tables += [
            "Kernels by device time:",
            averages.table(
                sort_by="self_cuda_time_total" if hasattr(averages[0], "self_cuda_time_total") else "self_device_time_total",
                row_limit=top,
                max_name_column_width=70,
            ),
        ]
    return summary, "\n".join(tables)


def profile_variant(
    name: str, variant: str, size: str, warmup: int, steps: int, windows: int, top: int
) -> tuple[dict[str, Any], str]:
    precision, channels_last, compiled, tf32 = VARIANTS[variant]
    entry = ZOO[name]
    cuda = torch.cuda.is_available()
    switches = entry.switches if precision == "bf16-mixed" else {}
    module, loader = entry.build(size, **switches)
    timer = StepTimer(warmup=warmup, window=steps, unit=entry.unit)
    profiler = ProfileSteps(warmup + steps * windows, steps, cuda)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision=precision if cuda else "32-true",
        max_steps=warmup + steps * (windows + 1) + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, profiler],
    )
    t0 = time.perf_counter()
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        if channels_last:
            module = channels_last_as_a_user_would(module)
        if compiled:
            module = compile_as_a_user_would(module, "inductor" if cuda else "eager")
        trainer.fit(module, train_dataloaders=loader)
    m = timer.measurement
    if profiler.prof is None or not profiler.wall_s:
        return {"variant": variant, "error": "the fit ended before the profiled steps"}, ""
    summary, tables = analyse(profiler.prof, steps, profiler.wall_s, top)
    summary.update(
        variant=variant,
        step_ms=m.step_ms if m else None,
        spread=m.spread if m else None,
        throughput=m.throughput if m else None,
        unit=m.throughput_unit if m else None,
        host_ms=m.host_ms if m else None,
        data_wait_ms=m.data_wait_ms if m else None,
        wall_s=time.perf_counter() - t0,
    )
    return summary, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help=f"one of: {', '.join(ZOO)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--warmup", type=int, default=15, help="untimed steps first (default 15)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window and profiled (default 10)")
    parser.add_argument("--windows", type=int, default=3, help="timed windows before the profiled steps (default 3)")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: a smoke test")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the text report")
    args = parser.parse_args()
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS] + ([args.model] if args.model not in ZOO else [])
    if bad:
        raise SystemExit(f"unknown variant(s) or model: {', '.join(bad)}")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench/zoo_profile.py needs a CUDA GPU (or --tiny)")
    size = "tiny" if args.tiny else "full"
    head = (
        f"zoo profile: {args.model} ({size}), {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
        f"commit {commit()}, torch {torch.__version__}, {datetime.date.today().isoformat()}"
    )
    parts, lines = [head], [head]
    for variant in variants:
        summary, tables = profile_variant(args.model, variant, size, args.warmup, args.steps, args.windows, args.top)
        line = f"{variant:13s} " + (
            summary["error"]
            if "error" in summary
            else f"step {summary['step_ms']:.2f} ms (±{summary['spread']:.1%})  profiled {summary['wall_ms_per_step']:.2f} ms/step  "
            f"GPU busy {summary['gpu_busy_share']:.0%}, kernels {summary['kernel_ms_per_step']:.2f} ms/step "
            f"({summary['kernels_per_step']:.0f})  host waits {summary['sync_calls_per_step']:.1f}/step "
            f"{summary['sync_ms_per_step']:.2f} ms  between steps {summary['data_wait_ms']:.2f} ms"
        )
        print(line, flush=True)
        lines.append(line)
        parts += [f"\n===== {variant} =====", repr(summary), tables]
        release()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{datetime.date.today().isoformat()}_{gpu_slug()}_zoo_profile_{args.model}_{commit()}.txt"
    path.write_text("\n".join(lines) + "\n\n" + "\n".join(parts) + "\n")
    print(f"written {path}")


if __name__ == "__main__":
    main()
