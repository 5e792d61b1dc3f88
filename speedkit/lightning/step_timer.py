"""StepTimer: step times of a real Lightning run on the speedkit step clock (no per-step sync)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from speedkit.ladder import count_items
from speedkit.measure import StepClock, summarize


class StepTimer(Callback):
    """Times training steps after ``warmup`` steps, in windows of ``window`` steps.

    A mark is recorded at the end of every batch (a CUDA event on GPU, asynchronous); the clock
    waits once per window. After fit, ``windows_ms`` holds each window's mean step time,
    ``step_ms``/``spread`` their median and spread, and ``throughput`` items per second.

    Args:
        warmup: batches not timed (compilation, autotuning, allocator warm-up).
        window: batches per timed window.
        unit: "auto", "tokens" or "samples" (see ``speedkit.ladder.count_items``).
    """

    def __init__(self, warmup: int = 5, window: int = 10, unit: str = "auto") -> None:
        if warmup < 1 or window < 1:
            raise ValueError(f"warmup and window must be >= 1, found warmup={warmup}, window={window}")
        self.warmup, self.window, self.unit = warmup, window, unit
        self.windows_ms: list[float] = []
        self.items_per_step = 0
        self.throughput_unit = "samples/s"
        self._clock: StepClock | None = None
        self._in_window = 0
        self._batches = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock = StepClock(trainer.strategy.root_device)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self._clock is not None
        self._batches += 1
        if self._batches == self.warmup:
            self.items_per_step, self.throughput_unit = count_items(batch, self.unit)
            self._clock.start()
            return
        if self._batches < self.warmup:
            return
        self._clock.step()
        self._in_window += 1
        if self._in_window == self.window:
            times = self._clock.stop()
            self.windows_ms.append(sum(times) / len(times))
            self._in_window = 0
            self._clock.start()

    @property
    def step_ms(self) -> float | None:
        return summarize(self.windows_ms)[0] if self.windows_ms else None

    @property
    def spread(self) -> float | None:
        return summarize(self.windows_ms)[1] if self.windows_ms else None

    @property
    def throughput(self) -> float | None:
        step = self.step_ms
        return self.items_per_step / (step / 1e3) if step else None
