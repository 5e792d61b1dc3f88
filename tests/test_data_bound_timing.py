"""A step is timed at the pace its loader sustains, not on batches its workers buffered meanwhile.

A DataLoader's workers keep making batches while nobody reads them, up to what their queues and
data_path's ring hold. In an A B B A comparison a source fills while the other configuration's windows
run (or while slower steps ran), and its windows were then served from the buffer: on an H200 a
ResNet-18 with per-sample CPU augmentation was reported at 22.6 ms per step with data_path, whose loader
alone makes a batch every 40.5 ms, and its fit ran 50-57 ms
(bench/results/2026-11-28_h200x2_zoo_runs_3a3370e). Each loader with workers now has its pace measured
once, and no window reading it is timed faster (:meth:`speedkit.engine.timing.Timing.loader_pace_ms`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from fakes import CostStep, VirtualTime, timed_state
from test_ladder import FAST, _run

from speedkit.data.source import BatchSource
from speedkit.handle import Handle, set_attr
from speedkit.rungs.base import Rung


class ProducingSource(BatchSource):
    """Its loader's batches, made in the background one every ``period_s`` of virtual time from when
    an iterator is made, up to ``capacity`` ready at once: a batch read while one is ready costs
    ``read_s`` (taking it: 1 ms for a large batch from data_path's ring), else the reader waits (virtual
    time passes) until the next is made."""

    def __init__(self, inner: BatchSource, time: VirtualTime, period_s: float, capacity: int, read_s: float = 0.0) -> None:
        super().__init__(inner.loader, inner.device)
        self.time, self.period_s, self.capacity, self.read_s = time, period_s, capacity, read_s

    def buffered_at_most(self) -> int:
        return self.capacity

    def workers(self) -> int:
        return 1  # one producer

    def iterator(self, epochs: int | None = None) -> Iterator[Any]:
        return self._served(super().iterator(epochs), self.time.now)  # its workers start now

    def _served(self, batches: Iterator[Any], began: float) -> Iterator[Any]:
        time, period, capacity = self.time, self.period_s, self.capacity
        ready, since = 0, began  # batches ready, and the virtual time the next one began

        def produced() -> None:
            nonlocal ready, since
            if ready >= capacity:
                since = time.now  # the workers wait for room: the next batch begins once one is read
                return
            made = math.floor((time.now - since) / period)
            if made:
                ready, since = min(capacity, ready + made), since + made * period

        for batch in batches:
            produced()
            if ready == 0:  # wait for the batch being made
                time.now = since = since + period
                ready = 1
            ready -= 1
            time.now += self.read_s
            yield batch


class FasterLoaderRung(Rung):
    """Replaces the data source by one whose workers are ten times faster (as data_path does for a
    hurried user's loader), with a deep buffer (its ring and prefetch queues)."""

    name = "faster_loader"

    def __init__(self, time: VirtualTime, period_s: float, capacity: int, read_s: float = 0.0) -> None:
        super().__init__()
        self.time, self.period_s, self.capacity, self.read_s = time, period_s, capacity, read_s

    def apply(self, state: Any) -> Handle:
        handle = Handle(self.name)
        source = ProducingSource(state.data, self.time, self.period_s, self.capacity, self.read_s)
        set_attr(handle, state, "data", source, f"workers making a batch every {self.period_s * 1e3:.0f} ms")
        return handle


class ContendedSource(ProducingSource):
    """A loader whose workers make a batch every ``period_s`` while the reader only waits for batches,
    and every ``busy_period_s`` while the reader's step runs (its host work contends with them, as the
    fit's does): read back to back it keeps ``period_s``; under steps it keeps less."""

    def __init__(self, inner: BatchSource, time: VirtualTime, period_s: float, busy_period_s: float, capacity: int) -> None:
        super().__init__(inner, time, period_s, capacity)
        self.busy_period_s = busy_period_s

    def _served(self, batches: Iterator[Any], began: float) -> Iterator[Any]:
        time, ready, left = self.time, 0.0, began  # batches ready (a fraction: one being made), when last read
        for batch in batches:
            ready = min(float(self.capacity), ready + (time.now - left) / self.busy_period_s)  # made while away
            if ready < 1.0:  # wait, the reader idle: the rest of the batch at the unhindered period
                time.now += (1.0 - ready) * self.period_s
                ready = 1.0
            ready -= 1.0
            left = time.now
            yield batch


class ContendedLoaderRung(FasterLoaderRung):
    name = "faster_loader"

    def __init__(self, time: VirtualTime, period_s: float, busy_period_s: float, capacity: int) -> None:
        super().__init__(time, period_s, capacity)
        self.busy_period_s = busy_period_s

    def apply(self, state: Any) -> Handle:
        handle = Handle(self.name)
        source = ContendedSource(state.data, self.time, self.period_s, self.busy_period_s, self.capacity)
        set_attr(handle, state, "data", source, "workers slowed by the step's host work")
        return handle


def test_a_loader_slowed_by_the_steps_host_work_is_timed_at_the_pace_it_keeps_under_them():
    """The faster loader makes a batch every 40 ms read back to back (its pace alone), every 50 ms while
    a 20-ms step runs: in steady state a step takes 20 ms and waits 24 (0.4 of a batch made meanwhile),
    44 ms. Its 60-batch queue, filled while the baseline's windows ran, is read away before its windows:
    they are timed at 44 ms, as the fit runs it, not at the 40 of its pace alone (on an H100 a data_path
    ResNet-18 was timed at its loader's 45.9 ms alone and ran 51.2 in the fit)."""
    from conftest import mlp_state

    time = VirtualTime()
    state = mlp_state()
    state.step = CostStep(state.step, time, 0.02)
    state.data = ProducingSource(state.data, time, period_s=0.4, capacity=2)  # the user's loader: 400 ms a batch
    rung = ContendedLoaderRung(time, period_s=0.04, busy_period_s=0.05, capacity=60)
    _, result = _run(state, [rung], time, **{**FAST, "steps": 5})
    (entry,) = [r for r in result.rungs if r.name == "faster_loader"]
    assert entry.status == "kept"
    assert entry.measurement is not None and entry.measurement.step_ms == pytest.approx(44, rel=0.03)
    assert result.figures()["rungs"]["faster_loader"]["speedup"] == pytest.approx(400 / 44, rel=0.05)


@pytest.mark.parametrize("read_ms", [0.0, 1.5])  # 1.5: each batch taken from the buffer costs that (a ring's)
def test_a_loader_bound_configuration_is_timed_at_its_loaders_pace(read_ms):
    from conftest import mlp_state

    time = VirtualTime()
    state = mlp_state()
    state.step = CostStep(state.step, time, 0.02)  # the step's compute: 20 ms
    state.data = ProducingSource(state.data, time, period_s=0.4, capacity=2)  # the user's loader: 400 ms a batch
    rung = FasterLoaderRung(time, period_s=0.04, capacity=60, read_s=read_ms / 1e3)  # 40 ms a batch, 60 ready at most
    _, result = _run(state, [rung], time, **{**FAST, "steps": 5})
    (entry,) = [r for r in result.rungs if r.name == "faster_loader"]
    assert entry.status == "kept"  # ten times the loader: kept whatever the clock says
    # in steady state every step waits for the loader's 40 ms: the figure kept says so, and the gain is
    # the loaders' ratio, not the buffer's
    assert entry.measurement is not None and entry.measurement.step_ms == pytest.approx(40, rel=0.05)
    assert result.figures()["rungs"]["faster_loader"]["speedup"] == pytest.approx(10, rel=0.05)
    from speedkit.report.markdown import render_markdown

    paces = sorted(p["ms_per_batch"] for p in result.run["loader_pace"])  # each source's, measured once
    assert paces == pytest.approx([40.0, 400.0], rel=0.05)
    md = render_markdown(result.to_dict())
    assert "ms a batch (read alone" in md and "measured once" in md


def test_a_step_made_faster_than_its_loader_is_timed_at_the_loaders_pace():
    """One source for both configurations: the slow steps of A let its workers fill their queues, which
    B's fast steps would otherwise read without waiting."""
    from test_ladder import SpeedRung

    time = VirtualTime()
    state = timed_state(time, base=0.1)  # 100 ms a step
    state.data = ProducingSource(state.data, time, period_s=0.04, capacity=16)  # 40 ms a batch, 16 ahead
    rung = SpeedRung("faster_step", time, 0.1, -0.8)  # 20 ms a step: the loader's 40 ms now binds
    _, result = _run(state, [rung], time, **{**FAST, "steps": 5})
    (entry,) = [r for r in result.rungs if r.name == "faster_step"]
    assert entry.status == "kept"
    assert result.baseline.measurement.step_ms == pytest.approx(100, rel=0.05)
    assert entry.measurement is not None and entry.measurement.step_ms == pytest.approx(40, rel=0.05)


def test_a_step_slower_than_its_loader_keeps_its_own_time():
    """Reading the buffer before each window costs the windows nothing where the loader keeps ahead."""
    from test_ladder import SpeedRung

    time = VirtualTime()
    state = timed_state(time, base=0.1)
    state.data = ProducingSource(state.data, time, period_s=0.01, capacity=16)  # 10 ms a batch
    rung = SpeedRung("faster_step", time, 0.1, -0.5)  # 50 ms a step, still above the loader's pace
    _, result = _run(state, [rung], time, **{**FAST, "steps": 5})
    (entry,) = [r for r in result.rungs if r.name == "faster_step"]
    assert entry.measurement is not None and entry.measurement.step_ms == pytest.approx(50, rel=0.02)
    assert result.figures()["rungs"]["faster_step"]["speedup"] == pytest.approx(2, rel=0.02)


def test_what_a_source_can_hold_ahead():
    """A loader's workers times its prefetch factor; none without workers (nothing is read ahead)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from speedkit.data.source import BatchSource

    data = TensorDataset(torch.zeros(8, 2))
    assert BatchSource(DataLoader(data, batch_size=2), torch.device("cpu")).buffered_at_most() == 0
    assert BatchSource(DataLoader(data, batch_size=2, num_workers=2), torch.device("cpu")).buffered_at_most() == 4
    loader = DataLoader(data, batch_size=2, num_workers=1, prefetch_factor=5)
    assert BatchSource(loader, torch.device("cpu")).buffered_at_most() == 5


def test_the_stand_in_loader_serves_its_buffer_then_its_pace():
    """The stand-in above: after idling it serves what it made at once; read without pause behind a
    20 ms step, it settles at its 40 ms a batch."""
    from conftest import mlp_state

    time = VirtualTime()
    source = ProducingSource(mlp_state().data, time, period_s=0.04, capacity=60)
    batches = source.iterator()
    time.now += 10.0  # idle: the buffer fills to its capacity
    start = time.now
    for _ in range(60):
        next(batches)
    assert time.now == start  # 60 batches served from the buffer, no wait
    for _ in range(200):  # then each read waits for the next batch, behind a 20 ms step
        time.now += 0.02
        next(batches)
    assert (time.now - start) / 200 == pytest.approx(0.04, rel=0.02)


class InOrderWorkersSource(BatchSource):
    """A DataLoader's workers as they deliver: ``workers`` processes, batch k made by worker k mod
    ``workers`` in ``batch_s(k)`` of virtual time, at most ``workers * prefetch`` batches asked for
    ahead of the reader, delivered in order. Batches whose times vary finish out of order: a reader
    that waits for a slow one then finds the ones behind it made meanwhile (a burst)."""

    def __init__(self, inner: BatchSource, time: VirtualTime, workers: int, prefetch: int, batch_s: Any) -> None:
        super().__init__(inner.loader, inner.device)
        self.time, self._workers, self.prefetch, self.batch_s = time, workers, prefetch, batch_s

    def buffered_at_most(self) -> int:
        return self._workers * self.prefetch

    def workers(self) -> int:
        return self._workers

    def iterator(self, epochs: int | None = None) -> Iterator[Any]:
        return self._served(super().iterator(epochs), self.time.now)

    def _served(self, batches: Iterator[Any], began: float) -> Iterator[Any]:
        time, n, ahead = self.time, self._workers, self._workers * self.prefetch
        finish: list[float] = []  # when batch k is made
        read: list[float] = []  # when batch k was read

        def made(k: int) -> float:
            while len(finish) <= k:
                j = len(finish)
                asked = began if j < ahead else read[j - ahead]  # asked for once batch j - ahead was read
                free = finish[j - n] if j >= n else began  # its worker is free once it made its last one
                finish.append(max(asked, free) + self.batch_s(j))
            return finish[k]

        for k, batch in enumerate(batches):
            time.now = max(time.now, made(k))
            read.append(time.now)
            made(k + ahead)  # asked for now: its start is fixed by this read
            yield batch


def test_a_loader_whose_workers_finish_out_of_order_is_timed_at_its_pace():
    """14 workers, each batch 280 to 840 ms (560 on average; read behind a 20 ms step the loader sustains
    40.1 ms a batch), prefetch 2: a read that waits for a slow batch finds the next ones made meanwhile.
    Every window must run near the loader's pace, not on such a burst nor on a wait for a round. On an
    H200 data_path's ResNet-18 (14 workers, 41.8 ms a batch) timed 3-step windows between 13.6 and
    27.8 ms, its fit 35.3 ms (bench/results/2026-11-29_h200_zoo_runs_d906ded). Reading the buffer away
    before windows read 20 to 147 ms here; windows of a round of workers after it, 37 to 61 ms."""
    from conftest import mlp_state

    time = VirtualTime()
    state = mlp_state()
    state.step = CostStep(state.step, time, 0.02)
    state.data = ProducingSource(state.data, time, period_s=0.4, capacity=2)

    class WorkersRung(Rung):
        name = "faster_loader"

        def apply(self, state: Any) -> Handle:
            handle = Handle(self.name)
            set_attr(handle, state, "data", InOrderWorkersSource(state.data, time, 14, 2, _varied_batch_s), "14 workers")
            return handle

    _, result = _run(state, [WorkersRung()], time, **{**FAST, "steps": 3})
    (entry,) = [r for r in result.rungs if r.name == "faster_loader"]
    assert entry.measurement is not None
    assert all(w == pytest.approx(40.1, rel=0.2) for w in entry.measurement.window_ms), entry.measurement.window_ms


def _varied_batch_s(k: int) -> float:
    """A batch's time for one of 14 workers: 280 to 840 ms, 560 on average."""
    return 0.56 * (0.5, 1.5, 1.0, 0.75, 1.25)[(k * 7) % 5]


def test_the_in_order_stand_in_sustains_its_workers_pace():
    """The stand-in above, read behind a 20 ms step: 40.1 ms a batch in steady state."""
    from conftest import mlp_state

    time = VirtualTime()
    batches = InOrderWorkersSource(mlp_state().data, time, 14, 2, _varied_batch_s).iterator()
    for _ in range(200):
        next(batches)
        time.now += 0.02
    start = time.now
    for _ in range(1000):
        next(batches)
        time.now += 0.02
    assert (time.now - start) / 1000 == pytest.approx(0.0401, rel=0.01)


def test_across_several_processes_the_pace_is_read_alone_without_steps():
    """Under DDP each rank would stop reading its queues at its own step, and the steps' all-reduces would
    wait for each other: the pace under steps is not measured there (no step runs), the pace read alone
    stands, and the report says why."""
    from conftest import mlp_state

    from speedkit.engine.timing import Timing

    time = VirtualTime()
    state = mlp_state()
    state.step = CostStep(state.step, time, 0.02)
    state.step.world_size = lambda: 2  # as a rank of two sees it
    source = ContendedSource(state.data, time, period_s=0.04, busy_period_s=0.05, capacity=6)
    state.data = source
    before = time.steps
    timing = Timing.__new__(Timing)  # only what the pace reads
    timing.state, timing.host_clock, timing.poll = state, time, lambda: None
    out = timing.pace_under_steps(source, source.iterator(), 40.0, 3)
    assert out["loader_bound"] is False and "several processes" in out["note"]
    assert time.steps == before  # no step ran
