"""fused_optimizer: run the optimizer update as one fused kernel (or a few multi-tensor ones).

Speeds up: the optimizer step of models with many parameter tensors. The default for-loop update
launches several kernels per parameter; ``foreach`` batches them into multi-tensor kernels, and
``fused`` does the whole update (AdamW: moments, bias correction, decay, step) in one pass.
Does not help: steps dominated by forward/backward of a few huge tensors (small gain).
Needs: an optimizer whose constructor takes ``fused=`` or ``foreach=`` (in torch 2.14 every
``torch.optim`` class but LBFGS, SparseAdam and Muon; fused: Adam, AdamW, SGD, and Adagrad on the
CPU), without ``differentiable=True``; fused needs floating-point parameters without sparse gradients.
Where Lightning's own mixed precision (one the user chose, or fp16) clips gradients (``gradient_clip_val``,
or the module's own ``configure_gradient_clipping``), it refuses a fused optimizer: foreach is chosen
then (the ``autocast`` rung's bf16 plugin does not refuse).
Numerics: unchanged. The same update, its per-element arithmetic in one kernel.

Whether an implementation runs the optimizer's update is found out, not assumed (which classes,
devices, dtypes and settings each one takes changes between torch versions: fused Adagrad refuses
CUDA parameters in torch 2.11, foreach Adam a tensor ``lr`` unless capturable): one step of a copy
of the optimizer with that implementation, on a tiny parameter of each group's settings, device,
dtype and number of dims. ``fused`` is chosen where it runs, else ``foreach``.

The switch is made in place on the user's optimizer object (its ``param_groups`` flags, and its
defaults for groups added later), so the optimizer state, hyper-parameters, LR schedulers and
Lightning's references all stay valid; undo puts the flags back exactly (a flag the optimizer
does not have is never added). A step that steps several optimizers itself (Lightning's manual
optimization: a GAN's generator and discriminator) gets each of them switched.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from speedkit import compat
from speedkit.errors import first_line
from speedkit.rungs.base import Handle, Rung, nested
from speedkit.training.saved_optimizer import SavedAsUser
from speedkit.training.state import TrainState

_FLAGS = ("fused", "foreach")
_ABSENT = object()


@dataclass
class FusedOptimizerOptions:
    """Options of the fused_optimizer rung."""

    #: "auto" = fused where the optimizer and device support it, else foreach
    implementation: Literal["auto", "fused", "foreach"] = "auto"


def _accepts(optimizer: torch.optim.Optimizer, flag: str) -> bool:
    """The optimizer's class takes ``flag`` and every param group holds it (its step reads it there)."""
    return flag in inspect.signature(type(optimizer).__init__).parameters and all(flag in g for g in optimizer.param_groups)


def _sparse_params(model: nn.Module | None) -> set[int]:
    """ids of the parameters of ``model`` that get sparse gradients (``nn.Embedding(sparse=True)``)."""
    if model is None:
        return set()
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


def _try_step(optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor, implementation: str) -> str | None:
    """Why one ``implementation`` step of ``optimizer``'s class with ``group``'s settings fails on a
    tiny parameter of ``p``'s device, dtype and number of dims; None when it runs."""
    settings = {k: v for k, v in group.items() if k != "params"}
    settings.update({k: k == implementation for k in _FLAGS if k in settings})
    q = torch.zeros((2,) * p.dim(), device=p.device, dtype=p.dtype, requires_grad=True)
    try:
        probe = type(optimizer)([{**settings, "params": [q]}])
        q.grad = torch.ones_like(q)
        probe.step()
    except Exception as exc:  # whatever stops the probe would stop the user's step
        return (
            f"{implementation} {type(optimizer).__name__} does not run on {p.dtype} parameters on {p.device.type}: "
            f"{first_line(exc, type(exc).__name__)}"
        )
    return None


def _blocker(optimizer: torch.optim.Optimizer, implementation: str, sparse: set[int]) -> str | None:
    """Why ``implementation`` ("fused" or "foreach") cannot run ``optimizer``'s update, or None."""
    name = type(optimizer).__name__
    if not _accepts(optimizer, implementation):
        return f"{name} has no {implementation} implementation"
    probes: dict[tuple[int, torch.device, torch.dtype, int], tuple[dict[str, Any], torch.Tensor]] = {}
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return f"differentiable=True needs {name}'s for-loop implementation"
        for p in group["params"]:
            if implementation == "fused" and not torch.is_floating_point(p):
                return f"fused kernels need floating-point parameters, found {p.dtype}"
            if implementation == "fused" and id(p) in sparse:
                return "fused kernels do not take sparse gradients (an nn.Embedding with sparse=True)"
            probes.setdefault((id(group), p.device, p.dtype, p.dim()), (group, p))
    return next((r for r in (_try_step(optimizer, g, p, implementation) for g, p in probes.values()) if r), None)


def choose_implementation(
    optimizer: torch.optim.Optimizer, wanted: str = "auto", step_blocker: str | None = None, model: nn.Module | None = None
) -> tuple[str | None, str | None]:
    """``(implementation, why it is not "fused" or None)``, or ``(None, why the rung does not apply)``.

    ``step_blocker`` is why the training step cannot run a fused optimizer, if it cannot; ``model``
    is where parameters with sparse gradients are looked for.
    """
    name, groups = type(optimizer).__name__, optimizer.param_groups
    if all(g.get("fused") for g in groups):
        return None, f"{name} is already fused"
    if not (_accepts(optimizer, "fused") or _accepts(optimizer, "foreach")):
        return None, f"{name} has neither a fused nor a foreach implementation"
    sparse = _sparse_params(model)
    why_not_fused = None
    if wanted != "foreach":
        why_not_fused = step_blocker or _blocker(optimizer, "fused", sparse)
        if why_not_fused is None:
            return "fused", None
        if wanted == "fused":
            return None, why_not_fused
    if all(g.get("foreach") for g in groups):
        return None, f"{name} already uses foreach" + (f" and cannot be fused: {why_not_fused}" if why_not_fused else "")
    why_not_foreach = _blocker(optimizer, "foreach", sparse)
    if why_not_foreach:
        return None, why_not_foreach + (f" (not fused: {why_not_fused})" if why_not_fused not in (None, why_not_foreach) else "")
    return "foreach", why_not_fused


def _flags(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: settings[k] for k in _FLAGS if k in settings}


class _ImplementationSwitch:
    """Flips an optimizer's implementation flags in place, and back; either way any number of times.

    Only the flags a param group (or the defaults) has are set. Groups added after the switch was
    made get the defaults' flags, so switching back gives them the flags they would have had.

    Step counters: fused kernels read them on the parameter's device, the for-loop/foreach paths
    keep them on the CPU (unless capturable). They are moved on every switch, since the optimizer's
    state may have been replaced (a snapshot restored) in between.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, implementation: str) -> None:
        self.optimizer = optimizer
        self.fused = implementation == "fused"
        self.saved_groups = [_flags(g) for g in optimizer.param_groups]
        self.saved_defaults = _flags(optimizer.defaults)
        self.saved_amp = optimizer.__dict__.get(compat.AMP_SCALING_FLAG, _ABSENT)

    def user_flags(self, index: int) -> dict[str, Any]:
        """Param group ``index``'s flags before the switch (a group added since: the defaults' flags before)."""
        return dict(self.saved_groups[index] if index < len(self.saved_groups) else self.saved_defaults)

    def on(self) -> None:
        opt = self.optimizer
        wanted = {"fused": self.fused, "foreach": not self.fused}
        for settings in (*opt.param_groups, opt.defaults):
            settings.update({k: wanted[k] for k in _flags(settings)})
        if self.fused:
            # what the optimizer's constructor sets when built with fused=True (GradScaler reads it)
            setattr(opt, compat.AMP_SCALING_FLAG, True)
            self._move_steps()

    def off(self) -> None:
        opt = self.optimizer
        for i, group in enumerate(opt.param_groups):
            group.update(self.user_flags(i))
        opt.defaults.update(self.saved_defaults)
        if self.fused:
            if self.saved_amp is _ABSENT:
                opt.__dict__.pop(compat.AMP_SCALING_FLAG, None)
            else:
                setattr(opt, compat.AMP_SCALING_FLAG, self.saved_amp)
            self._move_steps()

    def _move_steps(self) -> None:
        """Step counters where the groups' flags (just switched) keep them (the fused kernel reads fp32 ones)."""
        for group in self.optimizer.param_groups:
            compat.place_step_counters(self.optimizer, group, torch.float32)


def apply_fused_optimizer(optimizer: torch.optim.Optimizer, implementation: str, why_not_fused: str | None = None) -> Handle:
    handle = Handle("fused_optimizer")
    switch = _ImplementationSwitch(optimizer, implementation)
    # checkpoints written meanwhile hold the user's flags; one loaded meanwhile gets the switch again
    saved = SavedAsUser(optimizer, lambda i, group: switch.user_flags(i), lambda i: switch.fused, switch.on)

    def on() -> None:
        switch.on()
        saved.on()

    def off() -> None:
        saved.off()
        switch.off()

    on()
    was = ", ".join(f"{k}={v}" for k, v in switch.saved_groups[0].items())
    handle.record(
        f"{type(optimizer).__name__}: {implementation} implementation (was {was}); state and hyper-parameters kept; "
        "checkpoints written meanwhile hold the flags it had",
        off,
        on,
    )
    if why_not_fused:
        handle.record(f"not fused: {why_not_fused}")
    return handle


class FusedOptimizerRung(Rung):
    name = "fused_optimizer"
    # the update's kernels, and the host's launches of them (several per parameter in the for-loop update)
    targets = ("optimizer", "host")
    # one update kernel a group where foreach issues a dozen multi-tensor ops (each dispatched per
    # parameter under FSDP2's DTensors: 1.05x on a host-bound 1.1B Llama on two H200s)
    cuts_host_work = True
    Options = FusedOptimizerOptions
    lightning_stage = "fit_start"  # Lightning builds optimizers in strategy.setup, after `setup`

    def _choose(self, state: TrainState) -> list[tuple[torch.optim.Optimizer, str | None, str | None]]:
        """Per optimizer the step steps: ``(optimizer, implementation, why not fused)``, the implementation
        None where none applies (the reason then says why). Several where the user's step steps several
        (a manual-optimization GAN's two); none where the run has none (:meth:`check` says why)."""
        several = [o for o in state.step.all_optimizers() if not compat.lightning_no_optimizer(o)]
        if state.optimizer is None and len(several) > 1:
            optimizers = several
        else:
            if state.why_no_optimizer() is not None:
                return []
            assert state.optimizer is not None
            optimizers = [state.optimizer]
        blocker = state.step.fused_optimizer_blocker()
        return [(o, *choose_implementation(o, self.options.implementation, blocker, state.model)) for o in optimizers]

    def check(self, state: TrainState) -> str | None:
        chosen = self._choose(state)
        if not chosen:
            return state.why_no_optimizer() or "the run has no optimizer"
        if all(implementation is None for _, implementation, _ in chosen):
            if len(chosen) == 1:
                return chosen[0][2]
            return "; ".join(f"optimizer {i} ({type(o).__name__}): {why}" for i, (o, _, why) in enumerate(chosen))
        return None

    def apply(self, state: TrainState) -> Handle:
        chosen = self._choose(state)
        if len(chosen) == 1:
            optimizer, implementation, reason = chosen[0]
            if implementation is None:
                raise RuntimeError(reason or "no implementation applies")
            return apply_fused_optimizer(optimizer, implementation, reason)
        handle = Handle(self.name)
        for i, (optimizer, implementation, reason) in enumerate(chosen):
            if implementation is None:
                handle.record(f"note: optimizer {i} ({type(optimizer).__name__}) left as it is: {reason}")
                continue
            inner = apply_fused_optimizer(optimizer, implementation, reason)
            nested(handle, inner, f"optimizer {i} of {len(chosen)}: {inner.changes[0]}")
            for line in inner.changes[1:]:
                handle.record(f"optimizer {i}: {line}")
        return handle
