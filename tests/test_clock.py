"""The step clock: exact step times from a fake clock, and no per-step synchronization."""

from __future__ import annotations

import pytest
import torch

from speedkit.measure import StepClock, summarize


class FakeDeviceBackend:
    """Marks are integers of a fake device timeline; counts host waits like CUDA events would."""

    name = "fake"

    def __init__(self, step_ms):
        self.step_ms = list(step_ms)
        self.now = 0.0
        self.marks = 0
        self.waits = 0

    def mark(self):
        t = self.now
        if self.marks < len(self.step_ms):
            self.now += self.step_ms[self.marks]
        self.marks += 1
        return t

    def synchronize(self, mark):
        self.waits += 1

    def elapsed_ms(self, a, b):
        return b - a


def test_window_returns_each_step_time_exactly():
    backend = FakeDeviceBackend([2.0, 3.0, 5.0, 7.0])
    clock = StepClock(torch.device("cpu"), backend=backend)
    clock.start()
    for _ in range(3):
        clock.step()
    assert clock.stop() == [2.0, 3.0, 5.0]


@pytest.mark.parametrize("steps", [1, 10, 500])
def test_no_synchronization_per_step(steps):
    backend = FakeDeviceBackend([1.0] * (steps + 1))
    clock = StepClock(torch.device("cpu"), backend=backend)
    clock.start()
    for _ in range(steps):
        clock.step()
        assert backend.waits == 0, "the clock waited for the device inside a window"
    clock.stop()
    assert backend.waits == 1 and clock.syncs == 1


def test_ladder_measurement_waits_once_per_window(monkeypatch):
    """The ladder's whole measurement path (warm-up + windows) syncs once per timed window. The host
    clock counts too (a microsecond a reading): on the wall clock, a busy machine made the parity
    reference's pace look like a slow step's, and the baseline took its short form (3 windows of 2)."""
    import itertools

    from conftest import mlp_state

    from speedkit.engine.ladder import Ladder

    state = mlp_state()
    host = itertools.count(0.0, 1e-6)
    ladder = Ladder(
        state,
        [],
        {"warmup": 1, "steps": 7, "repeats": 3, "parity_steps": 1, "telemetry": False},
        host_clock=lambda: next(host),
    )
    backend = FakeDeviceBackend([1.0] * 1000)
    ladder.clock = StepClock(torch.device("cpu"), backend=backend)
    result = ladder.run()
    assert backend.waits == 3
    assert backend.marks == 3 * (7 + 1)
    assert result.baseline.measurement.window_ms == [1.0, 1.0, 1.0]


def test_stop_without_steps_raises():
    clock = StepClock(torch.device("cpu"))
    clock.start()
    with pytest.raises(RuntimeError):
        clock.stop()


def test_cpu_uses_perf_counter():
    assert StepClock(torch.device("cpu")).name == "perf_counter"


def test_summarize_median_and_robust_noise():
    median, noise = summarize([10.0, 11.0, 9.0, 10.0, 30.0])
    assert median == 10.0
    # MAD = median(|0|,|1|,|1|,|0|,|20|) = 1 -> 1.4826 * 1 / 10; the 30 ms outlier does not swamp it
    assert noise == pytest.approx(0.14826)
    assert summarize([5.0]) == (5.0, 0.0)


def test_window_peak_adds_memory_the_allocator_peak_does_not_show(monkeypatch):
    """A CUDA graph's pool is reserved at capture and replays allocate nothing: the window's peak is
    the allocator's plus what ``memory_outside_peak`` reports (faked allocator, fake clock)."""
    from speedkit.measure.session import MeasureSession

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1_000)
    session = MeasureSession("cpu", clock=StepClock(torch.device("cpu"), backend=FakeDeviceBackend([1.0] * 20)))
    session._cuda = True  # the allocator calls are faked above
    assert session.window(lambda: None, 3).peak_memory_bytes == 1_000
    pool = {"bytes": 5_000}
    session.memory_outside_peak = lambda: pool["bytes"]
    assert session.window(lambda: None, 3).peak_memory_bytes == 6_000
    pool["bytes"] = 0  # the graph dropped (or its rung suspended): nothing outside the allocator
    assert session.window(lambda: None, 3).peak_memory_bytes == 1_000


def test_a_window_counts_the_graphs_torch_compile_compiled_in_it():
    """Real Dynamo (eager backend): a new shape recompiles inside the first windows, none after."""
    from speedkit.measure.session import MeasureSession

    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2 + 1, backend="eager")
    shapes = iter([3, 5, 7, 9, 11, 13])  # 3: the first graph; 5: one with a dynamic size; then no more
    session = MeasureSession("cpu", clock=StepClock(torch.device("cpu"), backend=FakeDeviceBackend([1.0] * 20)))
    session.warm(lambda: None, 0)

    def run_one():
        double(torch.ones(next(shapes)))

    assert [session.window(run_one, 2).compiled_graphs for _ in range(3)] == [2, 0, 0]
    session.begin_steps(1)  # the hook-driven path counts the same way
    session.batch_started()
    double(torch.ones(2, 2))  # another rank: a new graph
    assert session.batch_ended().compiled_graphs == 1
