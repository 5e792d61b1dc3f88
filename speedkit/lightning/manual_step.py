"""The user's own training step under Lightning's manual optimization, as the unit the trials time.

A LightningModule with ``automatic_optimization = False`` (GANs, reinforcement learning, several
optimizers, accumulation by hand) steps its optimizers inside its own ``training_step``: it calls
``self.optimizers()``, ``self.manual_backward(loss)``, ``opt.step()``, ``opt.zero_grad()``, perhaps
``self.toggle_optimizer``. :class:`ManualLightningStep` runs that ``training_step`` the way Lightning's
manual loop does (``strategy.training_step``: the precision plugin's forward context, the strategy's
wrapper; the ``LightningOptimizer`` wrappers step through the strategy and the precision plugin, so
loss scaling and ``on_before_optimizer_step`` hooks run as in the fit), one batch per step: a
"step" of a manual fit is one ``training_step`` call, in the trials and in the fit's own timing
(:class:`speedkit.lightning.steps.OptimizerSteps`).

Parity reads the losses the step backpropagates (every ``manual_backward`` call, summed: a GAN's
generator and discriminator losses), else the loss it returns. The snapshot saves every optimizer
(:meth:`all_optimizers`), so the trials put back both of a GAN's.

What a rung cannot do here it says (:meth:`optimizer_step_blocker`): a CUDA graph of the step, merged
micro-batches and the out-of-memory fallback need to run the optimizer step themselves. Rungs that change
the model, the precision plugin, process flags or the data source work as in automatic optimization;
fused_optimizer switches each optimizer. Manual optimization across several processes runs no
trials (the DDP guards average gradients around the optimizer step, which the user's code holds).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from speedkit.lightning.step import LightningStep
from speedkit.training.step import loss_of

#: why rungs that run the optimizer step themselves cannot work on a manual-optimization step
USER_STEPS_OPTIMIZERS = (
    "the LightningModule sets automatic_optimization = False: its training_step steps the optimizers itself, "
    "and this rung needs to run the optimizer step"
)


def fit_step(trainer: pl.Trainer, module: pl.LightningModule) -> LightningStep:
    """The step of ``trainer``'s fit: automatic optimization's, or the module's own under manual optimization."""
    return LightningStep(trainer, module) if module.automatic_optimization else ManualLightningStep(trainer, module)


class ManualLightningStep(LightningStep):
    """One ``training_step`` call of a manual-optimization LightningModule (module docstring)."""

    @property
    def accumulate(self) -> int:
        return 1  # Lightning refuses accumulate_grad_batches with manual optimization: the user accumulates

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.trainer.optimizers)

    def optimizer_step_blocker(self) -> str | None:
        return USER_STEPS_OPTIMIZERS

    def forward_loss(self, batch: Any, batch_idx: int = 0) -> torch.Tensor:
        raise NotImplementedError("a manual-optimization training_step steps its optimizers: it has no forward alone")

    def counted_pass(self, batch: Any, batch_idx: int = 0) -> None:
        self.compute([batch], batch_idx)  # the whole step: its forwards and backwards are what it runs

    def compute(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        for k, batch in enumerate(batches):
            if self._log is not None:
                self._log.batch(batch)
            with self._recording_backwards() as backwards:
                out = self.strategy.training_step(*self._args(batch, batch_idx * len(batches) + k))
            if backwards:
                losses.append(torch.stack([b.float() for b in backwards]).sum())
            elif out is not None:
                losses.append(loss_of(out).detach().float())
            if self._log is not None:
                self._log.step_done()
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum()

    @contextlib.contextmanager
    def _recording_backwards(self) -> Iterator[list[torch.Tensor]]:
        """``self.manual_backward(loss)`` as it is, each scalar loss recorded (detached) for parity."""
        module = self.model
        recorded: list[torch.Tensor] = []
        own = module.manual_backward

        def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if isinstance(loss, torch.Tensor) and loss.dim() == 0:
                recorded.append(loss.detach())
            own(loss, *args, **kwargs)

        had = "manual_backward" in module.__dict__
        saved = module.__dict__.get("manual_backward")
        module.manual_backward = manual_backward  # type: ignore[method-assign]
        try:
            yield recorded
        finally:
            if had:
                module.manual_backward = saved  # type: ignore[method-assign]
            else:
                del module.manual_backward

    def after_step(self, batch_idx: int) -> None:
        """Nothing: under manual optimization Lightning steps no scheduler, the user's step does."""

    @contextlib.contextmanager
    def guarded(self, on: bool = True) -> Iterator[None]:
        yield  # one process only (module docstring)
