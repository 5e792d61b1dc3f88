"""A small convolutional classifier (ResNet-style stages) for the data-bound image recipe."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(pl.LightningModule):
    """Four stages of two residual blocks (widths ``width`` x 1, 2, 4, 8), global pooling, a linear head.

    Args:
        classes: outputs of the head.
        width: channels of the first stage.
        lr: SGD learning rate (momentum 0.9).
        prog_bar: log the loss to the progress bar, as most scripts do (Lightning then turns it into a
            Python float after every step: a host sync on a GPU, with or without a progress bar shown).
    """

    def __init__(self, classes: int = 100, width: int = 32, lr: float = 0.05, prog_bar: bool = True) -> None:
        super().__init__()
        if classes < 1 or width < 1:
            raise ValueError(f"classes and width must be >= 1, found {classes}, {width}")
        self.lr, self.prog_bar = lr, prog_bar
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            blocks += [_Block(cin, cout, 1 if i == 0 else 2), _Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss, prog_bar=self.prog_bar)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
