"""An always-on clock for a whole fit: step time with no per-step sync, and what explains it.

:class:`StepMonitor` is the Lightning-free engine of :class:`speedkit.lightning.SpeedProfiler`.
Each optimizer step's end is marked on the device's stream (a CUDA event recorded, never waited
for); marks are read once the device has passed them (``Event.query()``), so a step's time is
known a few steps late and the host never stops to ask. Beside it: the host's wait for each batch
(the time between one step's end and the next one's start, which is where a loop fetches its
batch), throughput (items per step over the step time), MFU (FLOPs per step over step time over
the device's peak), memory (allocated, reserved, peak, the allocator's retries: read when metrics
are asked for, not every step) and the newest NVML sample (utilization, power against its limit,
SM clock, clock-event reasons: flagged because a clock held down confounds any comparison).

The monitor's own host time is counted (``overhead_fraction``: its hooks' time over the steps'),
so the claim that it costs under 1% of a step is a reading of every run, not a promise.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from speedkit.measure.flops import mfu

#: completed step times the rolling figures are the median of
ROLLING = 50
#: marks waiting for the device at most; older ones are dropped (a device far behind the host)
MAX_PENDING = 1024


class Marks(Protocol):
    """Where step ends are marked: on the device's stream (CUDA events) or the host's clock."""

    def mark(self) -> Any: ...
    def done(self, mark: Any) -> bool: ...
    def elapsed_ms(self, start: Any, end: Any) -> float: ...


class CudaMarks:
    """CUDA events on the current stream: recorded without a sync, read once the device passed them."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, mark: torch.cuda.Event) -> bool:
        return bool(mark.query())

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))


class HostMarks:
    """The host's clock (a CPU run: the step is done when the host is)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock

    def mark(self) -> float:
        return self.clock()

    def done(self, mark: float) -> bool:
        return True

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


class StepMonitor:
    """Step times, data wait, throughput, MFU, memory and NVML of a running loop (module docstring).

    Call :meth:`step_started` when an optimizer step's first batch is in hand, :meth:`step_ended`
    after its optimizer step, :meth:`metrics` whenever figures are wanted (they describe the last
    :data:`ROLLING` completed steps), :meth:`summary` at the end.

    Args:
        device: the device the steps run on (CUDA: marks are CUDA events; else the host clock).
        marks: where step ends are marked (tests pass a fake that completes late).
        host_clock: the host's clock (data wait, the monitor's own overhead).
        flops_per_step: model FLOPs of one optimizer step (None: no MFU).
        peak_tflops: the device's dense peak for MFU (None: no MFU).
        nvml: an NVML sampler already started (:class:`speedkit.measure.nvml.NvmlSampler`), or None.

    Its own host time (``overhead_fraction``) is what its methods take, plus what a caller charges
    with :meth:`charge` (a callback's whole hooks: the batch counted, the figures logged).
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        marks: Marks | None = None,
        host_clock: Callable[[], float] = time.perf_counter,
        flops_per_step: int | None = None,
        peak_tflops: float | None = None,
        nvml: Any = None,
    ) -> None:
        self.device = torch.device(device)
        self.marks = marks or (CudaMarks() if self.device.type == "cuda" else HostMarks(host_clock))
        self.host_clock = host_clock
        self.flops_per_step = flops_per_step
        self.peak_tflops = peak_tflops
        self.nvml = nvml
        self.items_per_step: int | None = None
        self.unit = ""
        self.steps = 0  # optimizer steps ended
        self.step_ms: deque[float] = deque(maxlen=ROLLING)
        self.data_wait_ms: deque[float] = deque(maxlen=ROLLING)
        self.all_step_ms: list[float] = []  # every completed step (the summary's median)
        self.all_data_wait_ms: list[float] = []
        self._pending: deque[Any] = deque()
        self._last_done: Any = None
        self._ended_at: float | None = None  # host time of the last step's end
        self._own_s = 0.0  # the monitor's own host time

    # -- the loop's hooks --------------------------------------------------------------------
    def step_started(self) -> None:
        t0 = self.host_clock()
        if self._ended_at is not None:
            wait = (t0 - self._ended_at) * 1e3
            self.data_wait_ms.append(wait)
            self.all_data_wait_ms.append(wait)
        self._own_s += self.host_clock() - t0

    def step_ended(self, items: int | None = None, unit: str = "") -> None:
        t0 = self.host_clock()
        if items is not None:
            self.items_per_step, self.unit = items, unit or self.unit
        self._pending.append(self.marks.mark())
        if len(self._pending) > MAX_PENDING:  # the oldest one's interval is lost; the next starts afresh
            self._pending.popleft()
            self._last_done = None
        self.steps += 1
        self._collect()
        self._ended_at = self.host_clock()
        self._own_s += self._ended_at - t0

    def _collect(self) -> None:
        """Read the marks the device has passed, oldest first, without waiting for any."""
        while self._pending and self.marks.done(self._pending[0]):
            mark = self._pending.popleft()
            if self._last_done is not None:
                ms = self.marks.elapsed_ms(self._last_done, mark)
                self.step_ms.append(ms)
                self.all_step_ms.append(ms)
            self._last_done = mark

    # -- figures -----------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The figures of the last completed steps, flat, for a logger (no key where unknown)."""
        t0 = self.host_clock()
        out: dict[str, float] = {}
        if self.step_ms:
            step_ms = statistics.median(self.step_ms)
            out["step_ms"] = step_ms
            if self.items_per_step:
                out["throughput"] = self.items_per_step / (step_ms / 1e3)
            util, achieved = mfu(self.flops_per_step, step_ms / 1e3, self.peak_tflops)
            if util is not None:
                out["mfu"] = util
            if achieved is not None:
                out["tflops"] = achieved
        if self.data_wait_ms:
            out["data_wait_ms"] = statistics.median(self.data_wait_ms)
        out.update(self.memory())
        out.update(self.telemetry())
        if self.all_step_ms and self.steps:
            out["overhead_fraction"] = self.overhead_fraction() or 0.0
        self._own_s += self.host_clock() - t0
        return out

    def memory(self) -> dict[str, float]:
        """Allocated, reserved and peak bytes and the allocator's retries (a CUDA device; else none)."""
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {
            "memory_allocated_bytes": float(stats.get("allocated_bytes.all.current", 0)),
            "memory_reserved_bytes": float(stats.get("reserved_bytes.all.current", 0)),
            "memory_peak_bytes": float(stats.get("allocated_bytes.all.peak", 0)),
            "alloc_retries": float(stats.get("num_alloc_retries", 0)),
        }

    def telemetry(self) -> dict[str, float]:
        """The newest NVML sample: utilization, power and its limit, SM clock, and 1.0 under
        ``clock_slowdown`` where a power, thermal or hardware slowdown held the clock down."""
        from speedkit.measure.nvml import SLOWDOWN_REASONS

        sample = self.nvml.latest() if self.nvml is not None else None
        if not sample:
            return {}
        out = {
            key: float(sample[src])
            for key, src in (
                ("gpu_util", "util"),
                ("power_w", "power_w"),
                ("power_limit_w", "power_limit_w"),
                ("sm_clock_mhz", "sm_clock"),
            )
            if sample.get(src) is not None
        }
        if "reasons" in sample:
            out["clock_slowdown"] = 1.0 if SLOWDOWN_REASONS.intersection(sample["reasons"]) else 0.0
        return out

    @property
    def own_seconds(self) -> float:
        """The monitor's own host time so far."""
        return self._own_s

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of the caller's host time as the monitor's own (a hook around it)."""
        self._own_s += seconds

    def overhead_fraction(self) -> float | None:
        """The monitor's own host time over the steps' time (None before a step completed)."""
        total_ms = sum(self.all_step_ms)
        if not total_ms:
            return None
        per_step_ms = self._own_s * 1e3 / max(1, self.steps)
        return per_step_ms / (total_ms / len(self.all_step_ms))

    def summary(self) -> dict[str, Any]:
        """The whole run's figures (the report's ``fit_monitor``): medians over every completed step."""
        self._collect()
        step_ms = statistics.median(self.all_step_ms) if self.all_step_ms else None
        util, achieved = mfu(self.flops_per_step, step_ms / 1e3, self.peak_tflops) if step_ms else (None, None)
        memory = self.memory()
        telemetry = self.nvml.summary if self.nvml is not None else None
        return {
            "steps": self.steps,
            "timed_steps": len(self.all_step_ms),
            "step_ms_median": step_ms,
            "step_ms_p90": _quantile(self.all_step_ms, 0.9),
            "throughput": self.items_per_step / (step_ms / 1e3) if step_ms and self.items_per_step else None,
            "throughput_unit": self.unit or None,
            "mfu": util,
            "tflops": achieved,
            "data_wait_ms": statistics.median(self.all_data_wait_ms) if self.all_data_wait_ms else None,
            "peak_memory_bytes": memory.get("memory_peak_bytes"),
            "reserved_bytes": memory.get("memory_reserved_bytes"),
            "alloc_retries": memory.get("alloc_retries"),
            "telemetry": telemetry,
            "overhead_fraction": self.overhead_fraction(),
            "clock": type(self.marks).__name__,
            "overhead_note": "the monitor's own host time per step over the median step time; step ends are "
            "marked on the device's stream and read once passed: no per-step sync",
        }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
