"""SpeedProfiler and its engine StepMonitor: step times read late from marks the device passed (never
waited for), data wait, throughput, MFU from FLOPs counted in the fit's own first step, memory, the
monitor's own overhead; logged under speedkit/ through the Trainer's loggers; the fit trains as it
would without it (same parameters, same random numbers)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from speedkit.errors import ConfigError
from speedkit.lightning import SpeedProfiler
from speedkit.measure.monitor import StepMonitor


class LateMarks:
    """A device that finishes each mark ``lag`` marks after it was recorded, 10 ms apart."""

    def __init__(self, lag: int) -> None:
        self.lag, self.recorded, self.queries, self.waits = lag, 0, 0, 0

    def mark(self) -> int:
        self.recorded += 1
        return self.recorded

    def done(self, mark: int) -> bool:
        self.queries += 1
        return mark <= self.recorded - self.lag

    def elapsed_ms(self, start: int, end: int) -> float:
        return 10.0 * (end - start)


class CountingClock:
    def __init__(self, tick: float = 0.001) -> None:
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def test_step_times_are_read_late_from_marks_the_device_passed_never_waited_for():
    marks = LateMarks(lag=3)
    monitor = StepMonitor("cpu", marks=marks, host_clock=CountingClock(), flops_per_step=2 * 10**9, peak_tflops=1.0)
    for _ in range(20):
        monitor.step_started()
        monitor.step_ended(items=64, unit="samples/s")
    assert monitor.steps == 20
    assert len(monitor.all_step_ms) == 20 - 3 - 1  # 3 marks not passed yet; the first one starts the clock
    assert set(monitor.all_step_ms) == {10.0}
    m = monitor.metrics()
    assert m["step_ms"] == 10.0 and m["throughput"] == pytest.approx(6400.0)
    assert m["mfu"] == pytest.approx(0.2)  # 2 GFLOP per 10 ms = 0.2 TFLOP/s of a 1 TFLOP/s peak
    assert m["data_wait_ms"] > 0 and 0 < m["overhead_fraction"]
    summary = monitor.summary()
    assert summary["steps"] == 20 and summary["step_ms_median"] == 10.0 and summary["timed_steps"] == 16


def test_overhead_fraction_is_the_monitors_own_host_time_over_the_step():
    clock = CountingClock(tick=1e-6)  # each clock read one microsecond
    monitor = StepMonitor("cpu", marks=LateMarks(lag=0), host_clock=clock)
    for _ in range(100):
        monitor.step_started()
        monitor.step_ended(items=8)
    # a handful of clock reads per step (microseconds) against 10 ms steps
    assert monitor.overhead_fraction() < 0.001


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(callbacks, tmp_path, accumulate: int = 1, steps: int = 12):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g))
    module = Net()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=8))
    return module, trainer


def test_a_fit_logs_speedkit_figures_and_trains_as_the_fit_without(tmp_path):
    plain, _ = _fit([], tmp_path / "plain", accumulate=2)
    profiler = SpeedProfiler(peak_tflops=1.0, report_dir=tmp_path / "report")
    module, trainer = _fit([profiler], tmp_path / "profiled", accumulate=2)
    for a, b in zip(module.parameters(), plain.parameters()):  # no extra forward, no random number drawn
        assert torch.equal(a, b)
    rows = (tmp_path / "profiled" / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    for key in ("speedkit/step_ms", "speedkit/throughput", "speedkit/data_wait_ms", "speedkit/mfu", "speedkit/overhead_fraction"):
        assert key in header, header
    summary = profiler.summary
    assert summary is not None and summary["steps"] == 12 and summary["throughput_unit"] == "samples/s"
    # FLOPs of one optimizer step (2 per multiply-add): two micro-batches of 8 through Linear(16, 32) and
    # Linear(32, 4): forwards, the weights' gradients of both, the input gradient of the second only
    first, second = 2 * 8 * 16 * 32, 2 * 8 * 32 * 4
    assert summary["flops_per_step"] == 2 * (first + second + first + 2 * second)
    assert summary["mfu"] is not None and summary["mfu"] > 0
    written = json.loads((tmp_path / "report" / "speed_profile.json").read_text())
    assert written["schema_version"] == 1 and written["steps"] == 12


def test_given_flops_are_used_and_a_cpu_fit_needs_no_peak_to_run(tmp_path):
    profiler = SpeedProfiler(flops_per_step=10**6)
    _fit([profiler], tmp_path)
    assert profiler.summary["flops_per_step"] == 10**6
    assert profiler.summary["mfu"] is None and "no peak table for cpu" in profiler.summary["mfu_note"]


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"flops_per_step": -1}, "flops_per_step"),
        ({"throughput_unit": "images"}, "throughput_unit"),
        ({"report_dir": 3}, "report_dir"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_argument(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        SpeedProfiler(**kwargs)


class WideNet(Net):
    """Two 4096-wide layers on batches of 8192 in fp32: a step of about 14 ms on an H200, as the zoo's are
    (Lightning's demo Transformer's 17-20 ms); a callback's fixed host cost is a larger share of a shorter one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4))


@pytest.mark.gpu
def test_on_a_gpu_the_clock_never_synchronizes_and_costs_under_one_percent(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import traceback

    ours: list[str] = []
    real_sync, real_event_sync = torch.cuda.synchronize, torch.cuda.Event.synchronize

    def note(stack) -> None:  # a synchronization made from speedkit's monitor or callback
        frames = [f for f in stack if "speedkit/measure/monitor.py" in f.filename or "speed_profiler.py" in f.filename]
        if frames:
            ours.append(f"{frames[-1].filename}:{frames[-1].lineno}")

    def counting(*a, **k):
        note(traceback.extract_stack())
        return real_sync(*a, **k)

    def counting_event(self):
        note(traceback.extract_stack())
        return real_event_sync(self)

    monkeypatch.setattr(torch.cuda, "synchronize", counting)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counting_event)
    profiler = SpeedProfiler(log_every_n_steps=5)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8192 * 8, 4096), torch.randint(0, 4, (8192 * 8,)))
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=80,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[profiler],
    )
    trainer.fit(WideNet(), train_dataloaders=DataLoader(data, batch_size=8192, pin_memory=True))
    summary = profiler.summary
    assert summary["timed_steps"] >= 70 and summary["step_ms_median"] > 0
    assert summary["overhead_fraction"] < 0.01, summary
    assert summary["peak_memory_bytes"] > 0 and summary["mfu"] is not None and summary["mfu"] > 0
    assert not ours, ours
