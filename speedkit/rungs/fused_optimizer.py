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
from typing import Any, Literal

import torch

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
    supported = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            return "fused optimizers do not support differentiable=True"
        for p in group["params"]:
            if p.device.type not in supported:
                return f"fused kernels do not run on {p.device.type}"
            if not torch.is_floating_point(p):
                return f"fused kernels need floating-point parameters, found {p.dtype}"
    return None


def choose_implementation(optimizer: torch.optim.Optimizer, wanted: str = "auto") -> tuple[str | None, str | None]:
    """Return ``(implementation, None)`` or ``(None, reason the rung does not apply)``."""
    groups = optimizer.param_groups
    if all(g.get("fused") for g in groups):
        return None, f"{type(optimizer).__name__} is already fused"
    fused_blocker = _fused_blocker(optimizer)
    if wanted in ("auto", "fused") and fused_blocker is None:
        return "fused", None
    if wanted == "fused":
        return None, fused_blocker
    if not _accepts(optimizer, "foreach"):
        return None, f"{type(optimizer).__name__} has neither a fused nor a foreach implementation"
    if all(g.get("foreach") for g in groups):
        return None, f"{type(optimizer).__name__} already uses foreach" + (f" and cannot be fused: {fused_blocker}" if fused_blocker else "")
    return "foreach", None


def apply_fused_optimizer(optimizer: torch.optim.Optimizer, implementation: str) -> Handle:
    handle = Handle("fused_optimizer")
    saved_groups = [(g, g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
    saved_defaults = (optimizer.defaults.get("fused"), optimizer.defaults.get("foreach"))
    saved_amp = optimizer.__dict__.get("_step_supports_amp_scaling", None)
    fused = implementation == "fused"
    # Step counters: fused kernels read them on the parameter's device, the for-loop/foreach
    # paths keep them on the CPU (unless capturable). Move them and remember where they were.
    moved: list[tuple[dict, torch.device]] = []

    for group in optimizer.param_groups:
        if "fused" in group:
            group["fused"] = fused
        group["foreach"] = not fused
        if fused:
            for p in group["params"]:
                st = optimizer.state.get(p)
                if st and isinstance(st.get("step"), torch.Tensor) and st["step"].device != p.device:
                    moved.append((st, st["step"].device))
                    st["step"] = st["step"].to(p.device, torch.float32)
    if "fused" in optimizer.defaults:
        optimizer.defaults["fused"] = fused
    optimizer.defaults["foreach"] = not fused
    if fused:
        # what the optimizer's constructor sets when built with fused=True (GradScaler reads it)
        optimizer._step_supports_amp_scaling = True

    def restore() -> None:
        for group, f, fe in saved_groups:
            if f is not None or "fused" in group:
                group["fused"] = f
            group["foreach"] = fe
        optimizer.defaults["fused"], optimizer.defaults["foreach"] = saved_defaults
        if saved_amp is None:
            optimizer.__dict__.pop("_step_supports_amp_scaling", None)
        else:
            optimizer._step_supports_amp_scaling = saved_amp
        for st, device in moved:
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].to(device)

    handle.record(f"{type(optimizer).__name__}: {implementation} implementation (was "
                  f"fused={saved_groups[0][1]}, foreach={saved_groups[0][2]}); state and hyper-parameters kept", restore)
    return handle


class FusedOptimizerRung(Rung):
    name = "fused_optimizer"
    Options = FusedOptimizerOptions
    lightning_stage = "fit_start"  # Lightning builds optimizers in strategy.setup, after `setup`

    def check(self, state: TrainState) -> str | None:
        return choose_implementation(state.optimizer, self.options.implementation)[1]

    def apply(self, state: TrainState) -> Handle:
        implementation, reason = choose_implementation(state.optimizer, self.options.implementation)
        if reason:
            raise RuntimeError(reason)
        return apply_fused_optimizer(state.optimizer, implementation)

    def check_lightning(self, trainer: Any, module: Any, state: TrainState) -> str | None:
        if len(trainer.optimizers) != 1:
            return f"speedkit swaps exactly one optimizer; this Trainer has {len(trainer.optimizers)}"
        return self.check(state)
