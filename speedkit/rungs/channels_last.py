"""channels_last: lay out the convolutions' weights and inputs NHWC (channels innermost), not NCHW.

Speeds up: 2-d convolutions and the batch norms, activations and pooling between them. cuDNN's
tensor-core convolution kernels (bf16/fp16, TF32) work on NHWC; given NCHW tensors they add
transposes around every convolution. oneDNN's CPU convolutions also prefer NHWC. Once the weights
and the input are channels_last, every layer's output stays channels_last.
Does not help: models without 2-d convolutions; fp32 convolutions without tensor cores (little gain);
models where ops without a channels_last kernel keep converting activations back and forth.
Needs: nothing beyond PyTorch: every op accepts either layout, and the values do not change.
Numerics: unchanged. Kernels for the other layout may sum in another order.

The model's 4-D parameters and buffers are converted in place (the same Parameter objects, so the
optimizer's and Lightning's references stay valid), with their gradients and the optimizer's state
tensors of the same shape. A global optimizer step pre-hook puts that state in channels_last again
before every step of an optimizer holding these parameters, since a restored snapshot or a loaded
checkpoint brings it back contiguous (a fused optimizer would then pair each parameter element with
the state of another). 4-D floating batch tensors are made channels_last once they are on the
device: in the trial data source (``state.data`` wrapped), and in a Lightning fit through the
``on_after_batch_transfer`` hook that Lightning calls (the trials' Lightning source calls it too:
the second conversion finds the tensor channels_last and returns it as it is). Undo puts every
tensor back contiguous, with the same values, and removes the hook and the wrappers.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from speedkit import compat, distributed
from speedkit.data.source import SourceWrapper
from speedkit.rungs.base import AttributeWrapper, Handle, Rung, active_dropouts, set_attr
from speedkit.training.state import TrainState

_CONVOLUTIONS_2D = (nn.Conv2d, nn.ConvTranspose2d)


def channels_last_batch(batch: Any) -> Any:
    """``batch`` with its 4-D floating tensors channels_last; the others, and those already
    channels_last, are returned as they are."""
    return compat.tree_map(_channels_last_input, batch)


def _channels_last_input(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor) and leaf.dim() == 4 and leaf.is_floating_point():
        return leaf.contiguous(memory_format=torch.channels_last)
    return leaf


def _convertible(model: nn.Module) -> list[torch.Tensor]:
    """The model's 4-D floating parameters and buffers that are contiguous and not channels_last."""
    return [
        t
        for t in [*model.parameters(), *model.buffers()]
        if t.dim() == 4 and t.is_floating_point() and t.is_contiguous() and not t.is_contiguous(memory_format=torch.channels_last)
    ]


class _Layout:
    """Switches tensors (with their gradients and optimizer state) between contiguous and
    channels_last in place, either way any number of times.

    Args:
        tensors: the parameters and buffers to switch (contiguous when this is built).
        optimizer: the run's optimizer, if it exists yet; optimizers that step these parameters
            later (Lightning builds its own after ``setup``) are found by the step pre-hook.
    """

    def __init__(self, tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> None:
        self.tensors = tensors
        self.ids = {id(t) for t in tensors}
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        if optimizer is not None:
            self.optimizers.add(optimizer)
        self._hook: RemovableHandle | None = None

    def on(self) -> None:
        self.convert(torch.channels_last)
        self.watch()

    def off(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.convert(torch.contiguous_format)

    def convert(self, memory_format: torch.memory_format) -> int:
        """Put the tensors, their gradients and the known optimizers' state in ``memory_format``;
        returns how many optimizer state tensors changed."""
        for t in self.tensors:
            t.data = t.data.contiguous(memory_format=memory_format)
            if t.grad is not None:
                t.grad = t.grad.contiguous(memory_format=memory_format)
        return sum(self._align(opt, memory_format) for opt in list(self.optimizers))

    def watch(self) -> None:
        """Before every optimizer step, put the state of these parameters in channels_last."""
        self._hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer not in self.optimizers:
            if not any(id(p) in self.ids for p in self._params(optimizer)):
                return
            self.optimizers.add(optimizer)
        self._align(optimizer, torch.channels_last)

    def _align(self, optimizer: torch.optim.Optimizer, memory_format: torch.memory_format) -> int:
        changed = 0
        for p in self._params(optimizer):
            if id(p) not in self.ids:
                continue
            state = optimizer.state.get(p, {})
            for key, value in list(state.items()):
                if (
                    isinstance(value, torch.Tensor)
                    and value.shape == p.shape
                    and not value.is_contiguous(memory_format=memory_format)
                ):
                    state[key] = value.contiguous(memory_format=memory_format)
                    changed += 1
        return changed

    @staticmethod
    def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        return (p for group in optimizer.param_groups for p in group["params"])


class ChannelsLastSource(SourceWrapper):
    """The batches of ``inner`` with their 4-D floating tensors channels_last once on the device;
    everything else (host batches, parity copies, generators, release, the fit's binding) is ``inner``'s."""

    maps_batches = True

    def map_batch(self, batch: Any) -> Any:
        return channels_last_batch(batch)


def _lightning_hook_owner(model: nn.Module) -> Any:
    """Whose ``on_after_batch_transfer`` a Lightning fit of ``model`` calls: by Lightning's rule,
    the datamodule's where it overrides the hook, else the LightningModule's; None for a plain module."""
    pl = sys.modules.get("lightning.pytorch")  # a LightningModule exists only once Lightning is imported
    if pl is None or not isinstance(model, pl.LightningModule):
        return None
    from lightning.pytorch.utilities.model_helpers import is_overridden

    try:
        datamodule = model.trainer.datamodule
    except RuntimeError:  # not attached to a Trainer
        return model
    if datamodule is not None and is_overridden("on_after_batch_transfer", datamodule):
        return datamodule
    return model


class ChannelsLastAfterTransfer(AttributeWrapper):
    """The wrapped ``on_after_batch_transfer`` returning channels_last batches. Its ``__wrapped__``
    keeps Lightning's view of whether the hook is overridden; a copy of the owner gets the hook."""

    def __call__(self, batch: Any, dataloader_idx: int) -> Any:
        return channels_last_batch(self.wrapped(batch, dataloader_idx))


def _convert_after_transfer(handle: Handle, owner: Any) -> None:
    """Wrap ``owner.on_after_batch_transfer`` (an instance attribute) to return channels_last batches."""
    set_attr(
        handle,
        owner,
        "on_after_batch_transfer",
        ChannelsLastAfterTransfer(owner.on_after_batch_transfer),
        f"inputs: 4-D floating batch tensors made channels_last in {type(owner).__name__}.on_after_batch_transfer "
        "(the Lightning fit's batches)",
    )


class ChannelsLastRung(Rung):
    name = "channels_last"
    recompiles = True  # beneath a kept compile its trial compiles anew
    # cuDNN's NHWC convolutions without the layout transposes it adds around NCHW ones (GEMM: convolutions
    # and cuDNN's kernels count there), and the batch norms, activations and pooling between them
    targets = ("gemm", "normalization", "elementwise")
    precision = None  # a layout change: the same values, convolutions summed in another order at most
    partners = ("autocast", "compile")  # NHWC pays most where cuDNN's bf16 kernels and Inductor's run on it

    def check(self, state: TrainState) -> str | None:
        convolutions = [m for m in state.model.modules() if isinstance(m, _CONVOLUTIONS_2D)]
        if not convolutions:
            return "the model has no 2-d convolution (channels_last changes the layout convolutions read)"
        if len(convolutions) == 1:
            return (
                f"the model has one 2-d convolution only ({type(convolutions[0]).__name__}, a stem or patch embedding): "
                "the rest of it does not read a convolution's layout"
            )
        convertible = _convertible(state.model)
        if not convertible:
            return "the model's 4-D parameters and buffers are already channels_last (none is left contiguous)"
        if any(distributed.local_shard(t) is not t for t in convertible):
            return (
                "the model's 4-D parameters are sharded (FSDP2's DTensors): each rank holds a flat shard FSDP gathers "
                "into its own layout, not a layout this rung can set"
            )
        return None

    def apply(self, state: TrainState) -> Handle:
        handle = Handle(self.name)
        tensors = _convertible(state.model)
        params = sum(isinstance(t, nn.Parameter) for t in tensors)
        layout = _Layout(tensors, state.optimizer)
        states = layout.convert(torch.channels_last)
        layout.watch()
        handle.record(
            f"model: {params} parameters and {len(tensors) - params} buffers (4-D) made channels_last in place, "
            f"with {states} optimizer state tensors; their optimizer state is made channels_last again before "
            "every optimizer step",
            layout.off,
            layout.on,
        )
        if state.data is not None:
            set_attr(
                handle,
                state,
                "data",
                ChannelsLastSource(state.data),
                "inputs: 4-D floating batch tensors made channels_last in the trial data source",
            )
        owner = _lightning_hook_owner(state.model)
        if owner is not None:
            _convert_after_transfer(handle, owner)
        # dropout fills its mask in memory order: on a channels_last activation, other elements get
        # each random number (parity is then judged with dropout off)
        handle.draws_differently = bool(active_dropouts(state.model))
        return handle
