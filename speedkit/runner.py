"""What the CLI commands do, as functions: optimize a recipe, fit it.

``optimize`` is the engine of ``SpeedLadder()`` on the Trainer the recipe describes: the recipe's
precision, accumulation, clipping, strategy, callbacks and data module, with the trials inside
``fit`` and the fit's own next steps timed after them. What it changes for the occasion: it runs
only as many real steps as that check needs, and turns off what concerns the real run rather than
the step (validation, checkpoints, loggers, the progress bar, early stopping).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from speedkit.errors import ConfigError, SpeedkitError, UnsupportedError
from speedkit.recipe import Recipe, dump_recipe
from speedkit.results import LadderResult

#: Trainer arguments ``optimize`` sets for its short run, whatever the recipe says
_OPTIMIZE_TRAINER = {"max_epochs": -1, "limit_val_batches": 0, "num_sanity_val_steps": 0, "enable_checkpointing": False,
                     "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
#: callbacks of the real run that have no place in optimize's short one (they watch validation or write files)
_REAL_RUN_CALLBACKS = ("ModelCheckpoint", "EarlyStopping")


class Interrupted(SpeedkitError):
    """``optimize`` was interrupted (Ctrl-C or SIGTERM); a partial report was written.

    Attributes: ``signal`` ("SIGINT"/"SIGTERM"), ``exit_code`` (130/143), ``written`` (paths).
    """

    def __init__(self, signal_name: str, phase: str, written: dict[str, Path]) -> None:
        self.signal = signal_name
        self.exit_code = 130 if signal_name == "SIGINT" else 143
        self.written = written
        where = written.get("json") or written.get("md")
        super().__init__(f"interrupted ({signal_name}) during {phase}; partial report: {where}" if where
                         else f"interrupted ({signal_name}) during {phase}; nothing was measured yet")


def check_output_dir(out: Path) -> None:
    """A usable output folder, or a one-line ConfigError, before any work starts."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file, not a folder; give a folder for the report")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("--out", f"{existing} is a file, so {out} cannot be created; give another folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"{existing} is not writable; give a folder you can write to")


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's start-up lines (GPU available, ...) say nothing about speed; the report does."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(does not have many workers|GPU available but not used).*")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGINT, sigint)  # Lightning ignores SIGINT after a Ctrl-C; put it back


def build_trainer(recipe: Recipe, callbacks: list[Any], **overrides: Any) -> Any:
    """The recipe's Trainer with ``callbacks`` first, the recipe's own after."""
    import lightning.pytorch as pl

    kwargs = recipe.build_trainer_kwargs()
    own = list(kwargs.pop("callbacks", None) or [])
    kwargs.update(overrides)
    return pl.Trainer(**kwargs, callbacks=[*callbacks, *own])


def optimize(recipe: Recipe, out_dir: Path, on_event: Callable[[str], None] | None = None) -> tuple[LadderResult, dict[str, Path]]:
    """Climb the recipe's ladder inside its Trainer; write report.json, report.md and optimized.yaml.

    Raises:
        ConfigError: an empty ladder or an unusable output folder, before any work.
        Interrupted: Ctrl-C or SIGTERM; the rungs finished so far are in the partial report.
    """
    from lightning.fabric.utilities.seed import seed_everything
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from speedkit import rungs
    from speedkit.lightning import SpeedLadder
    from speedkit.report import write_report

    if not recipe.ladder:
        raise ConfigError("ladder", f"is empty: nothing to optimize; list rungs to try, e.g. ladder: [{', '.join(rungs.names())}]")
    check_output_dir(out_dir)
    title = recipe.report.get("title") or (f"speedkit ladder: {recipe.path.name}" if recipe.path else "speedkit ladder")
    formats = tuple(recipe.report.get("formats", ("json", "md")))
    measure = recipe.measure
    ladder = SpeedLadder(rungs=recipe.ladder, trials=True, measure=measure, stop_after_holds=True, on_event=on_event)
    fit_steps = measure["warmup"] + max(1, measure["holds_windows"]) * measure["steps"]
    with _quiet_lightning():
        seed_everything(recipe.seed, verbose=False)
        model = recipe.build_model()
        datamodule = recipe.build_datamodule()
        trainer = build_trainer(recipe, [ladder], **_OPTIMIZE_TRAINER, max_steps=fit_steps)
        trainer.callbacks = [c for c in trainer.callbacks if type(c).__name__ not in _REAL_RUN_CALLBACKS or c is ladder]
        try:
            trainer.fit(model, datamodule=datamodule)
        except (KeyboardInterrupt, SystemExit) as exc:
            cause = ladder.exception or exc
            if not isinstance(cause, (KeyboardInterrupt, SIGTERMException)) and not isinstance(exc, KeyboardInterrupt):
                raise
            result = ladder.result
            written: dict[str, Path] = {}
            phase = "the set-up, before any trial"
            if result is not None:
                phase = (result.interrupted or "the fit check after the trials").split(" during ", 1)[-1]
                result.interrupted = result.interrupted or f"{type(cause).__name__} during {phase}"
                result.title = title
                out_dir.mkdir(parents=True, exist_ok=True)
                written = write_report(result, out_dir, formats=formats)
            raise Interrupted("SIGTERM" if isinstance(cause, SIGTERMException) else "SIGINT", phase, written) from None
    result = ladder.result
    if result is None:
        raise UnsupportedError(f"speedkit optimize could not run its trials: {ladder.not_run or 'the fit ended before them'}")
    result.title = title
    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_report(result, out_dir, formats=formats)
    kept = [{"name": r.name, "options": r.options} if r.options else r.name for r in result.kept]
    optimized = out_dir / "optimized.yaml"
    final = result.final_measurement
    base = result.baseline.measurement
    header = (f"Written by `speedkit optimize` on {time.strftime('%Y-%m-%d %H:%M')} from {recipe.path or 'a recipe'}.\n"
              f"Kept rungs: {', '.join(r.name for r in result.kept) or 'none'}"
              + (f"; {final.throughput:,.0f} {final.throughput_unit} vs baseline {base.throughput:,.0f}" if final and base else "")
              + f" on {result.device}.\nTrain with: speedkit fit {optimized}")
    dump_recipe(recipe.raw, kept, optimized, header)
    written["optimized"] = optimized
    return result, written


def fit(recipe: Recipe, extra_callbacks: list[Any] | None = None) -> tuple[Any, Any]:
    """Train a recipe with Lightning, its ``ladder`` applied by the SpeedLadder callback (no trials).

    Returns the Trainer and the SpeedLadder callback (which records what it applied and skipped).
    """
    from lightning.fabric.utilities.seed import seed_everything

    from speedkit.lightning import SpeedLadder

    seed_everything(recipe.seed, verbose=False)
    model = recipe.build_model()
    datamodule = recipe.build_datamodule()
    ladder = SpeedLadder(rungs=recipe.ladder)
    trainer = build_trainer(recipe, [ladder, *(extra_callbacks or [])])
    trainer.fit(model, datamodule=datamodule)
    return trainer, ladder
