"""Activation checkpointing (``torch.utils.checkpoint``) through the compile rung on a CPU: a checkpointed
model keeps compile by measurement and trains as with compile given by hand; the reentrant form
compiles too, its graphs and breaks reported (issue 57). The Hugging Face switch is in the zoo's ``hf-llama-ckpt``
(tests/test_zoo.py); CUDA graphs of checkpointed steps in tests/test_cuda_graph_gpu.py."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from test_manual_optimization import QUICK as MANUAL_QUICK
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from speedkit.lightning import SpeedLadder

#: the manual-optimization tests' settings; a second warm-up step (Inductor's first calls), and compile
#: judged alone, not as the floor of the user's switches
QUICK = {**MANUAL_QUICK, "warmup": 2, "switches_floor": False}


class Block(nn.Module):
    """A linear layer and a GELU written out by hand (tanh form), then a scaled residual: ten
    element-wise ops that eager runs one by one and Inductor fuses into one loop."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * h * h * h)))
        return x + 0.5 * h


class Checkpointed(pl.LightningModule):
    """Every block recomputed in the backward (``checkpoint(block, x)``), as memory-bound users write it."""

    def __init__(self, reentrant: bool = False, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)  # the checkpointed blocks' input needs gradients (a reentrant one needs it)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.reentrant = reentrant
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(256, width, generator=g), torch.randn(256, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16, shuffle=True)


def _fit(ladder: SpeedLadder, reentrant: bool = False, max_steps: int = 4) -> tuple[Checkpointed, list[float]]:
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    pl.seed_everything(0, verbose=False)
    model = Checkpointed(reentrant)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ladder, Losses()],
    )
    trainer.fit(model)
    return model, losses


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_checkpointed_model_keeps_compile_and_trains_as_with_it_given_by_hand():
    ladder = SpeedLadder(rungs=["compile"], trials="always", measure=QUICK, cache=False)
    _, losses = _fit(ladder)
    entry = next(r for r in ladder.result.rungs if r.name == "compile")
    assert entry.status == "kept", entry.reason
    assert entry.parity.passed and ladder.result.figures()["rungs"]["compile"]["speedup"] > 1.0
    assert "graph breaks: none" in entry.changes, entry.changes  # the recomputation is traced with the blocks
    assert any(line.startswith("ran Checkpointed.forward: ") for line in entry.changes)
    torch._dynamo.reset()
    by_hand = SpeedLadder(rungs=["compile"])
    _, replayed = _fit(by_hand)
    assert losses == pytest.approx(replayed, rel=1e-6) and len(losses) == 4


def test_a_reentrant_checkpoint_is_compiled_too_and_what_dynamo_did_is_reported():
    """The reentrant form (an autograd.Function whose backward runs the forward again): Dynamo traces
    it (torch 2.14; a version that cannot breaks the graph there, and the report names the break);
    compile applies, numerics as eager, its graphs and breaks reported."""
    ladder = SpeedLadder(
        rungs=[{"name": "compile", "options": {"backend": "eager"}}], trials="always", measure=QUICK, cache=False
    )
    _fit(ladder, reentrant=True, max_steps=2)
    entry = next(r for r in ladder.result.rungs if r.name == "compile")
    assert entry.status in ("kept", "reverted") and entry.parity.passed, entry.reason
    ran = [line for line in entry.changes if line.startswith("ran Checkpointed.forward: ")]
    assert ran and " 0 graphs compiled" not in ran[0], entry.changes
    assert any(line.startswith("graph breaks:") for line in entry.changes), entry.changes
