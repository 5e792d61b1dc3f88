"""On a real GPU: every first rung applies and passes parity, the clock never syncs per step,
telemetry is sampled, and the Lightning callback swaps in Lightning's precision plugin."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt_state

from speedkit import rungs
from speedkit.ladder import Ladder
from speedkit.measure import StepClock

pytestmark = pytest.mark.gpu

FAST = {"warmup": 2, "steps": 5, "repeats": 3, "parity_steps": 3}


def test_all_first_rungs_apply_and_pass_parity_on_cuda():
    state = tiny_gpt_state(batch_size=8, seq_len=64, device="cuda")
    result = Ladder(state, rungs.make_all(["tf32", "autocast", "fused_optimizer", "compile"]), FAST).run()
    base = result.baseline.measurement
    assert base.clock == "cuda_events" and base.peak_memory_bytes > 0
    assert base.telemetry is not None and base.telemetry["samples"] >= 1
    assert result.flops["peak_tflops"] is not None and base.mfu is not None
    for r in result.rungs[1:]:
        assert r.status in ("kept", "reverted"), (r.name, r.status, r.reason)
        assert r.parity.passed, (r.name, r.parity)
    assert result.environment["gpu_name"]


def test_step_clock_waits_once_per_window_on_cuda(monkeypatch):
    calls = {"device_sync": 0}
    real = torch.cuda.synchronize

    def counting(*a, **k):
        calls["device_sync"] += 1
        return real(*a, **k)

    monkeypatch.setattr(torch.cuda, "synchronize", counting)
    clock = StepClock(torch.device("cuda"))
    x = torch.randn(1024, 1024, device="cuda")
    waits = []
    orig = clock.backend.synchronize
    clock.backend.synchronize = lambda mark: (waits.append(1), orig(mark))
    clock.start()
    for _ in range(50):
        x = x @ x.T / 1024
        clock.step()
    assert waits == [] and calls["device_sync"] == 0
    times = clock.stop()
    assert len(times) == 50 and all(t > 0 for t in times) and waits == [1]


def test_fused_optimizer_moves_step_counters_and_back_on_cuda():
    state = tiny_gpt_state(device="cuda")
    from speedkit.state import train_step

    for i, b in zip(range(2), state.batches()):
        train_step(state, b, i)
    p = next(state.model.parameters())
    assert state.optimizer.state[p]["step"].device.type == "cpu"
    handle = rungs.make("fused_optimizer").apply(state)
    assert state.optimizer.state[p]["step"].device.type == "cuda"
    train_step(state, next(state.batches()), 3)  # the fused kernel runs with the moved counters
    handle.undo()
    assert state.optimizer.state[p]["step"].device.type == "cpu"


def test_lightning_callback_uses_mixed_precision_plugin_on_cuda():
    import lightning.pytorch as pl

    from speedkit.demos import NaiveGPT, SyntheticTokens
    from speedkit.lightning import SpeedLadder, StepTimer

    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["plugin"] = type(trainer.strategy.precision_plugin).__name__
            seen["precision"] = trainer.precision

    ladder, timer = SpeedLadder(rungs=["tf32", "autocast", "fused_optimizer"]), StepTimer(warmup=2, window=3)
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[ladder, Probe(), timer])
    trainer.fit(NaiveGPT("tiny"), datamodule=SyntheticTokens(batch_size=4, seq_len=64, length=256))
    assert seen == {"plugin": "MixedPrecision", "precision": "bf16-mixed"}
    assert set(ladder.applied_changes) == {"tf32", "autocast", "fused_optimizer"}
    assert timer.step_ms > 0 and timer._clock.syncs == 2
    assert torch.get_float32_matmul_precision() == "highest"
