"""async_progress_bar on a real GPU: Lightning's per-step progress-bar conversion no longer syncs,
training computes what it computed, and the bar's values are exact once the fit ends."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedkit.lightning import SpeedLadder

pytestmark = pytest.mark.gpu


class Logs(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 4, (256,), generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        self.log("acc", (self.net(x).argmax(-1) == y).float().mean(), prog_bar=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(3))


class SyncCheck(pl.Callback):
    """Lightning's per-batch metric update (where progress-bar values are converted) run under CUDA's sync
    debug mode 'error' after the first steps; records whether it synced, and every step's loss as a tensor."""

    def __init__(self) -> None:
        self.synced: list[str] = []
        self.losses: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module):
        connector = trainer._logger_connector
        original = connector.on_batch_end

        def checked() -> None:
            if trainer.global_step < 3:
                return original()
            torch.cuda.set_sync_debug_mode("error")
            try:
                original()
            except RuntimeError as exc:
                self.synced.append(str(exc).splitlines()[0])
                torch.cuda.set_sync_debug_mode(0)
                original()
            finally:
                torch.cuda.set_sync_debug_mode(0)

        connector.on_batch_end = checked

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())


def _fit(callbacks):
    pl.seed_everything(0, verbose=False)
    model = Logs()
    check = SyncCheck()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[check, *callbacks],
    )
    trainer.fit(model)
    return model, trainer, check


def test_progress_bar_values_no_longer_sync_and_training_is_unchanged():
    from lightning.pytorch.trainer.connectors.logger_connector import result

    lightnings = result._ResultCollection.__dict__["metrics"]
    plain_model, plain, plain_check = _fit([])
    assert plain_check.synced, "Lightning's own per-step conversion should sync (the check would see nothing otherwise)"
    ladder = SpeedLadder(rungs=["async_progress_bar"])
    model, trainer, check = _fit([ladder])
    assert "async_progress_bar" in ladder.applied_changes, ladder.skipped
    assert check.synced == []
    assert torch.equal(torch.stack(check.losses), torch.stack(plain_check.losses))
    for a, b in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    # exact after the fit: the last step's values, as Lightning's own conversion leaves them
    assert trainer.progress_bar_metrics == plain.progress_bar_metrics
    assert result._ResultCollection.__dict__["metrics"] is lightnings  # Lightning's own conversion back after the fit
