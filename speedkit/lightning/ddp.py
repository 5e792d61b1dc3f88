"""DistributedDataParallel's knobs in a Lightning fit: what ``DDPStrategy`` wraps with, and changing it.

Before the strategy wraps the module (the callbacks' ``setup``), a change goes into what Lightning's own
``DDPStrategy`` wraps with: its DDP keyword arguments and its communication hook (which Lightning
registers on CUDA only; the strategy's ``configure_ddp`` is wrapped to register it elsewhere too, gloo
runs them). After it wrapped (trials run at ``on_train_start``), a new ``DistributedDataParallel`` is
made over the same module with the changed arguments and set as ``trainer.strategy.model``: Lightning
reads the wrapper through ``strategy.model`` wherever it uses it (the forward's redirection,
``no_sync`` on accumulation, ``teardown``'s unwrap) and keeps no other reference to it. The previous
wrapper stays alive, its reducer valid, and comes back on undo (and on suspend; resume sets the new
one again). A communication hook can be registered only once per DDP object, hence the new wrapper.
"""

from __future__ import annotations

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
    docstring. The handle undoes it and can suspend and resume it."""
    strategy = trainer.strategy
    if not is_ddp(strategy):
        raise RuntimeError(f"the fit's strategy is {type(strategy).__name__}, not DDPStrategy: no DDP knobs to set")
    hook = changes.pop("comm_hook", None)
    kwargs = ", ".join(f"{k}={v!r}" for k, v in changes.items())
    described = ", ".join(([kwargs] if kwargs else []) + ([f"the communication hook {_hook_name(hook)}"] if hook else []))
    handle = Handle("ddp")
    before, after = compat.lightning_ddp_kwargs(strategy), {**compat.lightning_ddp_kwargs(strategy), **changes}
    wrapped = strategy.model if isinstance(strategy.model, DistributedDataParallel) else None
    if wrapped is None:
        _set_what_the_strategy_wraps_with(handle, strategy, before, after, hook, kwargs)
        return handle
    # already wrapped: a new wrapper over the same module, with the previous one's hook (the user's) or the new one
    new = compat.lightning_wrap_ddp(strategy, wrapped.module, after)
    for registered, state in compat.ddp_comm_hooks(wrapped) if hook is None else [(hook, None)]:
        new.register_comm_hook(state, registered)

    def swap(old: Any, replacement: Any) -> None:
        if strategy.model is old:  # after the strategy's teardown unwrapped the module, nothing to put back
            strategy.model = replacement

    swap(wrapped, new)
    handle.record(
        f"DistributedDataParallel rebuilt over the same module with {described}",
        lambda: swap(new, wrapped),
        lambda: swap(wrapped, new),
    )
    return handle


def _set_what_the_strategy_wraps_with(
    handle: Handle, strategy: Any, before: dict[str, Any], after: dict[str, Any], hook: Any, kwargs: str
) -> None:
    compat.lightning_set_ddp_kwargs(strategy, after)
    handle.record(
        f"DDPStrategy wraps the module with DistributedDataParallel({kwargs})" if kwargs else "",
        lambda: compat.lightning_set_ddp_kwargs(strategy, before),
        lambda: compat.lightning_set_ddp_kwargs(strategy, after),
    )
    if hook is None:
        return
    previous_hook = compat.lightning_ddp_comm_hook(strategy)
    compat.lightning_set_ddp_comm_hook(strategy, hook)
    handle.record(
        f"DDPStrategy registers the communication hook {_hook_name(hook)}",
        lambda: compat.lightning_set_ddp_comm_hook(strategy, previous_hook),
        lambda: compat.lightning_set_ddp_comm_hook(strategy, hook),
    )
    original = strategy.configure_ddp
    if getattr(original, "registers_missing_hook", False):
        return

    def configure_ddp() -> None:
        original()
        compat.lightning_register_missing_comm_hook(strategy, strategy.model)

    configure_ddp.registers_missing_hook = True  # type: ignore[attr-defined]
    had_own = "configure_ddp" in vars(strategy)
    strategy.configure_ddp = configure_ddp

    def unwrap() -> None:
        if had_own:
            strategy.configure_ddp = original
        else:
            vars(strategy).pop("configure_ddp", None)

    handle.record("", unwrap, lambda: setattr(strategy, "configure_ddp", configure_ddp))


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or type(hook).__name__
