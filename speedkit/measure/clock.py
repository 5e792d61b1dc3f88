"""The step clock: per-step times without a per-step device synchronization.

On CUDA an event is recorded into the stream after each step (an asynchronous, cheap call); the
host synchronizes once, on the last event, when a window of steps ends. On CPU, where work is
synchronous, ``time.perf_counter`` is read after each step. Warm-up steps are simply not timed.

The backend is injectable so the no-sync property is testable on a CPU: count ``synchronize``
calls, not seconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class ClockBackend(Protocol):
    name: str

    def mark(self) -> Any: ...
    def synchronize(self, mark: Any) -> None: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...


class CudaEventBackend:
    """CUDA events recorded on the current stream; one host wait per window."""

    name = "cuda_events"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[torch.cuda.Event] = []
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def mark(self) -> torch.cuda.Event:
        # events are reused across windows: creating one per step would allocate on the hot path
        if self._next == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._next]
        self._next += 1
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)


class PerfCounterBackend:
    """Host wall clock, for devices whose work is synchronous with the host (CPU)."""

    name = "perf_counter"

    def reset(self) -> None:
        pass

    def mark(self) -> float:
        return time.perf_counter()

    def synchronize(self, mark: float) -> None:
        pass

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


class StepClock:
    """Times the steps of a window: ``start()``, then ``step()`` after each step, then ``stop()``.

    Example:
        >>> clock = StepClock(torch.device("cpu"))
        >>> clock.start()
        >>> for _ in range(3):
        ...     _ = torch.ones(8).sum(); clock.step()
        >>> len(clock.stop())
        3

    Attributes:
        syncs: how many times the clock waited for the device (one per window on CUDA).
    """

    def __init__(self, device: torch.device, backend: ClockBackend | None = None) -> None:
        if backend is None:
            backend = CudaEventBackend(device) if device.type == "cuda" else PerfCounterBackend()
        self.backend = backend
        self.syncs = 0
        self._marks: list[Any] = []

    @property
    def name(self) -> str:
        return self.backend.name

    def start(self) -> None:
        reset = getattr(self.backend, "reset", None)
        if reset is not None:
            reset()
        self._marks = [self.backend.mark()]

    def step(self) -> None:
        """Mark the end of one step. Never waits for the device."""
        self._marks.append(self.backend.mark())

    def stop(self) -> list[float]:
        """Wait once for the last step, and return each step's duration in milliseconds."""
        if len(self._marks) < 2:
            raise RuntimeError("StepClock.stop() needs start() and at least one step()")
        self.backend.synchronize(self._marks[-1])
        self.syncs += 1
        marks, self._marks = self._marks, []
        return [self.backend.elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]


def summarize(window_means_ms: Sequence[float]) -> tuple[float, float]:
    """Median of the windows' mean step times, and their noise: a robust relative standard deviation.

    The noise is ``1.4826 * MAD / median`` (the median absolute deviation scaled to estimate a
    standard deviation), so one window disturbed by another process does not swamp it, as it
    would a max-min range. A change smaller than the noise is not a measured change.
    """
    if not window_means_ms:
        raise ValueError("no timed windows")
    median = statistics.median(window_means_ms)
    if median <= 0:
        return median, 0.0
    mad = statistics.median(abs(w - median) for w in window_means_ms)
    return median, 1.4826 * mad / median
