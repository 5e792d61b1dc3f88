"""HookTimer: which of Lightning's per-batch actions take the host time between the fit's steps.

Lightning runs every hook it calls, and its fetch of the next batch, inside ``trainer.profiler``'s
``start``/``stop`` (``[Callback]EMA.on_train_batch_end``, ``[_TrainingEpochLoop].train_dataloader_next``,
...). While the fit check times the fit's steps, :class:`HookTimer` stands in for that profiler:
it passes every call on to the user's profiler unchanged and, for the actions that run between two
steps, adds up their host time. The outermost action counts (a hook inside another hook is part
of it); an action still open when the next step starts is not counted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from lightning.pytorch.profilers import Profiler
from typing_extensions import override


class HookTimer(Profiler):
    """Passes ``start``/``stop`` on to ``inner`` and times the outermost actions run between steps.

    Args:
        inner: the Trainer's profiler (``PassThroughProfiler`` unless the user chose one).
        clock: host seconds (tests pass a fake one).
    """

    def __init__(self, inner: Profiler, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.inner, self.clock = inner, clock
        self.between = False  # the fit check sets it from a step's end to the next one's start
        self._open: list[tuple[str, float | None]] = []  # actions started and not stopped, with the start time counted
        self._seconds: dict[str, float] = defaultdict(float)

    @override
    def start(self, action_name: str) -> None:
        counted = self.between and all(t0 is None for _, t0 in self._open)
        self._open.append((action_name, self.clock() if counted else None))
        self.inner.start(action_name)

    @override
    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == action_name:
                t0 = self._open.pop(i)[1]
                if t0 is not None:  # started between steps, and the next step has not started since
                    self._seconds[action_name] += self.clock() - t0
                return

    def step_started(self) -> None:
        """The next step starts: actions still open are not between steps alone."""
        self.between = False
        self._open = [(name, None) for name, _ in self._open]

    def step_ended(self) -> None:
        self.between = True

    def take(self) -> dict[str, float]:
        """Seconds per action since the last ``take``, and start afresh."""
        seconds, self._seconds = dict(self._seconds), defaultdict(float)
        return seconds

    @override
    def summary(self) -> str:
        return self.inner.summary()

    def __getattr__(self, name: str) -> Any:  # anything else a caller asks of the user's profiler
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
