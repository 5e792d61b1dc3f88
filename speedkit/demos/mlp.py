"""The launch-bound MLP of ANCHORS.md: 8 × (Linear 256→256, ReLU) + Linear 256→10, AdamW.

Each step launches dozens of tiny kernels; the GPU idles between them. What helps it is fewer
launches (fused optimizer, compile, CUDA graphs), not more FLOP/s.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class LaunchBoundMLP(pl.LightningModule):
    """Args: features (input width), hidden, depth (hidden Linear+ReLU layers), classes, lr."""

    def __init__(self, features: int = 256, hidden: int = 256, depth: int = 8, classes: int = 10, lr: float = 1e-3) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, found {depth}")
        self.save_hyperparameters()
        self.lr = lr
        layers: list[nn.Module] = []
        width = features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.net(x)
        return logits if y is None else F.cross_entropy(logits, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self(x, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
