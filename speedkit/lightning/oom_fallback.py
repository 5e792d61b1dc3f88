"""OOMFallback: a Lightning fit that runs out of device memory redoes the batch as micro-batches.

A thin callback over :mod:`speedkit.training.accumulate`. For the fit, it takes over the forward and backward
of each batch (the LightningModule's ``training_step`` wrapped on the instance): the batch runs
through a :class:`~speedkit.training.accumulate.MicroBatcher`, whole until a forward or backward runs out of
memory, then split in 2, 4, ... micro-batches whose losses are weighted by their share of the
batch's samples and accumulated. Each micro-batch's backward goes through the module's own
``backward`` hook, scaled by the precision plugin's grad scaler where there is one (fp16) and
divided by ``accumulate_grad_batches`` as Lightning divides. Lightning then runs its own step as
always: its ``backward`` of the returned loss (a leaf: the gradients are there already, so the
module's ``backward`` does nothing for it; ``on_before_backward`` and ``on_after_backward`` fire
once, with the batch's whole gradients), gradient clipping, the optimizer step, the schedulers,
logging, checkpoints. The gradients are zeroed before the batch's first forward rather than after
it (the user's ``optimizer_zero_grad`` runs there; ``on_before_zero_grad`` still fires where Lightning
fires it, after the backward).

After a split, what ``training_step`` returns and logs per step is the last micro-batch's (values
logged ``on_epoch`` average over every micro-batch, weighted by their sizes, as Lightning weighs
batches). Under DDP every rank takes the same split in the same step: each attempt is agreed on by
all ranks (one all-reduce), the micro-batches run on the module DDP wraps with its reducer kept out
of the batch, and the gradients are averaged once the batch is done, where Lightning would sync
them (not within an accumulation's ``no_sync``); a ``self.log(..., sync_dist=True)`` inside
``training_step`` would be a collective inside an attempt and is not supported with it. Manual
optimization and strategies other than DDP are not supported: the callback says so and leaves the
fit as it is. Each split is announced as a warning when it happens. ``fallback.events`` lists each split (step, old and new
micro-batch, time lost); an out-of-memory error with micro-batches of one sample, or in the optimizer
step, stops the fit with one line.

Its checkpoint state is what it decided: the split, the steps run since it last changed (a probe's
count), the smallest micro-batch a probe failed at, and the splits so far. A fit resumed from that
checkpoint starts at that split, with no new out-of-memory attempt at the sizes that failed; under DDP
every rank loads the same state and, at the fit's start, takes the largest split any rank holds (one
all-reduce, on every rank).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from speedkit.distributed import any_rank, average_gradients, largest
from speedkit.errors import ConfigError
from speedkit.files import write_text_atomic
from speedkit.handle import Handle, set_attr
from speedkit.lightning.sharded import sharding
from speedkit.training.accumulate import MicroBatcher, check_probe_after, stop_on_out_of_memory
from speedkit.training.step import loss_of


class OOMFallback(Callback):
    """Redo a batch that ran out of device memory as accumulated micro-batches (module docstring).

    Args:
        probe_after: after this many optimizer steps without an error at a split, try half as many
            micro-batches once (None: the split stays for the rest of the fit).
        report_dir: write ``oom_fallback.json`` there at the end of the fit (rank 0): the micro-batches
            per batch and every split (step, old and new micro-batch, time lost, where it hit).
    """

    def __init__(self, probe_after: int | None = None, report_dir: str | os.PathLike | None = None) -> None:
        check_probe_after(probe_after, "probe_after")
        if report_dir is not None and not isinstance(report_dir, (str, os.PathLike)):
            raise ConfigError("report_dir", f"expected a folder path, found {type(report_dir).__name__} {report_dir!r}")
        self.probe_after = probe_after
        self.report_dir = Path(report_dir) if report_dir is not None else None
        self.fallback: MicroBatcher | None = None
        self.not_applied: str | None = None
        self._handle: Handle | None = None
        self._zeroed = False  # the batch's gradients were zeroed before its forward: Lightning's zero_grad is spent
        self._backward_done = False  # the batch's backward ran: Lightning's backward of the returned loss does nothing
        self._sync_saved = True

    @property
    def events(self) -> list[Any]:
        return list(self.fallback.events) if self.fallback is not None else []

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.not_applied = None
        if not pl_module.automatic_optimization:
            self.not_applied = "manual optimization: the module runs its own backward and optimizer step"
        elif trainer.world_size > 1 and (sharded := sharding(trainer.strategy)) is not None:
            self.not_applied = (
                f"{sharded} over several processes: it gathers the parameters and reduces the "
                "gradients inside every forward and backward, so a rank running out of memory mid-step would leave "
                "the others waiting in that collective (under DDP the split batch runs outside the reducer)"
            )
        elif trainer.world_size > 1 and not isinstance(trainer.strategy.model, DistributedDataParallel):
            self.not_applied = (
                f"{type(trainer.strategy).__name__} over several processes: only DDP is supported "
                "(every rank must take the same split in the same step)"
            )
        if self.not_applied is not None:
            rank_zero_warn(
                f"speedkit OOMFallback: not applied ({self.not_applied}); the fit runs as it is.", category=UserWarning
            )
            return
        params = lambda: (p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"])  # noqa: E731
        if self.fallback is None:
            self.fallback = MicroBatcher(params, model=pl_module, probe_after=self.probe_after)
        else:  # a second fit with the same callback keeps the split it learned
            self.fallback.params, self.fallback.model = params, pl_module
        self.fallback.agree = any_rank if trainer.world_size > 1 else None
        if trainer.world_size > 1:  # every rank starts at the same split (one all-reduce, on every rank)
            self.fallback.parts = int(largest([self.fallback.parts])[0])
        self._bind(trainer, pl_module)

    def _bind(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        own_step, own_backward, own_zero = module.training_step, module.backward, module.optimizer_zero_grad
        batcher = self.fallback
        assert batcher is not None
        ddp = trainer.strategy.model if isinstance(trainer.strategy.model, DistributedDataParallel) else None
        reported = len(batcher.events)

        def training_step(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
            accumulate = trainer.accumulate_grad_batches
            if batch_idx % accumulate == 0:  # where Lightning zeroes (its rule), but before the forward
                for opt in trainer.optimizers:
                    own_zero(trainer.current_epoch, batch_idx, opt)
                self._zeroed = True
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            extras: dict[str, Any] = {}
            # under DDP (this runs inside its forward): Lightning's own choice whether this batch syncs the
            # gradients (not within an accumulation's no_sync); DDP's reducer is kept out of the batch (no
            # backward for it to expect), every attempt agreed on by all ranks, the gradients averaged after
            sync = ddp is not None and ddp.require_backward_grad_sync
            if ddp is not None:
                self._sync_saved = ddp.require_backward_grad_sync
                ddp.require_backward_grad_sync = False

            def forward_backward(part: Any, weight: float) -> Any:
                out = own_step(part, batch_idx, *args, **kwargs)
                if out is None:  # the module skips this batch: Lightning skips its backward and step
                    return None
                if isinstance(out, dict):
                    extras.clear()
                    extras.update((k, v) for k, v in out.items() if k != "loss")
                loss = loss_of(out) * weight
                share = loss / accumulate if accumulate > 1 else loss
                own_backward(scaler.scale(share) if scaler is not None else share)
                return loss.detach()

            total = batcher.run(batch, trainer.global_step, forward_backward)
            if total is None:
                if ddp is not None:
                    ddp.require_backward_grad_sync = self._sync_saved
                return None
            if sync:
                average_gradients(batcher.params())
            nonlocal reported
            for event in batcher.events[reported:]:  # never silently
                rank_zero_warn(f"speedkit OOMFallback: {event.describe()}", category=UserWarning)
            reported = len(batcher.events)
            self._backward_done = True
            leaf = total.detach().requires_grad_(True)
            return {"loss": leaf, **extras} if extras else leaf

        def backward(loss: Any, *args: Any, **kwargs: Any) -> None:
            if self._backward_done:  # the batch's gradients are there already
                self._backward_done = False
                if ddp is not None:
                    ddp.require_backward_grad_sync = self._sync_saved
                return
            own_backward(loss, *args, **kwargs)

        def optimizer_zero_grad(epoch: int, batch_idx: int, optimizer: Any) -> None:
            if self._zeroed:  # zeroed before this batch's forward
                self._zeroed = False
                return
            own_zero(epoch, batch_idx, optimizer)

        own_optimizer_step = module.optimizer_step

        def optimizer_step(*args: Any, **kwargs: Any) -> None:
            with stop_on_out_of_memory("the optimizer step", batcher):
                own_optimizer_step(*args, **kwargs)

        training_step.oom_fallback = batcher  # type: ignore[attr-defined]  # a CUDA graph's step finds it here
        handle = Handle("oom_fallback")
        set_attr(handle, module, "training_step", training_step, "training_step: forward and backward per micro-batch")
        set_attr(handle, module, "backward", backward)
        set_attr(handle, module, "optimizer_zero_grad", optimizer_zero_grad)
        set_attr(handle, module, "optimizer_step", optimizer_step)
        self._handle = handle

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.report_dir is not None and self.fallback is not None and trainer.is_global_zero:
            doc = {"schema_version": 1, **self.fallback.report(), "events_text": [e.describe() for e in self.fallback.events]}
            write_text_atomic(self.report_dir / "oom_fallback.json", json.dumps(doc, indent=2) + "\n")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.undo()
            self._handle = None
        self._zeroed = self._backward_done = False

    @override
    def state_dict(self) -> dict[str, Any]:
        """What the fallback decided: the split (``micro_batches``), the steps it ran without an error
        since it last changed (a probe's count), the smallest micro-batch a probe failed at, and every
        split so far (``events``)."""
        if self.fallback is None:
            return {}
        return {
            **self.fallback.report(),
            "steady_steps": self.fallback.steady_steps,
            "largest_failed": self.fallback.largest_failed,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a resumed run starts at the split it had (the memory it ran out of has not grown): no new attempt
        # at a split that failed; under DDP every rank loads the same checkpoint, so the split is the same
        parts = state_dict.get("micro_batches")
        if not isinstance(parts, int) or parts < 1:
            return
        if self.fallback is None:
            self.fallback = MicroBatcher(lambda: iter(()), probe_after=self.probe_after)
        self.fallback.restore(
            parts,
            steady_steps=state_dict.get("steady_steps", 0),
            largest_failed=state_dict.get("largest_failed"),
            events=state_dict.get("events", []),
        )
