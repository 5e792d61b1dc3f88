"""DistributedDataParallel's knobs in a Lightning fit: what ``DDPStrategy`` wraps with, and changing it.

Before the strategy wraps the module (the callbacks' ``setup``), a change goes into what Lightning's own
``DDPStrategy`` wraps with: its DDP keyword arguments and its communication hook (which Lightning
registers on CUDA only; the strategy's ``configure_ddp`` is wrapped to register it elsewhere too, gloo
runs them). After it wrapped (trials run at ``on_train_start``), a new ``DistributedDataParallel`` is
made over the same module with the changed arguments and set as ``trainer.strategy.model``: Lightning
reads the wrapper through ``strategy.model`` wherever it uses it (the forward's redirection,
``no_sync`` on accumulation, ``teardown``'s unwrap) and keeps no other reference to it. A communication
hook can be registered only once per DDP object, hence the new wrapper.

The changes in effect on a strategy are kept together (``_Wrappings``): its wrappers are kept by
configuration (the strategy's arguments and the changes in effect), so switching any change off and on,
in any order, sets the very wrapper made for that configuration before (Lightning's own among them,
its reducer still valid), and makes one only for a configuration not met yet. Each wrapper holds its own
gradient buckets: while changes are tried after wrapping, a gradient-sized buffer per configuration met.
Making a wrapper is a collective (DDP broadcasts the module's state from rank 0): every rank switches
the same changes in the same order. Once every change is undone, the wrappers other than the one in
use go.
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from speedkit import compat
from speedkit.handle import Handle


def is_ddp(strategy: Any) -> bool:
    """Whether ``strategy`` wraps the module in ``DistributedDataParallel`` (ddp, ddp_spawn, ddp_fork...)."""
    return isinstance(strategy, DDPStrategy)


def ddp_options(trainer: Any) -> dict[str, Any] | None:
    """What :meth:`speedkit.training.step.Step.ddp_options` says of ``trainer``'s fit: None unless it trains
    under DDP on several processes; else the DDP keyword arguments the strategy sets, with "comm_hook"
    (the hook's name, None for DDP's own all-reduce) and "backend" (the process group's)."""
    strategy = trainer.strategy
    if not is_ddp(strategy) or int(trainer.world_size or 1) <= 1:
        return None
    options = compat.lightning_ddp_kwargs(strategy)
    hook = compat.lightning_ddp_comm_hook(strategy)
    if isinstance(strategy.model, DistributedDataParallel):
        registered = compat.ddp_comm_hooks(strategy.model)
        hook = registered[0][0] if registered else hook
    options["comm_hook"] = _hook_name(hook) if hook is not None else None
    options["backend"] = strategy.process_group_backend
    return options


def set_ddp(trainer: Any, **changes: Any) -> Handle:
    """Wrap ``trainer``'s module with ``changes`` (DDP keyword arguments, and "comm_hook"): see the module
    docstring. The handle undoes it and can suspend and resume it, in any order among several."""
    strategy = trainer.strategy
    if not is_ddp(strategy):
        raise RuntimeError(f"the fit's strategy is {type(strategy).__name__}, not DDPStrategy: no DDP knobs to set")
    wrappings = _WRAPPINGS.get(strategy)
    if wrappings is None:
        wrappings = _WRAPPINGS[strategy] = _Wrappings(strategy)
    hook = changes.get("comm_hook")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in changes.items() if k != "comm_hook")
    wrapped = isinstance(strategy.model, DistributedDataParallel)
    described = ", ".join(([kwargs] if kwargs else []) + ([f"the communication hook {_hook_name(hook)}"] if hook else []))
    change = dict(changes)
    handle = Handle("ddp")

    def on() -> None:
        wrappings.active.append(change)
        wrappings.refresh()

    def off() -> None:
        wrappings.active.remove(change)
        wrappings.refresh()

    def release() -> None:  # on undo (suspended or not): this change is gone for good
        wrappings.live -= 1
        if not wrappings.live:  # all undone: the wrappers not in use go
            wrappings.wrappers = {k: w for k, w in wrappings.wrappers.items() if w is strategy.model}

    wrappings.live += 1
    handle.record("", release, persistent=True)
    on()
    handle.record(
        f"the module wrapped anew in DistributedDataParallel with {described}"
        if wrapped
        else f"DDPStrategy wraps the module in DistributedDataParallel with {described}",
        off,
        on,
    )
    return handle


class _Wrappings:
    """The DDP changes in effect on one strategy, and the wrappers made for them (by configuration), so
    that switching a change off and on again sets the very same wrapper, whatever the order."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = weakref.ref(strategy)  # the entry of _WRAPPINGS goes with the strategy
        self.base_kwargs = compat.lightning_ddp_kwargs(strategy)
        self.base_hook = compat.lightning_ddp_comm_hook(strategy)
        self.active: list[dict[str, Any]] = []
        self.live = 0  # changes not undone yet (in effect or suspended)
        self.wrappers: dict[tuple[Any, ...], DistributedDataParallel] = {}
        self._configure_ddp: Any = None  # the strategy's own configure_ddp while ours registers the hook
        self._own_configure_ddp = False  # whether that one was set on the instance

    def _key(self, kwargs: dict[str, Any], hook: Any) -> tuple[Any, ...]:
        return (tuple(sorted((k, repr(v)) for k, v in kwargs.items())), id(hook))

    @property
    def strategy(self) -> Any:
        return self._strategy()

    def refresh(self) -> None:
        """Set what the strategy wraps with to the base and the changes in effect; where it wrapped the
        module already, set the wrapper made for that (made now if none was: a collective)."""
        strategy = self.strategy
        model = strategy.model
        if isinstance(model, DistributedDataParallel) and all(model is not w for w in self.wrappers.values()):
            # Lightning's own wrapper, made with what the strategy held until now
            self.wrappers[self._key(compat.lightning_ddp_kwargs(strategy), compat.lightning_ddp_comm_hook(strategy))] = model
        kwargs, hook = dict(self.base_kwargs), self.base_hook
        for change in self.active:
            kwargs.update((k, v) for k, v in change.items() if k != "comm_hook")
            hook = change.get("comm_hook", hook)
        compat.lightning_set_ddp_kwargs(strategy, kwargs)
        compat.lightning_set_ddp_comm_hook(strategy, hook)
        self._register_hook_off_cuda(hook is not self.base_hook)
        if isinstance(model, DistributedDataParallel):
            key = self._key(kwargs, hook)
            wrapper = self.wrappers.get(key)
            if wrapper is None:
                wrapper = self.wrappers[key] = compat.lightning_wrap_ddp(strategy, model.module, kwargs)
                compat.lightning_register_missing_comm_hook(strategy, wrapper)
            strategy.model = wrapper

    def _register_hook_off_cuda(self, on: bool) -> None:
        """While a change sets the hook, the strategy's ``configure_ddp`` also registers it where Lightning
        does not (off CUDA)."""
        strategy = self.strategy
        if on and self._configure_ddp is None:
            self._own_configure_ddp = "configure_ddp" in vars(strategy)
            self._configure_ddp = original = strategy.configure_ddp

            def configure_ddp() -> None:
                original()
                compat.lightning_register_missing_comm_hook(strategy, strategy.model)

            strategy.configure_ddp = configure_ddp
        elif not on and self._configure_ddp is not None:
            if self._own_configure_ddp:
                strategy.configure_ddp = self._configure_ddp
            else:
                vars(strategy).pop("configure_ddp", None)
            self._configure_ddp = None


#: the changes in effect per strategy (an entry lives while a change does)
_WRAPPINGS: weakref.WeakKeyDictionary[Any, _Wrappings] = weakref.WeakKeyDictionary()


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or type(hook).__name__
