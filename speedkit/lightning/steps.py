"""OptimizerSteps: which of a Lightning fit's batches start and end an optimizer step, the one rule
every timer of a fit (StepTimer, SpeedProfiler, SpeedLadder's check of the fit) counts steps by.

An optimizer step ended with a batch when the Trainer's ``global_step`` moved while it ran: every
``accumulate_grad_batches`` batches, and also at an epoch's last batch where they do not divide the
epoch (Lightning steps the optimizer there), which a count of batch indices misses. A step starts
with the first batch after the last step ended. A batch skipped before it ran (``on_train_batch_start``
returning -1) neither starts nor ends one. Under manual optimization every batch is a step: one
``training_step`` call, whatever optimizers it steps (a GAN's two move ``global_step`` by two), as the
trials time it (:mod:`speedkit.lightning.manual_step`).
"""

from __future__ import annotations

from typing import Any


class OptimizerSteps:
    """Tells a fit's timer where its optimizer steps start and end (module docstring)."""

    def __init__(self) -> None:
        self.in_step = False  # a batch of the current optimizer step has started
        self._step_at_start = 0  # the Trainer's global_step when the current optimizer step started

    def batch_started(self, trainer: Any) -> bool:
        """A batch is about to run; whether it is the first of an optimizer step."""
        if self.in_step:
            return False
        self.in_step, self._step_at_start = True, trainer.global_step
        return True

    def batch_ended(self, trainer: Any) -> bool:
        """A batch ran; whether an optimizer step ended with it."""
        if not self.in_step:
            return False
        module = getattr(trainer, "lightning_module", None)
        manual = module is not None and not module.automatic_optimization
        if not manual and trainer.global_step == self._step_at_start:
            return False
        self.in_step = False
        return True
