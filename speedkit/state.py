"""What a rung acts on: the model, its optimizer, its data, and how one training step runs.

:class:`TrainState` is plain PyTorch. Rungs mutate the objects it holds (in place, reversibly) or
its step settings (autocast dtype, grad scaler). :func:`train_step` is the one definition of a
training step used by the ladder's trials and by :func:`speedkit.apply`'s handle; the Lightning
callback lets Lightning's own loop run the step instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speedkit.errors import ConfigError

LossFn = Callable[[nn.Module, Any, int], torch.Tensor]


def default_loss_fn(model: nn.Module, batch: Any, batch_idx: int) -> torch.Tensor:
    """The loss of one batch, the way Lightning's automatic optimization gets it.

    A LightningModule's ``training_step`` may return the loss or a dict holding it under "loss".
    A plain ``nn.Module`` is called on the batch (a tuple/list is unpacked) and must return the loss.
    """
    if hasattr(model, "training_step"):
        out = model.training_step(batch, batch_idx)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, dict):
        out = out["loss"]
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        raise ConfigError(
            "model", f"the training step must return a scalar loss tensor, found {type(out).__name__}"
            " (return the loss, or a dict with a 'loss' key, from training_step)"
        )
    return out


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Recursively move the tensors of a batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(b, device, non_blocking) for b in batch]
        return type(batch)(moved) if isinstance(batch, list) else tuple(moved)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


@dataclass
class TrainState:
    """The objects of a training run, and the step settings rungs may change.

    Attributes:
        model: the module being trained (a LightningModule or any ``nn.Module``).
        optimizer: its optimizer; rungs keep this object and its parameter references alive.
        device: where the step runs.
        loader: an iterable of batches (any DataLoader); ``None`` when batches are fed by hand.
        loss_fn: computes the loss of a batch; defaults to :func:`default_loss_fn`.
        autocast_dtype: when set, the forward pass runs under ``torch.autocast`` in this dtype.
        scaler: a ``GradScaler`` for fp16 autocast.
        precision: the loosest numerics in effect ("fp32", "tf32", "fp16", "bf16"); sets the
            parity tolerance of the next rung.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    loader: Iterable[Any] | None = None
    loss_fn: LossFn = default_loss_fn
    autocast_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None
    precision: str = "fp32"
    #: free-form notes rungs leave for later rungs (e.g. "compiled": True)
    notes: dict[str, Any] = field(default_factory=dict)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context of the forward pass (a no-op when no rung set a dtype)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def batches(self) -> Iterator[Any]:
        """Batches from the loader, on the device, forever (the loader is restarted when exhausted)."""
        if self.loader is None:
            raise ConfigError("data", "no loader: give a DataLoader (or a datamodule) to iterate batches")
        while True:
            empty = True
            for batch in self.loader:
                empty = False
                yield move_to_device(batch, self.device, non_blocking=True)
            if empty:
                raise ConfigError("data", "the train loader yielded no batch; check the dataset length and batch size")


def train_step(state: TrainState, batch: Any, batch_idx: int = 0) -> torch.Tensor:
    """One optimizer step: forward (under autocast if set), backward (scaled if fp16), step, zero grad.

    Returns the loss, detached, without synchronizing with the device.
    """
    with state.autocast():
        loss = state.loss_fn(state.model, batch, batch_idx)
    if state.scaler is not None:
        state.scaler.scale(loss).backward()
        state.scaler.step(state.optimizer)
        state.scaler.update()
    else:
        loss.backward()
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss.detach()
