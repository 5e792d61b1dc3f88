"""The out-of-memory fallback on a real CUDA allocator: memory capped with
``torch.cuda.set_per_process_memory_fraction`` so that the batch does not fit, a Lightning fit with
OOMFallback trains to the end with the losses of the uncapped fit (fp32, no dropout)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from speedkit.lightning import OOMFallback

pytestmark = pytest.mark.gpu

# activations dominate the peak (the cap is set between the weights' share and the whole batch's):
# 8192 x 1024 floats are 34 MB a tensor, two kept per layer, about 0.55 GB a batch against 34 MB of weights
BATCH, WIDTH, DEPTH, STEPS = 8192, 1024, 8, 12


class WideMLP(pl.LightningModule):
    """Activations of 2 x BATCH x WIDTH x DEPTH floats (about 0.55 GB a batch), weights of DEPTH x WIDTH²."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, 10)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.layers(x)), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(BATCH * STEPS, WIDTH, generator=g),
                                          torch.randint(0, 10, (BATCH * STEPS,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def _fit(callbacks) -> WideMLP:
    torch.manual_seed(0)
    module = WideMLP()
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=_loader())
    assert trainer.global_step == STEPS
    return module


def test_a_batch_that_does_not_fit_trains_to_the_end_with_the_uncapped_losses():
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    uncapped = _fit([])
    peak = torch.cuda.max_memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    # room for the weights, their gradients and the SGD step, and about a quarter of the batch's activations
    weights = sum(p.numel() * p.element_size() for p in uncapped.parameters())
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((3 * weights + (peak - 3 * weights) * 0.35) / total)
    try:
        fallback = OOMFallback()
        capped = _fit([fallback])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert fallback.events and fallback.fallback.parts >= 2, "the cap did not bite: nothing was split"
    assert len(capped.losses) == len(uncapped.losses) == STEPS
    for step, (a, b) in enumerate(zip(capped.losses, uncapped.losses)):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b, [e.describe() for e in fallback.events])
