"""fused_optimizer: run the optimizer update as one fused kernel (or a few multi-tensor ones).

Speeds up: the optimizer step of models with many parameter tensors. The default for-loop update
launches several kernels per parameter; ``foreach`` batches them into multi-tensor kernels, and
``fused`` does the whole update (AdamW: moments, bias correction, decay, step) in one pass.
Does not help: steps dominated by forward/backward of a few huge tensors (small gain).
Needs: an optimizer whose constructor takes ``fused=``/``foreach=`` (torch.optim Adam, AdamW,
SGD, Adagrad, …); fused needs floating-point parameters on a supported device.

The switch is made in place on the user's optimizer object (its ``param_groups`` flags), so the
optimizer state, hyper-parameters, LR schedulers and Lightning's references all stay valid; undo
puts the flags back.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

import torch

from speedkit import compat
from speedkit.rungs.base import Handle, Rung
from speedkit.state import TrainState


@dataclass
class FusedOptimizerOptions:
    """Options of the fused_optimizer rung."""

    #: "auto" = fused where the optimizer and device support it, else foreach
    implementation: Literal["auto", "fused", "foreach"] = "auto"


def _accepts(optimizer: torch.optim.Optimizer, flag: str) -> bool:
    return flag in inspect.signature(type(optimizer).__init__).parameters and all(flag in g for g in optimizer.param_groups)


def _fused_blocker(optimizer: torch.optim.Optimizer) -> str | None:
    if not _accepts(optimizer, "fused"):
        return f"{type(optimizer).__name__} has no fused implementation"
    supported = compat.fused_optimizer_devices()
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "fused optimizers do not support differentiable=True"
        for p in group["params"]:
            if p.device.type not in supported:
                return f"fused kernels do not run on {p.device.type}"
            if not torch.is_floating_point(p):
                return f"fused kernels need floating-point parameters, found {p.dtype}"
    return None


def choose_implementation(optimizer: torch.optim.Optimizer | None, wanted: str = "auto",
                          step_blocker: str | None = None) -> tuple[str | None, str | None]:
    """Return ``(implementation, None)`` or ``(None, reason the rung does not apply)``;
    ``step_blocker`` is why the training step cannot run a fused optimizer, if it cannot."""
    if optimizer is None:
        return None, "the run has no optimizer (yet)"
    groups = optimizer.param_groups
    if all(g.get("fused") for g in groups):
        return None, f"{type(optimizer).__name__} is already fused"
    fused_blocker = step_blocker or _fused_blocker(optimizer)
    if wanted in ("auto", "fused") and fused_blocker is None:
        return "fused", None
    if wanted == "fused":
        return None, fused_blocker
    if not _accepts(optimizer, "foreach"):
        return None, f"{type(optimizer).__name__} has neither a fused nor a foreach implementation"
    if all(g.get("foreach") for g in groups):
        return None, f"{type(optimizer).__name__} already uses foreach" + (f" and cannot be fused: {fused_blocker}" if fused_blocker else "")
    return "foreach", None


class _ImplementationSwitch:
    """Flips an optimizer's implementation flags in place, and back; either way any number of times.

    Step counters: fused kernels read them on the parameter's device, the for-loop/foreach paths
    keep them on the CPU (unless capturable). They are moved on every switch, since the optimizer's
    state may have been replaced (a snapshot restored) in between.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, implementation: str) -> None:
        self.optimizer = optimizer
        self.fused = implementation == "fused"
        self.saved_groups = [(g.get("fused"), g.get("foreach"), "fused" in g) for g in optimizer.param_groups]
        self.saved_defaults = (optimizer.defaults.get("fused"), optimizer.defaults.get("foreach"))
        self.saved_amp = optimizer.__dict__.get(compat.AMP_SCALING_FLAG, None)

    def on(self) -> None:
        opt, fused = self.optimizer, self.fused
        for group in opt.param_groups:
            if "fused" in group:
                group["fused"] = fused
            group["foreach"] = not fused
        if "fused" in opt.defaults:
            opt.defaults["fused"] = fused
        opt.defaults["foreach"] = not fused
        if fused:
            # what the optimizer's constructor sets when built with fused=True (GradScaler reads it)
            setattr(opt, compat.AMP_SCALING_FLAG, True)
            self._move_steps(on_device=True)

    def off(self) -> None:
        opt = self.optimizer
        for group, (f, fe, had_fused) in zip(opt.param_groups, self.saved_groups):
            if had_fused:
                group["fused"] = f
            group["foreach"] = fe
        opt.defaults["fused"], opt.defaults["foreach"] = self.saved_defaults
        if self.saved_amp is None:
            opt.__dict__.pop(compat.AMP_SCALING_FLAG, None)
        else:
            setattr(opt, compat.AMP_SCALING_FLAG, self.saved_amp)
        if self.fused:
            self._move_steps(on_device=False)

    def _move_steps(self, on_device: bool) -> None:
        for group in self.optimizer.param_groups:
            if group.get("capturable"):
                continue
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                step = st.get("step") if st else None
                if isinstance(step, torch.Tensor):
                    target = p.device if on_device else torch.device("cpu")
                    if step.device != target:
                        st["step"] = step.to(target, torch.float32)


def apply_fused_optimizer(optimizer: torch.optim.Optimizer, implementation: str, why_not_fused: str | None = None) -> Handle:
    handle = Handle("fused_optimizer")
    switch = _ImplementationSwitch(optimizer, implementation)
    switch.on()
    fused, foreach, _ = switch.saved_groups[0]
    handle.record(f"{type(optimizer).__name__}: {implementation} implementation (was fused={fused}, foreach={foreach}); "
                  "state and hyper-parameters kept", switch.off, switch.on)
    if why_not_fused:
        handle.record(f"not fused: {why_not_fused}")
    return handle


class FusedOptimizerRung(Rung):
    name = "fused_optimizer"
    Options = FusedOptimizerOptions
    lightning_stage = "fit_start"  # Lightning builds optimizers in strategy.setup, after `setup`

    def check(self, state: TrainState) -> str | None:
        return choose_implementation(state.optimizer, self.options.implementation, state.step.fused_optimizer_blocker())[1]

    def apply(self, state: TrainState) -> Handle:
        implementation, reason = choose_implementation(state.optimizer, self.options.implementation,
                                                       state.step.fused_optimizer_blocker())
        if reason:
            raise RuntimeError(reason)
        blocker = state.step.fused_optimizer_blocker() or _fused_blocker(state.optimizer)
        return apply_fused_optimizer(state.optimizer, implementation, blocker if implementation != "fused" else None)
