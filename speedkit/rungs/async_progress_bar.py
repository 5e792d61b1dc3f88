"""async_progress_bar: show a Lightning fit's progress-bar values without a host sync every step.

Speeds up: Lightning fits whose LightningModule logs with ``prog_bar=True`` on step (most do, for
the loss) on a GPU. After every training batch Lightning turns each such value into a Python float
(``.item()``), which waits for the whole step to finish on the GPU: the host cannot queue the next
step meanwhile, so the host's own work per step (Python, Lightning's loop, the data path) is added
to the GPU's instead of overlapping it. Does not help: steps the GPU takes much longer over than
the host (the wait costs little then), or modules that log nothing to the progress bar.
Needs: a Lightning fit on a CUDA device whose module's own source passes ``prog_bar`` to ``self.log``.
Numerics: unchanged. Training computes exactly what it did; only when a logged value is shown changes.

What it changes: the training loop's per-step progress-bar values are copied to pinned host memory
behind the step's kernels and shown once the copy is done, one or two steps late
(:class:`~speedkit.training.lagged_scalars.LaggedScalars`); at most ``lag`` copies per value are outstanding,
and a value read twice in a step is copied once.
Epoch values, validation, loggers and callback metrics are as Lightning makes them. When the fit
ends (undo) the values are read exactly, so ``trainer.progress_bar_metrics`` after the fit holds
the last step's values. Training computes exactly what it did.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from speedkit import compat
from speedkit.handle import Handle
from speedkit.rungs.base import Rung
from speedkit.training.lagged_scalars import LaggedScalars
from speedkit.training.state import TrainState


@dataclasses.dataclass
class AsyncProgressBarOptions:
    """Options of the async_progress_bar rung."""

    #: copies of one value that may be outstanding; the host runs at most this many steps ahead of
    #: the value shown (a larger lag never waits, a value is shown later)
    lag: int = 2

    def __post_init__(self) -> None:
        if self.lag < 1:
            raise ValueError(f"lag must be >= 1, found {self.lag}")


def logs_to_progress_bar(module: Any) -> bool | None:
    """Whether the source of ``module``'s own classes (not Lightning's) passes ``prog_bar``; None when
    no source can be read."""
    sources = []
    for cls in type(module).__mro__:
        if cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning", "torch", "builtins"):
            continue
        try:
            sources.append(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
    if not sources:
        return None
    return any("prog_bar" in source for source in sources)


class AsyncProgressBarRung(Rung):
    name = "async_progress_bar"
    # the progress bar's .item() per step: the sync, and the host's time it kept from overlapping the device's
    targets = ("syncs", "host")
    cuts_host_work = True
    host_side = True
    Options = AsyncProgressBarOptions
    precision = None  # training is untouched; only when a logged value is read changes

    def check(self, state: TrainState) -> str | None:
        trainer = state.step.trainer
        if trainer is None:
            return "not a Lightning fit: only Lightning's loop turns progress-bar values into floats after every step"
        if state.device.type != "cuda":
            return f"on {state.device.type} reading a logged value waits for no device"
        if logs_to_progress_bar(state.model) is False:
            return (
                f"{type(state.model).__name__} never passes prog_bar to self.log, so Lightning reads no value "
                "back after each step"
            )
        if compat.lightning_progress_bar_values(trainer) is None:
            return "this Lightning version keeps its progress-bar values elsewhere (speedkit.compat needs updating)"
        return None

    def apply(self, state: TrainState) -> Handle:
        trainer = state.step.trainer
        handle = Handle(self.name)
        lagged = LaggedScalars(self.options.lag)
        restore = [compat.lightning_step_progress_bar(trainer, lagged.convert)]

        def off() -> None:
            restore.pop()()
            lagged.flush()
            lagged.latest.clear()

        def on() -> None:
            restore.append(compat.lightning_step_progress_bar(trainer, lagged.convert))

        def finish() -> None:
            """The fit's last values read exactly into the bar's dict (names its own steps set)."""
            values = compat.lightning_progress_bar_values(trainer)
            exact = lagged.flush()
            if values is not None:
                values.update({k: v for k, v in exact.items() if k in values})

        handle.record(
            f"progress-bar values of each training step copied to the host behind the step and shown when "
            f"the copy is done (up to {self.options.lag} steps late), instead of a host sync (.item()) after "
            "every step; exact after the fit",
            off,
            on,
        )
        handle.record("", finish, persistent=True)  # undone first: the exact values before the patch goes
        handle.report = lambda: [
            f"progress-bar values read: {lagged.reads}, of which waited for (more than {lagged.lag} outstanding): {lagged.waits}"
        ]
        return handle
