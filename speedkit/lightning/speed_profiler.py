"""SpeedProfiler: an always-on step clock for a Lightning fit, logged through the Trainer's loggers.

A thin callback over :class:`speedkit.measure.monitor.StepMonitor`: it marks each optimizer step's
end on the device's stream (no per-step sync: Lightning's ``ThroughputMonitor`` synchronizes every
batch), and every ``log_every_n_steps`` optimizer steps logs, under ``speedkit/``, the median step
time of the last steps, throughput, MFU, data wait, memory (allocated, reserved, peak, allocator
retries), NVML (utilization, power against its limit, SM clock, a clock slowdown flag) and its own
overhead as a share of the step. At the end of the fit, ``summary`` holds the whole fit's figures
(and ``report_dir/speed_profile.json`` where given).

Under DDP every rank keeps its own clock; at the end of the fit each rank's step time, data wait and
peak memory are gathered (one collective, on every rank) into ``summary["ranks"]`` (``slowest_rank``
beside it), and rank 0 alone logs and writes the report.

It decides nothing that changes the fit. Its checkpoint state is what a resumed fit's figures need:
the FLOPs per step it counted (the resumed fit does not count its first step again) and the global
step its profile ended at. A resumed fit's summary counts its own steps, from the global step it
resumed at (``global_step_start``) to where it ended (``global_step_end``).

FLOPs per step (for MFU): ``flops_per_step`` where given; else a ``SpeedLadder``'s count in the same
fit; else counted by ``torch.utils.flop_counter`` during the fit's first optimizer step itself (no
extra forward or backward: the user's run draws the same random numbers), except on a compiled
model, whose first step compiles (MFU then needs ``flops_per_step``).

Usage::

    trainer = Trainer(callbacks=[SpeedProfiler()], logger=CSVLogger("logs"))
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from speedkit import compat, config, distributed
from speedkit.data.batch import count_items
from speedkit.errors import ConfigError
from speedkit.files import write_text_atomic
from speedkit.lightning.steps import OptimizerSteps
from speedkit.measure.flops import peak_tflops
from speedkit.measure.monitor import StepMonitor

#: the prefix of every logged key
PREFIX = "speedkit/"


class SpeedProfiler(Callback):
    """Step time, throughput, MFU, memory, data wait and NVML of a fit, no per-step sync (module docstring).

    Args:
        log_every_n_steps: optimizer steps between logged figures (None: the Trainer's own).
        flops_per_step: model FLOPs of one optimizer step, for MFU (None: found or counted).
        mfu_precision: the precision whose dense peak MFU divides by ("bf16", "fp16", "tf32", "fp32";
            None: ``configs/defaults.yaml`` ``measure.mfu_precision``).
        peak_tflops: that peak, where the table in ``configs/gpu_peaks.yaml`` lacks the GPU.
        nvml: sample NVML in the background (a GPU with ``nvidia-ml-py``; else nothing).
        throughput_unit: "auto", "tokens" or "samples" (None: ``measure.throughput_unit``).
        report_dir: write ``speed_profile.json`` (the summary) there at the end of the fit (rank 0).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        flops_per_step: int | None = None,
        mfu_precision: str | None = None,
        peak_tflops: float | None = None,
        nvml: bool = True,
        throughput_unit: str | None = None,
        report_dir: str | os.PathLike | None = None,
    ) -> None:
        defaults = config.measure_defaults()
        mfu_precision = defaults["mfu_precision"] if mfu_precision is None else mfu_precision
        throughput_unit = defaults["throughput_unit"] if throughput_unit is None else throughput_unit
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ConfigError("log_every_n_steps", f"expected a positive integer, found {log_every_n_steps!r}")
        if flops_per_step is not None and (not isinstance(flops_per_step, int) or flops_per_step <= 0):
            raise ConfigError("flops_per_step", f"expected a positive integer, found {flops_per_step!r}")
        if throughput_unit not in ("auto", "tokens", "samples"):
            raise ConfigError("throughput_unit", f"expected auto, tokens or samples, found {throughput_unit!r}")
        if report_dir is not None and not isinstance(report_dir, (str, os.PathLike)):
            raise ConfigError("report_dir", f"expected a folder path, found {type(report_dir).__name__} {report_dir!r}")
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_step = flops_per_step
        self.mfu_precision = mfu_precision
        self.peak_tflops = peak_tflops
        self.nvml = nvml
        self.throughput_unit = throughput_unit
        self.report_dir = Path(report_dir) if report_dir is not None else None
        self.monitor: StepMonitor | None = None
        self.summary: dict[str, Any] | None = None
        self.mfu_note: str | None = None
        self._sampler: Any = None
        self._steps = OptimizerSteps()
        self._items = 0
        self._counter: FlopCounterMode | None = None
        self._counted_flops: int | None = None  # counted over a first step (this fit's or a checkpointed one's)
        self._global_step_start = 0
        self._global_step_end: int | None = None  # where the last profiled fit ended (checkpointed)

    # -- the fit ---------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from speedkit.measure.nvml import NvmlSampler

        device = trainer.strategy.root_device
        peak, source = peak_tflops(device, self.mfu_precision, self.peak_tflops)
        if peak is None:
            self.mfu_note = source
        self._sampler = (
            NvmlSampler.create(device, interval_s=float(config.defaults("nvml")["fit_interval_s"])) if self.nvml else None
        )
        if self._sampler is not None:
            self._sampler.start()
        flops = self.flops_per_step if self.flops_per_step is not None else self._counted_flops
        self.monitor = StepMonitor(device, flops_per_step=flops, peak_tflops=peak, nvml=self._sampler)
        self._steps, self._items = OptimizerSteps(), 0
        self._global_step_start = trainer.global_step  # a resumed fit counts from where it resumed

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.monitor is None or not self._steps.batch_started(trainer):
            return
        self.monitor.step_started()
        if self.monitor.steps == 0 and self.monitor.flops_per_step is None and self._counter is None:
            self._start_counting(trainer, pl_module)  # the first step: counted, not timed

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._stop_counting()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        monitor = self.monitor
        if monitor is None:
            return
        started = time.perf_counter()
        before = monitor.own_seconds
        try:
            self._batch_end(trainer, monitor, batch)
        finally:  # the whole hook is the profiler's cost (less what the monitor counted itself)
            monitor.charge(time.perf_counter() - started - (monitor.own_seconds - before))

    def _batch_end(self, trainer: pl.Trainer, monitor: StepMonitor, batch: Any) -> None:
        items, unit = count_items(batch, self.throughput_unit)
        self._items += items
        if not self._steps.batch_ended(trainer):  # a micro-batch of an accumulation: the step goes on
            return
        self._stop_counting()
        monitor.step_ended(self._items, unit)
        self._items = 0
        every = self.log_every_n_steps or trainer.log_every_n_steps or 50
        if trainer.global_step % every == 0 and trainer.loggers and trainer.is_global_zero:
            metrics = {PREFIX + k: v for k, v in monitor.metrics().items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_counting()
        if self._sampler is not None:
            self._sampler.stop()
        # every rank's figures, gathered on every rank (a collective: never behind a rank check)
        ranks = self.gather_ranks(trainer)
        if self.monitor is None:
            return
        self._global_step_end = trainer.global_step
        self.summary = {
            **self.monitor.summary(),
            "mfu_note": self.mfu_note if self.monitor.peak_tflops is None else None,
            "flops_per_step": self.monitor.flops_per_step,
            "global_step_start": self._global_step_start,
            "global_step_end": trainer.global_step,
            "ranks": ranks,
            "slowest_rank": _slowest(ranks),
        }
        if self.report_dir is not None and trainer.is_global_zero:
            write_text_atomic(
                self.report_dir / "speed_profile.json",
                json.dumps({"schema_version": 1, **self.summary}, indent=2, default=str) + "\n",
            )

    def gather_ranks(self, trainer: pl.Trainer) -> list[dict[str, Any] | None]:
        """Every rank's :meth:`rank_figures`, in rank order (a collective: call it on every rank)."""
        return distributed.gather(self.rank_figures(trainer))

    def rank_figures(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """This rank's figures for the summary's ``ranks``: its steps, median and p90 step time, data
        wait, device peak memory and host peak RSS (None where it profiled nothing)."""
        if self.monitor is None:
            return None
        whole = self.monitor.summary()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return {
            "rank": trainer.global_rank,
            "steps": whole["steps"],
            "step_ms_median": whole["step_ms_median"],
            "step_ms_p90": whole["step_ms_p90"],
            "data_wait_ms": whole["data_wait_ms"],
            "peak_memory_bytes": whole["peak_memory_bytes"],
            "host_peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024,
        }

    # -- checkpoint --------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"counted_flops_per_step": self._counted_flops, "global_step_end": self._global_step_end}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        flops = state_dict.get("counted_flops_per_step")
        self._counted_flops = int(flops) if isinstance(flops, int) and flops > 0 else None
        self._global_step_end = state_dict.get("global_step_end")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_counting()
        if self._sampler is not None:
            self._sampler.stop()

    # -- FLOPs for MFU -------------------------------------------------------------------------
    def _start_counting(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """FLOPs from a SpeedLadder in this fit, else counted over the first optimizer step itself."""
        assert self.monitor is not None
        ladder = next((c for c in trainer.callbacks if type(c).__name__ == "SpeedLadder"), None)
        flops = (getattr(getattr(ladder, "result", None), "flops", None) or {}).get("per_step")
        if flops:
            self.monitor.flops_per_step = int(flops)
            return
        if compat.runs_compiled_code(pl_module):
            self.mfu_note = "a compiled model: its first step compiles, FLOPs are not counted there (pass flops_per_step)"
            return
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()

    def _stop_counting(self) -> None:
        counter, self._counter = self._counter, None
        if counter is None:
            return
        counter.__exit__(None, None, None)
        total = int(counter.get_total_flops())
        if total and self.monitor is not None:
            self.monitor.flops_per_step = self._counted_flops = total
        elif not total:
            self.mfu_note = "torch.utils.flop_counter counted no FLOPs in the first step"


def _slowest(ranks: list[dict[str, Any] | None]) -> int | None:
    """The rank whose median step took longest (the one every other rank waits for), or None."""
    timed = [r for r in ranks if r is not None and r.get("step_ms_median") is not None]
    return max(timed, key=lambda r: r["step_ms_median"])["rank"] if timed else None
