"""``speedkit.apply``: the rungs on plain PyTorch objects, with one handle to revert them all."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from speedkit import rungs as rung_registry
from speedkit.data.source import BatchSource
from speedkit.errors import ConfigError, first_line
from speedkit.handle import Handle
from speedkit.rungs.base import Rung
from speedkit.training.state import TrainState
from speedkit.training.step import LossFn, PlainStep, default_loss_fn


class MicroBatches(list):
    """The micro-batches of one optimizer step, as :meth:`Applied.batches` groups them with
    ``accumulate > 1`` (an epoch's last group may hold fewer): :meth:`Applied.step` takes it whole."""


class Applied:
    """The wrapped training objects and the handle that reverts them.

    Attributes:
        model, optimizer: the (possibly modified in place) objects to train with.
        state: the underlying :class:`~speedkit.training.state.TrainState` (``state.step`` runs one step).
        applied: names of the rungs applied; ``skipped``: rung name -> reason it did not apply.
        fallback: the out-of-memory fallback (``oom_fallback=True``): ``fallback.parts`` micro-batches
            per batch now, ``fallback.events`` each split; None without it.
    """

    def __init__(self, state: TrainState, handles: list[Handle], skipped: dict[str, str]) -> None:
        self.state = state
        self.handles = handles
        self.skipped = skipped

    @property
    def fallback(self) -> Any:
        return self.state.step.oom_fallback()

    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self.state.optimizer is not None
        return self.state.optimizer

    @property
    def applied(self) -> list[str]:
        return [h.rung for h in self.handles if h.active]

    @property
    def changes(self) -> list[str]:
        return [c for h in self.handles for c in h.changes]

    @property
    def rewrites(self) -> dict[str, dict[str, Any]]:
        """Per source-rewriting rung applied, its report as plain data (sites per kind, what was left alone)."""
        return {h.rung: h.rewrite.as_dict() for h in self.handles if h.active and h.rewrite is not None}

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward-pass context for your own loop (autocast when the autocast rung is on)."""
        step = self.state.step
        return step.autocast() if isinstance(step, PlainStep) else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled when fp16 autocast needs a GradScaler."""
        scaler = self.state.step.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def optimizer_step(self) -> None:
        """Clip (if asked), ``optimizer.step()`` through the GradScaler when there is one, zero the
        gradients, step the scheduler."""
        self.state.step.optimizer_step()

    def step(self, batch: Any, batch_idx: int = 0) -> torch.Tensor:
        """One whole training step on ``batch`` (already on the device); returns the detached loss.
        With ``accumulate=N``, pass a list of N micro-batches."""
        accumulate = self.state.step.accumulate
        grouped = isinstance(batch, MicroBatches) and 1 <= len(batch) <= accumulate
        if accumulate > 1 and not grouped and not (isinstance(batch, list) and len(batch) == accumulate):
            raise ConfigError(
                "batch",
                f"with accumulate={accumulate}, step() takes a list of {accumulate} micro-batches "
                f"(one optimizer step, as batches() groups them), found {type(batch).__name__}"
                + (f" of {len(batch)}" if isinstance(batch, (list, tuple)) else ""),
            )
        batches = list(batch) if accumulate > 1 or grouped else [batch]
        return self.state.step(batches, batch_idx)

    def batches(self, epochs: int | None = 1, steps: int | None = None) -> Iterator[Any]:
        """The loader's batches on the device, ready for :meth:`step`: one epoch of the loader by
        default (``epochs=N`` for N of them, ``None`` for no end), stopping early after ``steps``
        optimizer steps if given. With ``accumulate=N`` each item is the N micro-batches of one
        optimizer step (:class:`MicroBatches`; an epoch's last group holds what is left of it).

        Each call starts a fresh pass over the loader (a new epoch: a shuffling sampler draws its
        order anew), so ``for epoch in range(E): for i, batch in enumerate(sk.batches()): ...`` is
        the usual loop."""
        if self.state.data is None:
            raise ConfigError("loader", "speedkit.apply was given no loader; pass one to iterate its batches")
        for name, value in (("epochs", epochs), ("steps", steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"expected a whole number >= 1 or None, found {value!r}")
        return self._steps(epochs, steps)

    def _steps(self, epochs: int | None, steps: int | None) -> Iterator[Any]:
        """What :meth:`batches` yields: per optimizer step, its batch (its micro-batches with
        ``accumulate > 1``), epoch by epoch, each epoch a fresh iterator of the source."""
        accumulate = self.state.step.accumulate
        assert self.state.data is not None
        done, epoch = 0, 0
        while (epochs is None or epoch < epochs) and (steps is None or done < steps):
            epoch += 1
            batches = self.state.data.iterator(epochs=1)
            try:
                group = MicroBatches()
                for batch in batches:
                    group.append(batch)
                    if len(group) < accumulate:
                        continue
                    yield group if accumulate > 1 else batch
                    group, done = MicroBatches(), done + 1
                    if steps is not None and done >= steps:
                        return
                if group:  # the epoch's short last group (accumulate > 1 only)
                    yield group
                    done += 1
            finally:
                close = getattr(batches, "close", None)
                if close is not None:  # a prefetching source stops its copies and workers
                    close()

    def undo(self) -> None:
        """Revert every applied rung, last first."""
        while self.handles:
            self.handles.pop().undo()

    def __enter__(self) -> Applied:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def apply(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable[Any] | None = None,
    *,
    rungs: Sequence[str | dict | Rung],
    device: torch.device | str | None = None,
    loss_fn: LossFn = default_loss_fn,
    accumulate: int = 1,
    clip_grad_norm: float | None = None,
    scheduler: Any = None,
    oom_fallback: bool | dict[str, Any] = False,
) -> Applied:
    """Apply rungs to plain PyTorch objects, without trials (``speedkit optimize`` measures).

    Rungs that do not apply are skipped with a warning naming the reason; a rung that raises is
    undone along with the ones before it, and the error propagates. An argument that cannot work (a
    string of rungs, an optimizer of other parameters, ``accumulate=0``, CUDA on a machine without it)
    is a one-line ConfigError naming it, before anything changes.

    Args:
        model: the module to train (a LightningModule works too).
        optimizer: its optimizer, kept as the same object.
        loader: optional iterable of batches.
        rungs: rung names, ``{name, options}`` mappings or Rung instances, in order.
        device: where training runs; defaults to the model's parameters' device.
        loss_fn: ``(model, batch, batch_idx) -> loss``; defaults to ``training_step`` or ``model(*batch)``.
        accumulate, clip_grad_norm, scheduler: the step's gradient accumulation, clipping and schedule.
        oom_fallback: :meth:`Applied.step` redoes a batch whose forward or backward ran out of device
            memory as micro-batches, accumulated (:mod:`speedkit.training.accumulate`); a dict gives
            :class:`~speedkit.training.accumulate.MicroBatcher`'s options (``probe_after``).
    """
    _check_arguments(model, optimizer, loader)
    built = rung_registry.make_all(rungs, "rungs")
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("device", f"{first_line(exc)}; give e.g. 'cuda', 'cuda:0' or 'cpu'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", f"{device} was asked for, but this machine has no usable CUDA GPU")
    step = PlainStep(
        model,
        optimizer,
        device,
        loss_fn=loss_fn,
        accumulate=accumulate,
        clip_grad_norm=clip_grad_norm,
        scheduler=scheduler,
        micro_batcher=_micro_batcher(oom_fallback, model, optimizer),
    )
    state = TrainState(
        model=model,
        optimizer=optimizer,
        device=device,
        step=step,
        data=BatchSource(loader, device) if loader is not None else None,
    )
    handles: list[Handle] = []
    skipped: dict[str, str] = {}
    for rung in built:
        reason = rung.check(state)
        if reason is not None:
            skipped[rung.name] = reason
            warnings.warn(f"speedkit: rung {rung.name!r} not applied: {reason}", stacklevel=2)
            continue
        try:
            handles.append(rung.apply(state))
        except Exception:
            for h in reversed(handles):
                h.undo()
            raise
    return Applied(state, handles, skipped)


def _micro_batcher(option: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """The out-of-memory fallback ``oom_fallback`` asks for (None for False)."""
    from speedkit.training.accumulate import MicroBatcher, check_probe_after

    if option is False or option is None:
        return None
    options = {} if option is True else option
    if not isinstance(options, dict) or set(options) - {"probe_after"}:
        raise ConfigError("oom_fallback", f"expected True, False or {{'probe_after': steps}}, found {option!r}")
    check_probe_after(options.get("probe_after"), "oom_fallback.probe_after")
    return MicroBatcher(
        lambda: (p for g in optimizer.param_groups for p in g["params"]), model=model, probe_after=options.get("probe_after")
    )


def _check_arguments(model: Any, optimizer: Any, loader: Any) -> None:
    """One ConfigError naming the first of :func:`apply`'s objects that cannot work, before anything
    changes (the step's own arguments are :class:`~speedkit.training.step.PlainStep`'s to check)."""
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"expected a torch.nn.Module, found {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("optimizer", f"expected a torch.optim.Optimizer, found {type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters()}
    if mine and not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
        raise ConfigError(
            "optimizer", "holds none of the model's parameters: the model would never train; build it from model.parameters()"
        )
    if loader is not None and not isinstance(loader, Iterable):
        raise ConfigError("loader", f"expected an iterable of batches (a DataLoader), found {type(loader).__name__}")
