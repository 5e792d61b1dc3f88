"""Save and restore the training state around trial steps, so that trials never leak.

A snapshot keeps, by object identity, a copy of every parameter and buffer of the model (of a
DTensor, FSDP2's sharded parameter, this rank's shard) and whether each parameter requires
gradients, every optimizer's per-parameter state and hyper-parameters, the state the step owns
(learning-rate schedulers, grad scaler), the generators iterating the data advances, and the RNG
states (torch, CUDA, Python, NumPy). Restoring copies values back *into the same tensors* (never
replaces them), so the optimizer, Lightning and any rung still point at the live parameters. The accumulated
states of the model's torchmetrics metrics (which a ``training_step`` updates, and which are
neither parameters nor buffers) are saved and put back too: otherwise the trials' batches would
count in the first epoch's metric (``self.log("acc", self.acc, on_epoch=True)``). So are the plain
Python attributes of the user's own modules (numbers, strings, and lists, tuples, dicts and sets of
them: a ``self.calls += 1`` in ``training_step``, a list of seen losses), put back in place (a list
stays the same object); attributes of other kinds that the trials rebind (a tensor kept on
``self``) are named in :attr:`Snapshot.unrestored`, for the report. Implementation flags
of the optimizer (fused/foreach/capturable) are left as they are now: those belong to the rungs,
not to the training state.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from typing import Any

import torch
from torch import nn

from speedkit import compat
from speedkit.data.rng import RngState
from speedkit.distributed import local_shard
from speedkit.training.digest import state_digest

_IMPL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def _clone(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    local = local_shard(t.detach())
    return local.to(device if device is not None else local.device, copy=True)


class _ShardedState:
    """A DTensor optimizer state tensor (FSDP2's) as saved: the DTensor itself and a copy of this rank's
    shard, put back into that same DTensor (its mesh and placements stay the optimizer's)."""

    def __init__(self, live: torch.Tensor, device: torch.device | None) -> None:
        self.live, self.shard = live, _clone(live, device)

    def restore(self) -> torch.Tensor:
        local_shard(self.live).copy_(self.shard)
        return self.live


def _saved_state_tensor(v: torch.Tensor, device: torch.device | None) -> Any:
    """An optimizer state tensor as saved: a copy, or a :class:`_ShardedState`."""
    return _ShardedState(v, device) if local_shard(v) is not v else _clone(v, device)


def _metrics(model: nn.Module) -> list[nn.Module]:
    """The torchmetrics ``Metric`` modules in ``model`` (none where torchmetrics was never imported)."""
    torchmetrics = sys.modules.get("torchmetrics")
    metric = getattr(torchmetrics, "Metric", None)
    return [m for m in model.modules() if isinstance(m, metric)] if metric is not None else []


def _save_metric(metric: Any) -> tuple[Any, dict[str, Any], int]:
    state = {
        name: ([_clone(v, None) for v in value] if isinstance(value, list) else _clone(value, None))
        for name, value in metric.metric_state.items()
    }
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


#: containers whose items are copied with them (exact types: a subclass may carry behaviour of its own)
_CONTAINERS = (list, tuple, dict, set, frozenset)
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
#: items a plain attribute may hold (a larger one is not copied at every snapshot)
_PLAIN_ITEMS = 10_000
_MISSING = object()


def _plain(value: Any, budget: list[int]) -> bool:
    """Plain Python data: scalars, and the containers of :data:`_CONTAINERS` holding only plain data
    (``budget`` items in all)."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if type(value) in _SCALARS:
        return True
    if type(value) is dict:
        return all(_plain(k, budget) and _plain(v, budget) for k, v in value.items())
    if type(value) in _CONTAINERS:
        return all(_plain(v, budget) for v in value)
    return False


def _state_of_another_kind(value: Any) -> bool:
    """Not plain data, nor a submodule, parameter or callable (a method a rung or the user bound):
    state the step may rebind (a tensor kept on ``self``), which a restore names but cannot put back."""
    return not isinstance(value, (nn.Module, nn.Parameter)) and not callable(value)


@functools.cache
def _framework_keys(kind: type) -> frozenset[str]:
    """The attributes torch's ``nn.Module`` (and Lightning's ``LightningModule``) keep on every
    instance of ``kind``: theirs, not the user's."""
    keys = set(vars(nn.Module()))
    lightning = sys.modules.get("lightning.pytorch")
    if lightning is not None and issubclass(kind, lightning.LightningModule):
        keys |= set(vars(lightning.LightningModule()))
    return frozenset(keys)


@functools.cache
def _users_own(kind: type) -> bool:
    """A module class of the user's own code (not torch's, Lightning's, speedkit's or an installed library's)."""
    from speedkit.rewrite.source import is_users_own_file

    try:
        return is_users_own_file(inspect.getfile(kind))
    except (TypeError, OSError):  # a class made at run time, or a builtin
        return False


class UserAttributes:
    """The plain Python attributes of the user's own modules in ``model``, and how to put them back."""

    def __init__(self, model: nn.Module) -> None:
        self.saved: list[tuple[nn.Module, str, Any]] = []
        self.others: list[tuple[nn.Module, str, int]] = []
        #: the user's modules, and the attribute names each had
        self.names: list[tuple[nn.Module, frozenset[str]]] = []
        for module in model.modules():
            if not _users_own(type(module)):
                continue
            skip = _framework_keys(type(module))
            self.names.append((module, frozenset(vars(module))))
            for name, value in vars(module).items():
                if name in skip:
                    continue
                if _plain(value, [_PLAIN_ITEMS]):
                    self.saved.append((module, name, copy.deepcopy(value)))
                elif _state_of_another_kind(value):
                    self.others.append((module, name, id(value)))

    def restore(self) -> tuple[list[str], list[str]]:
        """Put every saved attribute back (lists, dicts and sets in place). Returns the attributes that
        had changed ("Model.calls"), and those of other kinds that were rebound since, which are not
        put back ("Model.last_batch (Tensor)")."""
        changed = []
        for module, name, saved in self.saved:
            current = module.__dict__.get(name, _MISSING)
            if current is not _MISSING and type(current) is type(saved) and _equal(current, saved):
                continue
            changed.append(f"{type(module).__name__}.{name}")
            value = copy.deepcopy(saved)
            if type(current) is list and type(value) is list:
                current[:] = value
            elif type(current) in (dict, set) and type(current) is type(value):
                current.clear()
                current.update(value)
            else:
                setattr(module, name, value)
        rebound = [
            f"{type(module).__name__}.{name} ({type(module.__dict__.get(name)).__name__})"
            for module, name, before in self.others
            if id(module.__dict__.get(name, _MISSING)) != before
        ]
        for module, had in self.names:  # attributes the steps made: plain ones go, others are named
            skip = _framework_keys(type(module))
            for name in [n for n in vars(module) if n not in had and n not in skip]:
                value = module.__dict__[name]
                if _plain(value, [_PLAIN_ITEMS]):
                    delattr(module, name)
                    changed.append(f"{type(module).__name__}.{name}")
                elif _state_of_another_kind(value):
                    rebound.append(f"{type(module).__name__}.{name} ({type(value).__name__})")
        return changed, rebound


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a comparison that cannot say: put the value back
        return False


class Snapshot:
    """A copy of the training state; ``restore()`` puts it back in place, any number of times.

    Args:
        model, optimizer: what to save (``optimizer``: one, several in a list (a GAN's two), or None).
        step: the training step (its schedulers and grad scaler are saved), or None.
        data: the batch source (the generators its iteration advances), or None.
        device: where to keep the copy ("cpu" keeps GPU memory figures honest; None = same device).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None,
        step: Any = None,
        data: Any = None,
        device: torch.device | str | None = "cpu",
    ) -> None:
        self.model = model
        self.optimizers = (
            list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer] if optimizer is not None else []
        )
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
            if pin and saved.device.type == "cpu" and local_shard(t).is_cuda:
                saved = saved.pin_memory()
            self.tensors.append((t, saved))
        #: which parameters need gradients: a step toggling them (Lightning's ``toggle_optimizer`` in a GAN's
        #: step) and failing before it untoggles leaves them off, and every later step trains nothing there
        self.requires_grad = [(p, p.requires_grad) for p in model.parameters()]
        self.metrics = [_save_metric(m) for m in _metrics(model)]
        self.attributes = UserAttributes(model)
        #: the user's plain attributes that steps since the snapshot changed and a restore put back
        self.restored_attributes: set[str] = set()
        #: attributes of the user's modules of other kinds that steps rebound and a restore did not put back
        self.unrestored: set[str] = set()
        #: per optimizer: its per-parameter state and its groups' hyper-parameters
        self.opt_saved = [self._save_optimizer(opt) for opt in self.optimizers]
        self.step_state = step.state_dict() if step is not None else None
        self.data_state = data.state_dict() if data is not None else None
        self.rng = RngState.capture()  # the process RNGs

    def _save_optimizer(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[list[tuple[torch.Tensor, dict[str, Any]]], list[dict[str, Any]]]:
        state = [
            (
                p,
                {
                    k: (_saved_state_tensor(v, self.device) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                    for k, v in st.items()
                },
            )
            for p, st in optimizer.state.items()
        ]
        groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params" and k not in _IMPL_FLAGS} for g in optimizer.param_groups
        ]
        return state, groups

    @torch.no_grad()
    def restore(self, rng: bool = True) -> None:
        for live, saved in self.tensors:
            local_shard(live).copy_(saved, non_blocking=True)
            if isinstance(live, nn.Parameter) or live.requires_grad:
                live.grad = None
        for param, needs_grad in self.requires_grad:
            if param.requires_grad != needs_grad:
                param.requires_grad_(needs_grad)
        for metric, state, count in self.metrics:
            _restore_metric(metric, state, count)
        changed, rebound = self.attributes.restore()
        self.restored_attributes.update(changed)
        self.unrestored.update(rebound)
        for opt, (opt_state, opt_groups) in zip(self.optimizers, self.opt_saved):
            opt.state.clear()
            flags = {id(p): g for g in opt.param_groups for p in g["params"]}
            for p, st in opt_state:
                group = flags.get(id(p), {})
                restored = {}
                for k, v in st.items():
                    if isinstance(v, _ShardedState):
                        restored[k] = v.restore()
                    elif isinstance(v, torch.Tensor):
                        target = compat.step_counter_device(group, p) if k == "step" else p.device
                        restored[k] = v.to(target, copy=True)
                    else:
                        restored[k] = copy.deepcopy(v)
                opt.state[p] = restored
            for group, saved in zip(opt.param_groups, opt_groups):
                group.update(copy.deepcopy(saved))
            opt.zero_grad(set_to_none=True)
        if self.step is not None and self.step_state is not None:
            self.step.load_state_dict(self.step_state)
        if self.data is not None and self.data_state is not None:
            self.data.load_state_dict(self.data_state)
        if rng:
            self.restore_rng()

    def restore_rng(self) -> None:
        self.rng.restore()

    def digest(self, *extra: Any) -> str:
        """A digest of the state a restore puts back and of ``extra`` (the batches trajectories from it run
        on): the weights and buffers, the optimizers' state and hyper-parameters, the step's schedules and
        the process RNGs (:func:`speedkit.training.digest.state_digest`). Reads the live tensors, on their
        devices: call it right after :meth:`restore`, when they hold the saved values."""
        optimizers = [(list(opt.state.values()), groups) for opt, (_, groups) in zip(self.optimizers, self.opt_saved)]
        weights = [local_shard(live) for live, _ in self.tensors]
        needs_grad = [g for _, g in self.requires_grad]
        return state_digest([weights, needs_grad, optimizers, self.step_state, self.rng.process, list(extra)])
