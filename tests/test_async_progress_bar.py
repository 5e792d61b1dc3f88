"""async_progress_bar: per-step progress-bar values read late without a host sync (speedkit.training.lagged_scalars),
bound into Lightning's result collections (speedkit.compat), as a rung."""

from __future__ import annotations

import types

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.trainer.connectors.logger_connector import result as lightning_result
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedkit import compat, rungs
from speedkit.rungs.async_progress_bar import AsyncProgressBarRung, logs_to_progress_bar
from speedkit.training.lagged_scalars import LaggedScalars
from speedkit.training.state import TrainState


class FakeCopies:
    """Copies that finish only when the test says so; each remembers its value."""

    def __init__(self) -> None:
        self.started: list[dict] = []

    def __call__(self, value: torch.Tensor):
        copy = {"host": value.detach().clone(), "done": False, "waited": False}
        self.started.append(copy)

        def wait() -> None:
            copy["waited"] = copy["done"] = True

        return copy["host"], lambda: copy["done"], wait


class OnDevice(torch.Tensor):
    """A CPU scalar that says it is on a CUDA device (so LaggedScalars copies it instead of reading it)."""

    @property
    def device(self):  # type: ignore[override]
        return torch.device("cuda", 0)


def on_device(x: float) -> torch.Tensor:
    return torch.tensor(x).as_subclass(OnDevice)


def test_values_are_shown_once_their_copy_is_done_and_never_more_than_lag_copies_wait():
    copies = FakeCopies()
    lagged = LaggedScalars(lag=2, start_copy=copies)
    assert lagged.read("loss", on_device(1.0)) is None  # nothing finished yet: nothing to show
    assert lagged.read("loss", on_device(2.0)) is None
    copies.started[0]["done"] = True
    assert lagged.read("loss", on_device(3.0)) == 1.0  # the newest finished, no wait
    assert lagged.waits == 0 and not any(c["waited"] for c in copies.started)
    assert lagged.read("loss", on_device(4.0)) == 2.0  # three outstanding (2, 3, 4) > lag: the oldest waited for
    assert lagged.waits == 1 and copies.started[1]["waited"] and not copies.started[2]["waited"]
    copies.started[2]["done"] = copies.started[3]["done"] = True
    assert lagged.read("loss", on_device(5.0)) == 4.0  # every finished one taken, the newest shown
    again = on_device(6.0)
    assert lagged.read("loss", again) == 4.0 and lagged.read("loss", again) == 4.0  # read twice, copied once
    assert len(copies.started) == 6
    assert lagged.flush() == {"loss": 6.0} and copies.started[4]["waited"] and copies.started[5]["waited"]
    assert lagged.reads == 7


def test_names_are_kept_apart_values_off_the_gpu_are_read_at_once_and_convert_leaves_out_unfinished():
    copies = FakeCopies()
    lagged = LaggedScalars(lag=1, start_copy=copies)
    out = lagged.convert({"loss": on_device(0.5), "acc": torch.tensor(0.25), "step": 7})
    assert out == {"acc": 0.25, "step": 7}  # loss has no finished copy yet; a CPU tensor needs no copy
    copies.started[0]["done"] = True
    out = lagged.convert({"loss": on_device(0.75), "acc": torch.tensor(0.5)})
    assert out == {"loss": 0.5, "acc": 0.5} and len(copies.started) == 2
    assert lagged.flush() == {"loss": 0.75, "acc": 0.5}
    with pytest.raises(ValueError, match="lag"):
        LaggedScalars(lag=0)


class Logs(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)
        self.log("twice", 2 * loss, prog_bar=True, on_step=True, on_epoch=True)
        self.log("quiet", 3 * loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.layer(batch[0]), batch[1]), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=8)


def _trainer(callbacks, **kwargs):
    settings = dict(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**settings, **kwargs}, callbacks=callbacks)


def test_lightning_hands_the_training_steps_progress_bar_tensors_to_the_converter_and_gets_its_way_back():
    """Only the given Trainer's training collection; another Trainer fitting meanwhile is left alone."""
    original = lightning_result._ResultCollection.__dict__["metrics"]
    seen: list[dict] = []

    def convert(values):
        seen.append(dict(values))
        return {name: ("shown", float(v)) for name, v in values.items()}

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.last = dict(trainer.progress_bar_metrics)

    watch = Watch()
    trainer = _trainer([watch], limit_val_batches=2, val_check_interval=5)
    restore = compat.lightning_step_progress_bar(trainer, convert)
    try:
        other = _trainer([])
        other.fit(Logs())  # another Trainer meanwhile: Lightning's own conversion
        assert isinstance(other.progress_bar_metrics["loss"], float) and not seen
        trainer.fit(Logs())
    finally:
        restore()
    assert lightning_result._ResultCollection.__dict__["metrics"] is original
    assert seen and all(set(s) == {"loss", "twice_step"} for s in seen)  # step values of the prog_bar logs only
    assert all(isinstance(v, torch.Tensor) for s in seen for v in s.values())  # no .item() before the converter
    assert watch.last["loss"][0] == "shown" and watch.last["twice_step"][0] == "shown"
    assert (
        lightning_result.convert_tensors_to_scalars is not None
        and lightning_result.convert_tensors_to_scalars(torch.tensor(1.5)) == 1.5
    )  # Lightning's own conversion is back in place

    # restored: a fit converts as Lightning does
    trainer = _trainer([])
    trainer.fit(Logs())
    assert isinstance(trainer.progress_bar_metrics["loss"], float)


def test_epoch_and_validation_values_keep_lightnings_conversion():
    trainer = _trainer([], max_epochs=1, max_steps=-1, limit_val_batches=2)
    restore = compat.lightning_step_progress_bar(trainer, lambda values: {name: "lagged" for name in values})
    try:
        trainer.fit(Logs())
    finally:
        restore()
    bar = trainer.progress_bar_metrics
    assert bar["loss"] == "lagged" and bar["twice_step"] == "lagged"
    assert isinstance(bar["twice_epoch"], float) and isinstance(bar["val_loss"], float)


def _state(model, device="cuda", trainer=True):
    step = (
        types.SimpleNamespace(trainer=types.SimpleNamespace(_logger_connector=types.SimpleNamespace(_progress_bar_metrics={})))
        if trainer
        else types.SimpleNamespace(trainer=None)
    )  # Step.trainer: None outside Lightning
    return TrainState(model=model, optimizer=None, device=torch.device(device), step=step, precision="fp32")


def test_the_rung_says_why_it_does_not_apply():
    rung = rungs.make("async_progress_bar")
    assert isinstance(rung, AsyncProgressBarRung)
    assert "not a Lightning fit" in rung.check(_state(nn.Linear(2, 2), trainer=False))
    assert "on cpu reading a logged value waits for no device" in rung.check(_state(Logs(), device="cpu"))

    class Silent(pl.LightningModule):
        def training_step(self, batch, batch_idx):
            self.log("loss", batch.sum())
            return batch.sum()

    assert "Silent never passes prog_bar" in rung.check(_state(Silent()))
    assert logs_to_progress_bar(Logs()) is True
    assert rung.check(_state(Logs())) is None
    with pytest.raises(ValueError, match="lag must be >= 1"):
        rungs.make({"name": "async_progress_bar", "options": {"lag": 0}})


def test_in_a_fit_the_rung_shows_lagged_values_switches_off_and_on_and_leaves_exact_values_after_undo(monkeypatch):
    """The CPU's values copied by fake copies that finish when the test says (none here: only lag-bound waits)."""
    copies = FakeCopies()
    monkeypatch.setattr(
        "speedkit.rungs.async_progress_bar.LaggedScalars", lambda lag: LaggedScalars(lag, start_copy=copies, devices=("cpu",))
    )
    original = lightning_result._ResultCollection.__dict__["metrics"]
    shown: list[dict] = []
    handles = []

    class Apply(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            state = TrainState(
                model=pl_module,
                optimizer=None,
                device=torch.device("cuda"),
                step=types.SimpleNamespace(trainer=trainer),
                precision="fp32",
            )
            handles.append(AsyncProgressBarRung().apply(state))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            shown.append(dict(trainer.progress_bar_metrics))
            if batch_idx == 1:  # a trial's switch: off (Lightning's way) and on again
                handles[0].suspend()
                assert lightning_result._ResultCollection.__dict__["metrics"] is original
                handles[0].resume()

        def on_train_end(self, trainer, pl_module):
            handles[0].undo()

    trainer = _trainer([Apply()])
    model = Logs()
    trainer.fit(model)
    assert lightning_result._ResultCollection.__dict__["metrics"] is original
    assert shown[0] == {}  # the first step's copy had not finished: nothing shown yet, and no wait
    # one copy per value and step (reading a step's values again starts none), and once more for the step whose
    # values were read again after the switch off and on; lag 2 bounds what is outstanding (the fakes never finish)
    assert len(copies.started) == 2 * 5 + 2 and sum(c["waited"] for c in copies.started) > 0
    exact = [float(c["host"]) for c in copies.started[-2:]]
    assert trainer.progress_bar_metrics["loss"] == exact[0] and trainer.progress_bar_metrics["twice_step"] == exact[1]
    assert handles[0].changes and "up to 2 steps late" in handles[0].changes[0]


def test_the_trials_scratch_collection_in_the_fit_loops_place_is_converted_too():
    """Trials log into a scratch collection put where the fit loop keeps its own: the rung's change is
    what the trials time."""
    seen: list[dict] = []
    trainer = _trainer([], max_steps=1)

    class Trial(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            with compat.lightning_trial_logging(trainer, pl_module) as log:
                assert log is not None
                log.batch(torch.zeros(4, 6))
                pl_module.log("trial_loss", torch.tensor(0.5), prog_bar=True)
                log.step_done()

    trainer.callbacks.append(Trial())
    restore = compat.lightning_step_progress_bar(trainer, lambda values: seen.append(dict(values)) or {})
    try:
        trainer.fit(Logs())
    finally:
        restore()
    assert seen[0].keys() == {"trial_loss"} and isinstance(seen[0]["trial_loss"], torch.Tensor)
