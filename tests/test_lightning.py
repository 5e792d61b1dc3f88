"""SpeedLadder inside a real (CPU) Lightning Trainer: applies, respects user choices, undoes."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from speedkit.demos import NaiveGPT, SyntheticTokens
from speedkit.errors import ConfigError
from speedkit.lightning import SpeedLadder, StepTimer
from speedkit.rungs.compile import GuardedForward


class Probe(pl.Callback):
    """Records what the run looked like while training."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.precision_plugin = type(trainer.strategy.precision_plugin).__name__
            self.precision = trainer.precision
            self.forward = pl_module.__dict__.get("forward")
            self.fused = trainer.optimizers[0].param_groups[0].get("fused")
            self.matmul = torch.get_float32_matmul_precision()


def _trainer(callbacks, **kwargs):
    return pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)


def _fit(rungs, **trainer_kwargs):
    torch.manual_seed(0)
    model = NaiveGPT("tiny")
    ladder, probe = SpeedLadder(rungs=rungs), Probe()
    trainer = _trainer([ladder, probe], **trainer_kwargs)
    trainer.fit(model, datamodule=SyntheticTokens(batch_size=2, seq_len=16, length=64))
    return model, trainer, ladder, probe


def test_rungs_apply_during_fit_and_are_undone_after():
    matmul_before = torch.get_float32_matmul_precision()
    model, trainer, ladder, probe = _fit(["autocast", "fused_optimizer", {"name": "compile", "options": {"backend": "eager"}}])
    if "autocast" not in ladder.skipped:
        assert probe.precision_plugin == "MixedPrecision" and probe.precision == "bf16-mixed"
    assert probe.fused is True
    assert isinstance(probe.forward, GuardedForward)
    # after fit: everything as the user had it
    assert "forward" not in model.__dict__
    assert type(trainer.strategy.precision_plugin).__name__ == "Precision"
    assert trainer.optimizers[0].param_groups[0]["fused"] is None
    assert torch.get_float32_matmul_precision() == matmul_before
    assert set(ladder.state_dict()["applied"]) >= {"fused_optimizer", "compile"}


def test_user_precision_is_left_alone():
    model, trainer, ladder, probe = _fit(["autocast"], precision="bf16-mixed")
    assert "bf16-mixed" in ladder.skipped["autocast"]
    assert probe.precision == "bf16-mixed"


def test_user_compile_is_left_alone():
    """A model passed as trainer.fit(torch.compile(model)) carries Lightning's compile context."""
    from lightning.pytorch.utilities.compile import from_compiled

    from speedkit.rungs import make
    from speedkit.state import TrainState

    model = from_compiled(torch.compile(NaiveGPT("tiny"), backend="eager"))
    state = TrainState(model=model, optimizer=None, device=torch.device("cpu"))
    reason = make("compile").check_lightning(None, model, state)
    assert "compiled by the user" in reason


def test_state_dict_round_trip_tolerates_missing_keys():
    ladder = SpeedLadder(rungs=["tf32"])
    ladder.load_state_dict({})
    ladder.load_state_dict({"skipped": {"tf32": "no GPU"}, "future_key": 1})
    assert ladder.state_dict()["skipped"] == {"tf32": "no GPU"}


def test_bad_rungs_fail_at_construction():
    with pytest.raises(ConfigError, match=r"rungs\[0\]"):
        SpeedLadder(rungs=["warp_drive"])


def test_step_timer_times_windows_after_warmup():
    torch.manual_seed(0)
    timer = StepTimer(warmup=2, window=3)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2 + 3 * 2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(NaiveGPT("tiny"), datamodule=SyntheticTokens(batch_size=2, seq_len=16, length=64))
    assert len(timer.windows_ms) == 2 and timer.step_ms > 0
    assert timer.items_per_step == 32 and timer.throughput_unit == "tokens/s"
    assert timer._clock.syncs == 2
