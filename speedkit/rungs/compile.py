"""compile: ``torch.compile`` the model's forward (and, through AOTAutograd, its backward).

Speeds up: chains of element-wise and reduction ops (fused into Triton/C++ kernels), Python
overhead, and with ``mode="reduce-overhead"`` kernel-launch overhead (CUDA graphs).
Does not help: models already dominated by large GEMMs in one kernel each; very dynamic shapes
(recompilations). Costs compile time at the first steps.
Needs: a Python that TorchDynamo supports; Inductor on CPU needs a C++ compiler.

Compiled the way Lightning does it (``module.forward`` replaced by its compiled version, the
module itself untouched), so state dicts, hooks and optimizers see the same module. Two guards:
a compilation failure falls back to the eager forward with a warning, and a recompilation storm
(more than ``max_recompiles`` new graphs) also falls back to eager instead of slowing training.
"""

from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from speedkit import compat
from speedkit.rungs.base import Handle, Rung
from speedkit.state import TrainState


@dataclass
class CompileOptions:
    """Options of the compile rung (passed to ``torch.compile``)."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    fullgraph: bool = False
    #: None lets torch decide (static first, dynamic after a shape change)
    dynamic: bool | None = None
    backend: str = "inductor"
    #: new graphs tolerated after the first before falling back to eager
    max_recompiles: int = 8

    def __post_init__(self) -> None:
        if self.max_recompiles < 0:
            raise ValueError(f"max_recompiles must be >= 0, found {self.max_recompiles}")


class GuardedForward:
    """A compiled forward that falls back to eager on a compile failure or a recompilation storm."""

    def __init__(self, eager: Any, compiled: Any, max_recompiles: int) -> None:
        self.eager = eager
        self.compiled = compiled
        self.max_recompiles = max_recompiles
        self.fallback_reason: str | None = None
        self._first_graphs: int | None = None
        self.recompiles = 0
        functools.update_wrapper(self, eager)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fallback_reason is not None:
            return self.eager(*args, **kwargs)
        before = compat.graph_count()
        try:
            out = self.compiled(*args, **kwargs)
        except compat.compile_errors() as exc:
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self._fall_back(f"torch.compile failed ({type(exc).__name__}: {first_line[:200]})")
            return self.eager(*args, **kwargs)
        new_graphs = compat.graph_count() - before
        if self._first_graphs is None:
            self._first_graphs = new_graphs  # the first call may compile several graphs (graph breaks)
        elif new_graphs:
            self.recompiles += new_graphs
            if self.recompiles > self.max_recompiles:
                self._fall_back(f"recompilation storm: {self.recompiles} recompiles, more than max_recompiles={self.max_recompiles}")
        return out

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        warnings.warn(f"speedkit compile: {reason}; running the eager forward from now on", stacklevel=3)


def check_compile(model: nn.Module, device: torch.device, backend: str = "inductor") -> str | None:
    if not compat.dynamo_supported():
        return f"torch.compile does not support Python {sys.version_info.major}.{sys.version_info.minor} with torch {torch.__version__}"
    if compat.user_compiled(model):
        return "the model was compiled by the user (torch.compile before trainer.fit); left as is"
    forward = model.__dict__.get("forward")
    if isinstance(forward, GuardedForward) or compat.is_compiled_callable(forward):
        return "the model's forward is already compiled"
    if compat.is_compiled_module(model):
        return "the model is already a torch.compile'd module"
    if backend == "inductor" and device.type == "cpu" and compat.inductor_cpu_compiler() is None:
        return "Inductor on CPU needs a C++ compiler (g++ or clang++) on PATH"
    return None


def apply_compile(model: nn.Module, options: CompileOptions) -> tuple[Handle, GuardedForward]:
    handle = Handle("compile")
    had_own_forward = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    eager = model.forward
    compiled = torch.compile(eager, mode=None if options.mode == "default" else options.mode,
                             fullgraph=options.fullgraph, dynamic=options.dynamic, backend=options.backend)
    guarded = GuardedForward(eager, compiled, options.max_recompiles)
    model.forward = guarded

    def restore() -> None:
        if had_own_forward:
            model.forward = previous
        else:
            model.__dict__.pop("forward", None)

    def redo() -> None:  # the same compiled function: switching compile off and on recompiles nothing
        model.forward = guarded

    handle.record(f"{type(model).__name__}.forward = torch.compile(forward, mode={options.mode!r}, "
                  f"fullgraph={options.fullgraph}, dynamic={options.dynamic}, backend={options.backend!r})", restore, redo)
    return handle, guarded


class CompileRung(Rung):
    name = "compile"
    Options = CompileOptions

    def check(self, state: TrainState) -> str | None:
        return check_compile(state.model, state.device, self.options.backend)

    def apply(self, state: TrainState) -> Handle:
        handle, guarded = apply_compile(state.model, self.options)
        # the ladder reads this after its trial steps: a fallback means the rung failed
        handle.problem = lambda: guarded.fallback_reason
        return handle
