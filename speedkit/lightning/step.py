"""The user's own Lightning training step, driven through the Trainer's public API.

:class:`LightningStep` runs one optimizer step the way Lightning's automatic optimization does:
``strategy.training_step`` (under the precision plugin's forward context, through the strategy's
wrapper, DDP's included), the loss divided by ``accumulate_grad_batches``, zero-grad on the first
micro-batch (``on_before_zero_grad`` and ``optimizer_zero_grad`` hooks), ``strategy.backward``
(the plugin's loss scaling and the backward hooks), the module's ``optimizer_step`` hook with the
Trainer's ``LightningOptimizer`` (the plugin's unscaling, the Trainer's gradient clipping through
``configure_gradient_clipping``, the scaler's step), then the step-interval learning-rate
schedulers through ``lr_scheduler_step``. Micro-batches before the last skip DDP's gradient sync.

:class:`LightningSource` feeds it from the Trainer's own train dataloader, moved the way the loop
moves batches (the plugin's input conversion, ``on_before_batch_transfer``,
``strategy.batch_to_device``).

During trials (``step.trial()``), ``self.log`` writes into a scratch result collection whose
metrics are computed after every batch as the loop does (so trial steps cost what training steps
cost, progress-bar syncs included, and nothing reaches the user's metrics or loggers), and a
schedule that runs out is rewound instead of raising.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType

from speedkit import compat, distributed
from speedkit.data.source import BatchSource
from speedkit.handle import Handle
from speedkit.lightning import ddp
from speedkit.lightning.data import overridden_transfer_hooks
from speedkit.lightning.sharded import sharding
from speedkit.training.step import NUMERICS, LogCall, ScheduleGuard, Step, loss_of, restore_scaler

_MIXED = {"bf16": "bf16-mixed", "fp16": "16-mixed"}


class ClippingMixedPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision``, set by the autocast rung. Lightning's refuses gradient clipping
    with an optimizer that unscales its own gradients (a fused one): with a GradScaler, gradients
    would be clipped while still scaled. bf16 runs no GradScaler, so nothing is scaled and clipping
    before a fused step is exact; this plugin then clips as Lightning's fp32 plugin does. With a
    scaler (fp16) it refuses as Lightning does."""

    def clip_gradients(
        self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM
    ) -> None:
        if self.scaler is None:
            Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)


class LightningStep(Step):
    """One optimizer step of ``trainer``'s automatic optimization.

    Args:
        trainer: a Trainer inside ``fit``, its strategy set up (from ``on_fit_start`` on).
        module: the LightningModule being trained.
    """

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.trainer = trainer
        self.model = module
        self.device = trainer.strategy.root_device
        self._scaler_initial: dict[int, dict[str, Any]] = {}
        self._schedule = ScheduleGuard()
        self._log: compat.TrialLog | None = None
        self._guarded = False  # guarded(): the DDP steps' failures shared, gradients averaged by hand
        sig = inspect.signature(module.training_step)
        self._takes_batch_idx = (
            len([p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)])
            >= 2
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:  # type: ignore[override]
        optimizers = self.trainer.optimizers
        return optimizers[0] if len(optimizers) == 1 else None

    @property
    def strategy(self) -> Any:
        return self.trainer.strategy

    @property
    def accumulate(self) -> int:
        return int(self.trainer.accumulate_grad_batches)

    def world_size(self) -> int:
        return int(self.trainer.world_size or 1)

    def oom_fallback(self) -> Any | None:
        """OOMFallback's micro-batcher where the callback wraps the module's ``training_step``."""
        return getattr(getattr(self.model, "training_step", None), "oom_fallback", None)

    def has_schedule(self) -> bool:
        return bool(self.trainer.lr_scheduler_configs)

    def host_processes(self) -> tuple[int, int]:
        """The Trainer's local rank among its devices on this machine (one process per device)."""
        if self.trainer.world_size <= 1:
            return 0, 1
        return int(self.trainer.local_rank), max(1, int(self.trainer.num_devices))

    # -- the step --------------------------------------------------------------------------
    def forward_loss(self, batch: Any, batch_idx: int = 0) -> torch.Tensor:
        return loss_of(self.strategy.training_step(*self._args(batch, batch_idx)))

    def compute(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        trainer = self.trainer
        saved = trainer.accumulate_grad_batches
        if len(batches) == saved:
            return self._compute(batches, batch_idx)
        # fewer, merged micro-batches (micro_batch): hooks and callbacks that read the accumulation
        # (OOMFallback's loss share and zeroing) see what the fit's loop will hold with them
        trainer.accumulate_grad_batches = len(batches)
        try:
            return self._compute(batches, batch_idx)
        finally:
            trainer.accumulate_grad_batches = saved

    def _compute(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        trainer, module = self.trainer, self.model
        optimizer = module.optimizers()  # the Trainer's LightningOptimizer
        raw = self.optimizer
        n = len(batches)
        losses: list[torch.Tensor] = []
        every_micro = getattr(self.strategy, "handles_gradient_accumulation", False)
        # a static-graph DDP wrapper's first iteration runs through it, unguarded (see compat)
        guard = (
            self._guarded
            and self.world_size() > 1
            and sharding(self.strategy) is None  # FSDP reduces inside its own backward hooks (sharded.py)
            and not compat.ddp_static_graph_pending(self.strategy.model)
        )
        for k, batch in enumerate(batches):
            idx = batch_idx * n + k

            def closure(batch: Any = batch, idx: int = idx, first: bool = k == 0, last: bool = k == n - 1) -> torch.Tensor | None:
                loss = None
                with distributed.together() if guard else contextlib.nullcontext():
                    if self._log is not None:
                        self._log.batch(batch)
                    out = self._training_step(self._args(batch, idx), guard)
                    if out is not None:  # Lightning skips the backward of a step that returns None
                        loss = loss_of(out) / n
                        if first:
                            module.on_before_zero_grad(raw)
                            module.optimizer_zero_grad(trainer.current_epoch, idx, raw)
                        self.strategy.backward(loss, raw)
                        losses.append(loss.detach())
                if guard and last:  # every rank got here: the gradients averaged as DDP's reducer does
                    distributed.average_gradients(module.parameters())
                return loss

            if k < n - 1 and not every_micro and not guard:
                sync = getattr(self.strategy, "block_backward_sync", None)
                with sync() if sync is not None else contextlib.nullcontext():
                    closure()
            else:
                module.optimizer_step(trainer.current_epoch, idx, optimizer, closure)
            if self._log is not None:
                self._log.step_done()
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum()

    def _training_step(self, args: tuple[Any, ...], guard: bool) -> Any:
        """The strategy's training step; guarded, the module's own beneath DDP's wrapper (DDP's forward
        prepares no gradient sync then, and its buffer broadcast is not made), in the plugin's context."""
        if not guard:
            return self.strategy.training_step(*args)
        with self.strategy.precision_plugin.train_step_context():
            return self.model.training_step(*args)

    def after_step(self, batch_idx: int) -> None:
        self._step_schedulers(batch_idx)

    @contextlib.contextmanager
    def guarded(self, on: bool = True) -> Iterator[None]:
        saved, self._guarded = self._guarded, on
        try:
            yield
        finally:
            self._guarded = saved

    def prepare_capture(self) -> int:
        ddp = self.strategy.model
        if self.world_size() <= 1 or not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return 0
        return compat.ddp_forwards_before_capture(ddp)

    def gradient_sync(self, on: bool) -> None:
        ddp = self.strategy.model
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            ddp.require_backward_grad_sync = on

    def gradient_sync_fixed(self) -> str | None:
        sharded = sharding(self.strategy)
        if sharded is not None and self.world_size() > 1:
            return (
                f"{sharded} reduces the gradients inside its backward hooks: no switch takes that out of a step; "
                "bench/across_gpus.py measures scaling against one GPU"
            )
        return None

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[LogCall]]:
        """``self.log``/``self.log_dict`` recorded instead of made, the trials' metric computation
        (a host sync for progress-bar values) off, and the optimizer progress counters put back."""
        logs: list[LogCall] = []
        saved_log, self._log = self._log, None
        progress = compat.lightning_optimizer_progress(self.trainer)
        saved_progress = progress.state_dict() if progress is not None else None
        with compat.recording_logs(self.model, logs):
            try:
                yield logs
            finally:
                self._log = saved_log
                if progress is not None:
                    progress.load_state_dict(saved_progress)

    def emit(self, logs: Sequence[LogCall], batch: Any) -> None:
        if not logs and self._log is None:
            return
        if self._log is not None:
            self._log.batch(batch)
        with compat.lightning_logging_as(self.model, "training_step"):
            for args, kwargs, _ in logs:  # fresh copies: the replayed graph overwrites its outputs next step
                self.model.log(*[_fresh(a) for a in args], **{k: _fresh(v) for k, v in kwargs.items()})
        if self._log is not None:
            self._log.step_done()

    def _args(self, batch: Any, batch_idx: int) -> tuple[Any, ...]:
        return (batch, batch_idx) if self._takes_batch_idx else (batch,)

    def _step_schedulers(self, step_idx: int) -> None:
        for config in self.trainer.lr_scheduler_configs:
            if config.interval != "step" or config.reduce_on_plateau or (step_idx + 1) % config.frequency:
                continue
            self._schedule.step(config.scheduler, lambda c=config: self.model.lr_scheduler_step(c.scheduler, None))

    # -- precision -------------------------------------------------------------------------
    @property
    def numerics(self) -> str:
        return NUMERICS.get(str(self.trainer.precision_plugin.precision), "fp32")

    def precision_choice(self) -> str | None:
        precision = str(self.trainer.precision_plugin.precision)
        if precision not in ("32-true", "32"):
            return f"the Trainer already runs precision={precision!r}; speedkit leaves it as chosen"
        if sharding(self.strategy) == "FSDP (FSDPStrategy)":
            return (
                "FSDPStrategy sets its precision when it wraps the module (its FSDPPrecision plugin's mixed-precision "
                "policy): a precision plugin swapped in afterwards would not reach it"
            )
        return None

    def why_no_optimizer(self) -> str | None:
        optimizers = self.trainer.optimizers
        if len(optimizers) > 1:
            return (
                f"the Trainer has {len(optimizers)} optimizers (configure_optimizers returned several); "
                "this rung changes the optimizer of a single-optimizer fit"
            )
        if not optimizers:
            return "the Trainer has no optimizer yet (Lightning builds it as the fit starts)"
        if compat.lightning_no_optimizer(optimizers[0]):
            return "configure_optimizers returned None: the fit trains no parameters"
        return super().why_no_optimizer()

    def fused_optimizer_blocker(self) -> str | None:
        from lightning.pytorch.utilities.model_helpers import is_overridden

        plugin = self.trainer.precision_plugin
        if not isinstance(plugin, MixedPrecision) or (isinstance(plugin, ClippingMixedPrecision) and plugin.scaler is None):
            return None
        clip = self.trainer.gradient_clip_val
        if clip:
            return (
                f"Lightning's mixed precision refuses gradient clipping (gradient_clip_val={clip}) with an optimizer "
                "that unscales its own gradients, as a fused one does"
            )
        if is_overridden("configure_gradient_clipping", self.model, pl.LightningModule):
            return (
                "the LightningModule clips in its own configure_gradient_clipping, which Lightning's mixed precision "
                "refuses with an optimizer that unscales its own gradients, as a fused one does"
            )
        return None

    def set_autocast(self, dtype_name: str) -> Handle:
        handle = Handle("autocast")
        strategy = self.strategy
        previous = strategy.precision_plugin
        plugin = ClippingMixedPrecision(_MIXED[dtype_name], device=self.device.type)  # type: ignore[arg-type]
        if plugin.scaler is not None:
            self._scaler_initial[id(plugin.scaler)] = plugin.scaler.state_dict()

        def set_plugin(p: Any) -> None:
            strategy.precision_plugin = p

        set_plugin(plugin)
        handle.record(
            f"Trainer precision plugin: {type(previous).__name__}({previous.precision}) -> "
            f"MixedPrecision({_MIXED[dtype_name]!r})",
            lambda: set_plugin(previous),
            lambda: set_plugin(plugin),
        )
        return handle

    # -- DistributedDataParallel's knobs ----------------------------------------------------
    def ddp_options(self) -> dict[str, Any] | None:
        return ddp.ddp_options(self.trainer)

    def set_ddp(self, **changes: Any) -> Handle:
        return ddp.set_ddp(self.trainer, **changes)

    # -- state -----------------------------------------------------------------------------
    @property
    def scaler(self) -> Any:  # type: ignore[override]
        """The precision plugin's GradScaler (fp16 mixed precision), None without one."""
        return getattr(self.trainer.precision_plugin, "scaler", None)

    def state_dict(self) -> dict[str, Any]:
        scaler = self.scaler
        return {
            "scaler": (scaler, scaler.state_dict()) if scaler is not None else None,
            "schedulers": [(c.scheduler, c.scheduler.state_dict()) for c in self.trainer.lr_scheduler_configs],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_scaler(self.scaler, state.get("scaler"), self._scaler_initial)
        for scheduler, saved in state.get("schedulers", []):
            scheduler.load_state_dict(saved)

    @contextlib.contextmanager
    def trial(self) -> Iterator[None]:
        schedulers = [c.scheduler for c in self.trainer.lr_scheduler_configs]
        with compat.lightning_trial_logging(self.trainer, self.model) as log, self._schedule.trial(schedulers):
            if log is not None:
                self._log = log
                try:
                    yield
                finally:
                    self._log = None
                return
            with _logging_off(self.model):
                yield


@contextlib.contextmanager
def _logging_off(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` as no-ops, where trial steps cannot log into a scratch collection."""
    missing = object()
    saved = {name: module.__dict__.get(name, missing) for name in ("log", "log_dict")}
    for name in saved:
        setattr(module, name, _no_log)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is missing:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, previous)


def _fresh(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during speedkit's trials: trial steps never reach the user's metrics."""


class LightningSource(BatchSource):
    """The Trainer's own train dataloader (one DataLoader, or several combined as Lightning does),
    iterated through copies that leave the iterator Lightning already started for the first epoch
    alone (see :func:`speedkit.compat.trial_loader`)."""

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        loaders = trainer.train_dataloader
        if loaders is None:
            raise RuntimeError("the Trainer has no train dataloader yet")
        super().__init__(loaders, trainer.strategy.root_device)
        self._combined = isinstance(loaders, (list, tuple, dict))
        if self._combined:
            from lightning.pytorch.utilities import CombinedLoader

            copies = (
                type(loaders)((k, compat.trial_loader(v)) for k, v in loaders.items())
                if isinstance(loaders, dict)
                else type(loaders)(compat.trial_loader(v) for v in loaders)
            )
            self._copies = list(copies.values()) if isinstance(copies, dict) else list(copies)
            self.iterable = CombinedLoader(copies, "max_size_cycle")
        self.trainer = trainer
        self.module = module

    def epoch(self) -> Iterator[Any]:
        items = super().epoch()
        # a CombinedLoader yields (batch, batch_idx, dataloader_idx)
        return (item[0] for item in items) if self._combined else items

    def host_batch_hooks(self) -> list[str]:
        return overridden_transfer_hooks(self.trainer, self.module)

    def to_device(self, batch: Any) -> Any:
        batch = compat.lightning_before_batch_transfer(self.trainer, self.module, batch)
        return self.trainer.strategy.batch_to_device(batch)

    def release(self) -> None:
        for loader in self._copies if self._combined else [self.iterable]:
            compat.shutdown_workers(loader)
