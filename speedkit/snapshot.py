"""Save and restore the training state around trial steps, so that trials never leak.

A snapshot keeps, by object identity, a copy of every parameter and buffer of the model, the
optimizer's per-parameter state and hyper-parameters, the state the step owns (learning-rate
schedulers, grad scaler), the generators iterating the data advances, and the RNG states (torch,
CUDA, Python, NumPy). Restoring copies values back *into the same tensors* (never replaces them),
so the optimizer, Lightning and any rung still point at the live parameters. The accumulated
states of the model's torchmetrics metrics (which a ``training_step`` updates, and which are
neither parameters nor buffers) are saved and put back too: otherwise the trials' batches would
count in the first epoch's metric (``self.log("acc", self.acc, on_epoch=True)``). Implementation flags
of the optimizer (fused/foreach/capturable) are left as they are now: those belong to the rungs,
not to the training state.
"""

from __future__ import annotations

import copy
import random
import sys
from typing import Any

import torch
from torch import nn

from speedkit import compat

_IMPL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def _clone(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    return t.detach().to(device if device is not None else t.device, copy=True)


def _metrics(model: nn.Module) -> list[nn.Module]:
    """The torchmetrics ``Metric`` modules in ``model`` (none where torchmetrics was never imported)."""
    torchmetrics = sys.modules.get("torchmetrics")
    metric = getattr(torchmetrics, "Metric", None)
    return [m for m in model.modules() if isinstance(m, metric)] if metric is not None else []


def _save_metric(metric: Any) -> tuple[Any, dict[str, Any], int]:
    state = {name: ([_clone(v, None) for v in value] if isinstance(value, list) else _clone(value, None))
             for name, value in metric.metric_state.items()}
    return metric, state, int(metric.update_count)


def _restore_metric(metric: Any, state: dict[str, Any], count: int) -> None:
    metric.reset()  # the states to their defaults, the update count and cached results cleared
    for name, value in state.items():
        if isinstance(value, list):
            getattr(metric, name).extend(v.clone() for v in value)  # the same list object reset() cleared
        else:
            setattr(metric, name, value.clone())
    if count:  # torchmetrics offers no public setter of the count reset() zeroed
        compat.set_metric_update_count(metric, count)


def rng_state() -> dict[str, Any]:
    """Every RNG state a training step or a data loader may draw from."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "python": random.getstate(),
        "numpy": None,
    }
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    if state.get("numpy") is not None:
        import numpy as np

        np.random.set_state(state["numpy"])


class Snapshot:
    """A copy of the training state; ``restore()`` puts it back in place, any number of times.

    Args:
        model, optimizer: what to save.
        step: the training step (its schedulers and grad scaler are saved), or None.
        data: the batch source (the generators its iteration advances), or None.
        device: where to keep the copy ("cpu" keeps GPU memory figures honest; None = same device).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: Any = None, data: Any = None,
                 device: torch.device | str | None = "cpu") -> None:
        self.model = model
        self.optimizer = optimizer
        self.step = step
        self.data = data
        self.device = torch.device(device) if device is not None else None
        pin = self.device is not None and self.device.type == "cpu" and torch.cuda.is_available()
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) in seen:
                continue  # tied weights
            seen.add(id(t))
            saved = _clone(t, self.device)
            if pin and t.is_cuda:
                saved = saved.pin_memory()
            self.tensors.append((t, saved))
        self.metrics = [_save_metric(m) for m in _metrics(model)]
        self.opt_state: list[tuple[torch.Tensor, dict[str, Any]]] = []
        self.opt_groups: list[dict[str, Any]] = []
        if optimizer is not None:
            for p, st in optimizer.state.items():
                self.opt_state.append((p, {k: (_clone(v, self.device) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                                           for k, v in st.items()}))
            self.opt_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params" and k not in _IMPL_FLAGS}
                               for g in optimizer.param_groups]
        self.step_state = step.state_dict() if step is not None else None
        self.data_state = data.state_dict() if data is not None else None
        self.rng = rng_state()

    @torch.no_grad()
    def restore(self, rng: bool = True) -> None:
        for live, saved in self.tensors:
            live.copy_(saved, non_blocking=True)
            if isinstance(live, nn.Parameter) or live.requires_grad:
                live.grad = None
        for metric, state, count in self.metrics:
            _restore_metric(metric, state, count)
        opt = self.optimizer
        if opt is not None:
            opt.state.clear()
            flags = {id(p): g for g in opt.param_groups for p in g["params"]}
            for p, st in self.opt_state:
                group = flags.get(id(p), {})
                restored = {}
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        target = compat.step_counter_device(group, p) if k == "step" else p.device
                        restored[k] = v.to(target, copy=True)
                    else:
                        restored[k] = copy.deepcopy(v)
                opt.state[p] = restored
            for group, saved in zip(opt.param_groups, self.opt_groups):
                group.update(copy.deepcopy(saved))
            opt.zero_grad(set_to_none=True)
        if self.step is not None and self.step_state is not None:
            self.step.load_state_dict(self.step_state)
        if self.data is not None and self.data_state is not None:
            self.data.load_state_dict(self.data_state)
        if rng:
            self.restore_rng()

    def restore_rng(self) -> None:
        set_rng_state(self.rng)
