"""micro_batch on a CUDA device: in a Lightning fit with gradient accumulation, the merged
micro-batches, captured in one CUDA graph per optimizer step (cuda_graph takes a step whose
micro-batches merge into one), train to the parameters of the plain accumulation (fp32)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from speedkit.cudagraph import graphed_step as graph
from speedkit.lightning import SpeedLadder

pytestmark = pytest.mark.gpu

SAMPLES, BATCH, WIDTH = 1024, 16, 64


class LitMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 8))
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # a hook the loop runs after replays too (no host
        self.sizes.append(len(batch[0]))  # work in training_step: a graph would refuse it)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, capturable=True)


def _fit(callbacks) -> LitMLP:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, WIDTH, generator=g), torch.randint(0, 8, (SAMPLES,), generator=g))
    module = LitMLP()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=12,
        accumulate_grad_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=BATCH))
    assert trainer.global_step == 12 and trainer.accumulate_grad_batches == 4
    return module


def test_merged_micro_batches_in_one_cuda_graph_train_as_the_accumulation(monkeypatch):
    graphs: list[graph.GraphedStep] = []
    init = graph.GraphedStep.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        graphs.append(self)

    monkeypatch.setattr(graph.GraphedStep, "__init__", record)
    ref = _fit([])
    ladder = SpeedLadder(rungs=[{"name": "micro_batch", "options": {"factor": 4}}, "cuda_graph"], trials=False)
    got = _fit([ladder])
    assert {"micro_batch", "cuda_graph"} <= set(ladder.applied_changes), ladder.skipped
    assert set(got.sizes) == {4 * BATCH} and set(ref.sizes) == {BATCH}  # the fit loop's batches: merged
    assert graphs and graphs[-1].replays > 0, [g.report() for g in graphs]
    for a, b in zip(got.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
