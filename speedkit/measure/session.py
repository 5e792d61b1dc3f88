"""The one measurement path: the ladder, the Lightning callbacks and the benchmarks all time here.

A :class:`MeasureSession` times *windows* of training steps on the step clock (CUDA events, one
host wait per window; ``perf_counter`` on CPU) and, per step, the host time spent waiting for the
batch (data wait: the loader, collation, the copy to the device) and issuing the step (host time).
Each window also counts the graphs ``torch.compile`` compiled during it, so a caller can tell a
compilation's seconds from the step's own time. It turns windows into a
:class:`~speedkit.results.Measurement`: median step time and its noise, items per second, MFU,
peak memory, NVML telemetry, data wait and host time.

Two ways to drive it:

* the session runs the steps: :meth:`MeasureSession.runner` pulls ``step.accumulate`` batches from
  an iterator and runs the step, and :meth:`MeasureSession.window` times ``steps`` of them;
* something else runs them (Lightning's loop): call :meth:`batch_started` / :meth:`batch_ended`
  around each (micro-)batch; every ``steps`` optimizer steps make a window.

Clocks are injectable (the device clock through :class:`~speedkit.measure.clock.StepClock`'s
backend, the host clock as a function), so tests drive the whole path with a fake clock.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speedkit import compat, distributed
from speedkit.measure.clock import StepClock, summarize
from speedkit.measure.flops import mfu
from speedkit.results import Measurement

HostClock = Callable[[], float]


@dataclass
class Window:
    """One timed window: per-step means over its steps."""

    ms: float  # step time on the step clock
    data_wait_ms: float  # host time waiting for the batch (fetch, collate, copy)
    host_ms: float  # host time issuing the step
    steps: int  # steps in the window
    peak_memory_bytes: int | None = None
    compiled_graphs: int = 0  # graphs torch.compile compiled during it (its time is in the window's)
    #: the least ``ms`` could be (the pace of the loader feeding it); ``ms`` is at least this
    floor_ms: float = 0.0
    #: under DDP (a session ``across_ranks``): each rank's own (ms, data_wait_ms, host_ms, peak bytes),
    #: the fields above being the slowest rank's (the largest of each)
    ranks: list[tuple[float, float, float, int | None]] | None = None


#: the profiler scope around a step's batch fetch: :mod:`speedkit.profile` counts it as data wait
DATA_WAIT_SCOPE = "speedkit.data_wait"


class MeasureSession:
    """Times training steps on one device.

    Args:
        device: where the steps run (picks the clock: CUDA events or perf_counter).
        clock: a :class:`StepClock` (tests inject a fake backend through it).
        host_clock: seconds from a monotonic host clock (tests inject a fake one).
        flops_per_step, peak_tflops: for MFU (None: not reported).
        items_per_step, unit: tokens or samples per optimizer step, and "tokens/s"/"samples/s".
        telemetry: sample NVML while :meth:`measure` runs (GPU only).
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        clock: StepClock | None = None,
        host_clock: HostClock = time.perf_counter,
        flops_per_step: int | None = None,
        peak_tflops: float | None = None,
        items_per_step: int = 1,
        unit: str = "samples/s",
        telemetry: bool = False,
        across_ranks: bool = False,
    ) -> None:
        self.device = torch.device(device)
        #: under DDP: every window is reduced over the ranks (each timed window is a collective: every
        #: rank times the same windows), its figures the slowest rank's; telemetry is rank 0's
        self.across_ranks = across_ranks and distributed.world_size() > 1
        self.clock = clock or StepClock(self.device)
        self.host_clock = host_clock
        self.flops_per_step = flops_per_step
        self.peak_tflops = peak_tflops
        self.items_per_step = items_per_step
        self.unit = unit
        self.telemetry = telemetry
        self._cuda = self.device.type == "cuda"
        #: bytes in use that the allocator's peak does not show (a CUDA graph's private pool), added
        #: to each window's peak; set by whoever knows the step (the ladder)
        self.memory_outside_peak: Callable[[], int] | None = None
        self._data_wait = 0.0
        self._host = 0.0
        # hook-driven state
        self._steps_per_window = 0
        self._warmup_left = 0
        #: optimizer steps seen by the hook-driven path since begin_steps (warm-up included)
        self.steps_seen = 0
        self._in_window = 0
        self._last_end: float | None = None
        self._started: float | None = None
        self._graphs_at_start = 0

    # -- the session runs the steps ----------------------------------------------------------
    def runner(
        self, step: Callable[[Sequence[Any], int], Any], batches: Iterator[Any], accumulate: int = 1
    ) -> Callable[[], None]:
        """A function running one optimizer step from ``batches``, accounting its data wait and host time."""
        counter = iter(range(1 << 62))

        def run_one() -> None:
            t0 = self.host_clock()
            with torch.profiler.record_function(DATA_WAIT_SCOPE):  # a profile window's data wait (speedkit.profile)
                micro = [next(batches) for _ in range(accumulate)]
            t1 = self.host_clock()
            step(micro, next(counter))
            t2 = self.host_clock()
            self._data_wait += t1 - t0
            self._host += t2 - t1

        return run_one

    def warm(self, run_one: Callable[[], None], steps: int) -> None:
        """Untimed steps (compilation, autotuning, allocator warm-up); waits for them on CUDA."""
        for _ in range(steps):
            run_one()
        if steps and self._cuda:
            torch.cuda.synchronize(self.device)

    def window(self, run_one: Callable[[], None], steps: int, floor_ms: float = 0.0) -> Window:
        """Time ``steps`` steps; one host wait for the device, at the end. Python's garbage collector
        runs as it does in training (its full passes are part of a host-bound step's cost, which the
        ``gc_freeze`` rung cuts). ``floor_ms``: the least a step can take in steady state (its loader's
        pace): a window whose steps read batches made ahead is timed at that."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._data_wait = self._host = 0.0
        graphs = compat.graph_count()
        self.clock.start()
        for _ in range(steps):
            run_one()
            self.clock.step()
        times = self.clock.stop()
        return self._across(
            Window(
                ms=max(sum(times) / len(times), floor_ms),
                floor_ms=floor_ms,
                data_wait_ms=self._data_wait / steps * 1e3,
                host_ms=self._host / steps * 1e3,
                steps=steps,
                peak_memory_bytes=self._peak_memory(),
                compiled_graphs=compat.graph_count() - graphs,
            )
        )

    def _across(self, window: Window) -> Window:
        """The window as the ranks ran it together (one all-reduce): each figure the largest over the
        ranks (the slowest rank sets a DDP step's pace), each rank's own kept in ``ranks``."""
        if not self.across_ranks:
            return window
        n, me = distributed.world_size(), distributed.rank()
        mine = [
            window.ms,
            window.data_wait_ms,
            window.host_ms,
            float(window.peak_memory_bytes or 0),
            float(window.compiled_graphs),
        ]
        table = [0.0] * (len(mine) * n)
        table[me * len(mine) : (me + 1) * len(mine)] = mine
        table = distributed.largest(table)  # every other rank's slots are zeros: MAX gathers them
        rows = [table[r * len(mine) : (r + 1) * len(mine)] for r in range(n)]
        peaks = [int(r[3]) for r in rows]
        return Window(
            ms=max(r[0] for r in rows),
            data_wait_ms=max(r[1] for r in rows),
            host_ms=max(r[2] for r in rows),
            steps=window.steps,
            peak_memory_bytes=max(peaks) if window.peak_memory_bytes is not None else None,
            compiled_graphs=int(max(r[4] for r in rows)),
            floor_ms=window.floor_ms,
            ranks=[(r[0], r[1], r[2], (int(r[3]) if window.peak_memory_bytes is not None else None)) for r in rows],
        )

    def _peak_memory(self) -> int | None:
        """The window's peak device memory: the allocator's, plus what it does not show."""
        if not self._cuda:
            return None
        outside = self.memory_outside_peak() if self.memory_outside_peak is not None else 0
        return torch.cuda.max_memory_allocated(self.device) + outside

    def window_times(self, run_one: Callable[[], None], *, warmup: int, steps: int, repeats: int) -> list[float]:
        """Warm up, then each of ``repeats`` windows' mean step time (ms): for benchmarks of one op."""
        self.warm(run_one, warmup)
        return [self.window(run_one, steps).ms for _ in range(repeats)]

    def measure(
        self, run_one: Callable[[], None], *, warmup: int, steps: int, repeats: int, floor_ms: float = 0.0
    ) -> Measurement:
        """Warm up, then ``repeats`` windows of ``steps`` steps, with telemetry: one configuration alone
        (``floor_ms``: see :meth:`window`)."""
        self.warm(run_one, warmup)
        with self.sampling() as telemetry:
            windows = [self.window(run_one, steps, floor_ms) for _ in range(repeats)]
        summary = telemetry.get("summary")
        if self.across_ranks:  # decisions read it (a host-bound step): every rank reads rank 0's
            summary = distributed.broadcast(summary)
        return self.measurement(windows, warmup=warmup, telemetry=summary)

    # -- something else runs the steps (Lightning's loop) ---------------------------------------
    def begin_steps(self, steps_per_window: int, warmup: int = 0) -> None:
        """Start timing steps that :meth:`batch_started` / :meth:`batch_ended` delimit, after
        ``warmup`` optimizer steps left untimed.

        These steps are the user's own: the device's peak-memory counter is read, never reset (the
        user may read it too), so a window's peak is the peak since whoever last reset it.
        """
        self._steps_per_window = steps_per_window
        self._warmup_left = warmup
        self.steps_seen = 0
        if warmup == 0:
            self._open_window(self.host_clock())

    def _open_window(self, now: float) -> None:
        self._in_window = 0
        self._data_wait = self._host = 0.0
        self._last_end = now
        self._started = None
        self._graphs_at_start = compat.graph_count()
        self.clock.start()

    def batch_started(self) -> None:
        """A (micro-)batch is about to run: the time since the last one ended was data wait."""
        if self._warmup_left:
            return
        now = self.host_clock()
        if self._last_end is not None:
            self._data_wait += now - self._last_end
        self._started = now

    def batch_ended(self, step_done: bool = True) -> Window | None:
        """A (micro-)batch ended; ``step_done`` when it completed an optimizer step. Returns the
        window when this step completes one."""
        now = self.host_clock()
        self.steps_seen += step_done
        if self._warmup_left:
            self._warmup_left -= step_done
            if not self._warmup_left:
                self._open_window(now)
            return None
        if self._started is not None:
            self._host += now - self._started
        self._last_end, self._started = now, None
        if not step_done:
            return None
        self.clock.step()
        self._in_window += 1
        if self._in_window < self._steps_per_window:
            return None
        times = self.clock.stop()
        n = len(times)
        window = self._across(
            Window(
                ms=sum(times) / n,
                data_wait_ms=self._data_wait / n * 1e3,
                host_ms=self._host / n * 1e3,
                steps=n,
                peak_memory_bytes=self._peak_memory(),
                compiled_graphs=compat.graph_count() - self._graphs_at_start,
            )
        )
        self._open_window(now)
        return window

    # -- results ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def sampling(self) -> Iterator[dict[str, Any]]:
        """NVML telemetry over the block (``out["summary"]`` afterwards; absent without a GPU)."""
        from speedkit.measure.nvml import NvmlSampler

        out: dict[str, Any] = {}
        sampler = NvmlSampler.create(self.device) if self.telemetry else None
        if sampler is not None:
            sampler.start()
        try:
            yield out
        finally:
            out["summary"] = sampler.stop() if sampler is not None else None

    def measurement(self, windows: Sequence[Window], *, warmup: int = 0, telemetry: dict[str, Any] | None = None) -> Measurement:
        """Summarize windows: median step time, noise, throughput, MFU, memory, data wait, host time."""
        if not windows:
            raise ValueError("no timed windows")
        median, spread = summarize([w.ms for w in windows])
        util, achieved = mfu(self.flops_per_step, median / 1e3, self.peak_tflops)
        peaks = [w.peak_memory_bytes for w in windows if w.peak_memory_bytes is not None]
        per_rank = None
        if windows[0].ranks is not None:  # each rank's medians over the windows (DDP)
            per_rank = [
                {
                    "rank": r,
                    "step_ms": statistics.median(w.ranks[r][0] for w in windows),  # type: ignore[index]
                    "data_wait_ms": statistics.median(w.ranks[r][1] for w in windows),  # type: ignore[index]
                    "host_ms": statistics.median(w.ranks[r][2] for w in windows),  # type: ignore[index]
                    "peak_memory_bytes": max((w.ranks[r][3] or 0) for w in windows) or None,  # type: ignore[index]
                }
                for r in range(len(windows[0].ranks))
            ]
        return Measurement(
            step_ms=median,
            spread=spread,
            window_ms=[w.ms for w in windows],
            warmup=warmup,
            steps=windows[0].steps,
            throughput=self.items_per_step / (median / 1e3),
            throughput_unit=self.unit,
            items_per_step=self.items_per_step,
            mfu=util,
            tflops=achieved,
            peak_memory_bytes=max(peaks) if peaks else None,
            telemetry=telemetry,
            clock=self.clock.name,
            data_wait_ms=statistics.median(w.data_wait_ms for w in windows),
            host_ms=statistics.median(w.host_ms for w in windows),
            ranks=per_rank,
        )
