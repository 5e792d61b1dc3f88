"""What a rung acts on: the model, its optimizer, the training step and where its batches come from.

:class:`TrainState` is plain PyTorch. Rungs change what it holds in place and reversibly, through
a :class:`~speedkit.handle.Handle`: flags and modules of the model, the optimizer's implementation,
``state.step`` (the :class:`~speedkit.training.step.Step` that runs one optimizer step, which a rung may
wrap) and ``state.data`` (the :class:`~speedkit.data.BatchSource` it is fed from, likewise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speedkit.config import loosest
from speedkit.data.source import BatchSource
from speedkit.training.step import PlainStep, Step


@dataclass
class TrainState:
    """The objects of a training run.

    Attributes:
        model: the module being trained (a LightningModule or any ``nn.Module``).
        optimizer: its optimizer; rungs keep this object and its parameter references alive.
        device: where the step runs.
        step: one optimizer step of training (plain PyTorch or the user's Lightning step);
            defaults to a :class:`~speedkit.training.step.PlainStep` over ``model`` and ``optimizer``.
        data: the batches the step is fed; ``None`` when batches are fed by hand.
        precision: the loosest numerics in effect ("fp32", "tf32", "fp16", "bf16"); sets the
            parity tolerance of the next rung. Defaults to what the step and torch's flags say.
        notes: free-form notes rungs leave for later rungs.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    step: Step = None  # type: ignore[assignment]  # None: a PlainStep over model and optimizer
    data: BatchSource | None = None
    precision: str = ""
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.step is None:
            self.step = PlainStep(self.model, self.optimizer, self.device)  # type: ignore[arg-type]
        if not self.precision:
            self.precision = current_numerics(self.step)

    def why_no_optimizer(self) -> str | None:
        """Why rungs that change the optimizer find none to change (None: :attr:`optimizer` is the one)."""
        if self.optimizer is None:
            return self.step.why_no_optimizer() or "the run has no optimizer"
        return self.step.why_no_optimizer()


def current_numerics(step: Step) -> str:
    """The numerics a run is in before any rung: the step's precision, TF32 if the user enabled it."""
    numerics = step.numerics
    if torch.get_float32_matmul_precision() != "highest":
        numerics = loosest(numerics, "tf32")
    return numerics
