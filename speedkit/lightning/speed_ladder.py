"""SpeedLadder: apply speedkit rungs inside a Lightning ``Trainer``.

The callback is a layer of hooks over the rungs, which know nothing of Lightning beyond their
``check_lightning``/``apply_lightning`` methods. Rungs that act on the model or process flags apply
in ``setup`` (before the strategy moves and wraps the model); rungs that need the optimizer apply in
``on_fit_start`` (after ``configure_optimizers``). Everything is undone in ``teardown``.

Lightning's conventions are respected, not fought: autocast becomes Lightning's ``MixedPrecision``
plugin (and a Trainer whose precision the user set is left alone); compile replaces
``module.forward`` the way ``trainer.fit(torch.compile(model))`` does (and a model the user compiled
is left alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from speedkit import rungs as rung_registry
from speedkit.rungs.base import Handle, Rung
from speedkit.state import TrainState

_PRECISIONS = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}


class SpeedLadder(Callback):
    """Apply the given rungs to the Trainer's run, without trials.

    Args:
        rungs: rung names, ``{name, options}`` mappings or Rung instances, in order (typically the
            kept rungs of ``speedkit optimize``, as written in ``optimized.yaml``).

    Raises:
        ConfigError: an unknown rung or a bad option (at construction, before any training).

    Example::

        trainer = Trainer(callbacks=[SpeedLadder(rungs=["tf32", "autocast", "fused_optimizer", "compile"])])
    """

    def __init__(self, rungs: Sequence[str | dict | Rung]) -> None:
        super().__init__()
        self.rungs = rung_registry.make_all(list(rungs), "rungs")
        self.handles: list[Handle] = []
        self.skipped: dict[str, str] = {}
        #: every change applied during the run, kept after teardown undoes them (for reports)
        self.applied_changes: dict[str, list[str]] = {}
        self._state: TrainState | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(rungs=[r.name for r in self.rungs])

    # -- hooks ---------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        precision = _PRECISIONS.get(str(trainer.precision), "fp32")
        self._state = TrainState(model=pl_module, optimizer=None, device=trainer.strategy.root_device, precision=precision)  # type: ignore[arg-type]
        self._apply_stage(trainer, pl_module, "setup")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._state is None:
            return
        self._state.optimizer = trainer.optimizers[0] if trainer.optimizers else None  # type: ignore[assignment]
        self._apply_stage(trainer, pl_module, "fit_start")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        while self.handles:
            self.handles.pop().undo()

    # -- state -----------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rungs": [r.name for r in self.rungs], "applied": dict(self.applied_changes), "skipped": dict(self.skipped)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # decisions are re-made against the resumed run; keep what was recorded for the report
        self.skipped = dict(state_dict.get("skipped", {}))
        self.applied_changes = dict(state_dict.get("applied", {}))

    @property
    def applied(self) -> list[str]:
        return [h.rung for h in self.handles if h.active]

    # -- helpers -----------------------------------------------------------------------------
    def _apply_stage(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        state = self._state
        assert state is not None
        for rung in self.rungs:
            if rung.lightning_stage != stage:
                continue
            if stage == "fit_start" and state.optimizer is None:
                self._skip(rung, "the Trainer has no optimizer")
                continue
            reason = rung.check_lightning(trainer, pl_module, state)
            if reason is not None:
                self._skip(rung, reason)
                continue
            try:
                handle = rung.apply_lightning(trainer, pl_module, state)
            except (torch.OutOfMemoryError, RuntimeError, ValueError, TypeError) as exc:
                # a rung that fails to apply is reported and skipped; training goes on without it
                self._skip(rung, f"failed to apply: {type(exc).__name__}: {exc}")
                continue
            self.handles.append(handle)
            self.applied_changes[rung.name] = list(handle.changes)

    def _skip(self, rung: Rung, reason: str) -> None:
        self.skipped[rung.name] = reason
        rank_zero_warn(f"speedkit: rung {rung.name!r} not applied: {reason}", category=UserWarning)

