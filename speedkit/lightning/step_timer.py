"""StepTimer: step times of a real Lightning run, on speedkit's measurement session (no per-step sync)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from speedkit import config
from speedkit.data.batch import count_items
from speedkit.lightning.steps import OptimizerSteps
from speedkit.measure.session import MeasureSession, Window
from speedkit.results import Measurement


class StepTimer(Callback):
    """Times optimizer steps after ``warmup`` steps, in windows of ``window`` steps.

    A mark is recorded at the end of every optimizer step (a CUDA event on GPU, asynchronous); the
    clock waits once per window. Per step it also records the host time spent waiting for the batch
    and issuing the step. After fit, ``windows_ms`` holds each window's mean step time,
    ``measurement`` the summary (median, noise, throughput, data wait, host time).

    Args:
        warmup: optimizer steps not timed (compilation, autotuning, allocator warm-up).
        window: optimizer steps per timed window.
        unit: "auto", "tokens" or "samples" (see :func:`speedkit.data.count_items`).

    Each left out (None) is ``configs/defaults.yaml``'s: ``step_timer:`` ``warmup`` and ``window``,
    ``measure:`` ``throughput_unit``.
    """

    def __init__(self, warmup: int | None = None, window: int | None = None, unit: str | None = None) -> None:
        defaults = config.step_timer_defaults()
        warmup = defaults["warmup"] if warmup is None else warmup
        window = defaults["window"] if window is None else window
        unit = config.measure_defaults()["throughput_unit"] if unit is None else unit
        if warmup < 1 or window < 1:
            raise ValueError(f"warmup and window must be >= 1, found warmup={warmup}, window={window}")
        self.warmup, self.window, self.unit = warmup, window, unit
        self.windows: list[Window] = []
        self.items_per_step = 0
        self.throughput_unit = "samples/s"
        self.session: MeasureSession | None = None
        self._steps = OptimizerSteps()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session = MeasureSession(trainer.strategy.root_device)
        self.session.begin_steps(self.window, warmup=self.warmup)
        self._steps = OptimizerSteps()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.session is not None
        self._steps.batch_started(trainer)
        self.session.batch_started()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self.session is not None
        if not self.items_per_step:
            items, self.throughput_unit = count_items(batch, self.unit)
            self.items_per_step = items * trainer.accumulate_grad_batches
            self.session.items_per_step, self.session.unit = self.items_per_step, self.throughput_unit
        window = self.session.batch_ended(self._steps.batch_ended(trainer))
        if window is not None:
            self.windows.append(window)

    @property
    def windows_ms(self) -> list[float]:
        return [w.ms for w in self.windows]

    @property
    def measurement(self) -> Measurement | None:
        return self.session.measurement(self.windows, warmup=self.warmup) if self.windows and self.session else None

    @property
    def step_ms(self) -> float | None:
        m = self.measurement
        return m.step_ms if m else None

    @property
    def spread(self) -> float | None:
        m = self.measurement
        return m.spread if m else None

    @property
    def throughput(self) -> float | None:
        m = self.measurement
        return m.throughput if m else None
