"""What the CLI commands do, as functions: build a run from a recipe, optimize it, fit it."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from speedkit.errors import ConfigError, UnsupportedError
from speedkit.ladder import Ladder
from speedkit.recipe import Recipe, dump_recipe
from speedkit.results import LadderResult
from speedkit.state import TrainState


def resolve_device(trainer_args: dict[str, Any]) -> torch.device:
    """The device a recipe's Trainer arguments ask for (``accelerator`` auto/cpu/gpu/cuda)."""
    accelerator = str(trainer_args.get("accelerator", "auto")).lower()
    if accelerator == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise UnsupportedError(f"trainer.accelerator is {accelerator!r} but no CUDA GPU is visible; "
                                   "use accelerator: auto or cpu, or run on a machine with a GPU")
        return torch.device("cuda")
    if accelerator == "cpu":
        return torch.device("cpu")
    raise UnsupportedError(f"trainer.accelerator {accelerator!r} is not supported by speedkit optimize; use auto, cpu or gpu")


def extract_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The single optimizer out of whatever ``configure_optimizers`` returned."""
    found = configured
    if isinstance(found, dict):
        found = found.get("optimizer")
    if isinstance(found, (list, tuple)):
        if len(found) == 2 and isinstance(found[0], (list, tuple)):  # ([optimizers], [schedulers])
            found = found[0]
        optimizers = [o.get("optimizer") if isinstance(o, dict) else o for o in found]
        optimizers = [o for o in optimizers if isinstance(o, torch.optim.Optimizer)]
        if len(optimizers) != 1:
            raise UnsupportedError(f"speedkit optimize needs exactly one optimizer from configure_optimizers, found {len(optimizers)}")
        found = optimizers[0]
    if not isinstance(found, torch.optim.Optimizer):
        raise ConfigError("model", f"configure_optimizers must return an optimizer, found {type(configured).__name__}")
    return found


def build_state(recipe: Recipe) -> TrainState:
    """Model (seeded), optimizer and train loader of a recipe, on the recipe's device."""
    device = resolve_device(recipe.trainer)
    torch.manual_seed(recipe.seed)
    model = recipe.build_model()
    if getattr(model, "automatic_optimization", True) is False:
        raise UnsupportedError("speedkit optimize runs automatic-optimization training steps; "
                               "this LightningModule sets automatic_optimization = False")
    datamodule = recipe.build_datamodule()
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    else:
        loader = model.train_dataloader()
    model.to(device)
    optimizer = extract_optimizer(model.configure_optimizers())
    return TrainState(model=model, optimizer=optimizer, device=device, loader=loader)


@contextlib.contextmanager
def _quiet_lightning_outside_trainer():
    # training_step calls self.log(); outside a Trainer Lightning warns on each call site. The
    # ladder runs training steps without a Trainer on purpose, so that warning is noise here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)`? but the `self\.trainer` reference is not registered.*")
        warnings.filterwarnings("ignore", message=r".*self\.trainer.*not registered.*")
        yield


def optimize(recipe: Recipe, out_dir: Path, on_event: Callable[[str], None] | None = None) -> tuple[LadderResult, dict[str, Path]]:
    """Run the ladder of a recipe; write report.json, report.md and optimized.yaml into ``out_dir``."""
    from speedkit import rungs
    from speedkit.report import write_report

    if not recipe.ladder:
        raise ConfigError("ladder", f"is empty: nothing to optimize; list rungs to try, e.g. ladder: [{', '.join(rungs.names())}]")
    out_dir.mkdir(parents=True, exist_ok=True)
    state = build_state(recipe)
    ladder = Ladder(state, recipe.ladder, recipe.measure, seed=recipe.seed,
                    recipe=str(recipe.path) if recipe.path else None, on_event=on_event)
    with _quiet_lightning_outside_trainer():
        result = ladder.run()
    ladder.revert()
    title = recipe.report.get("title") or (f"speedkit ladder: {recipe.path.name}" if recipe.path else "speedkit ladder")
    result.title = title
    written = write_report(result, out_dir, formats=tuple(recipe.report.get("formats", ("json", "md"))))
    kept = [{"name": r.name, "options": r.options} if r.options else r.name for r in result.kept]
    optimized = out_dir / "optimized.yaml"
    final = result.final.measurement
    header = (f"Written by `speedkit optimize` on {time.strftime('%Y-%m-%d %H:%M')} from {recipe.path or 'a recipe'}.\n"
              f"Kept rungs: {', '.join(r.name for r in result.kept) or 'none'}"
              + (f"; {final.throughput:,.0f} {final.throughput_unit} vs baseline {result.baseline.measurement.throughput:,.0f}"
                 if final and result.baseline.measurement else "") + f" on {result.device}.\n"
              "Train with: speedkit fit " + str(optimized))
    dump_recipe(recipe.raw, kept, optimized, header)
    written["optimized"] = optimized
    return result, written


def fit(recipe: Recipe, extra_callbacks: list[Any] | None = None) -> tuple[Any, Any]:
    """Train a recipe with Lightning, its ``ladder`` applied by the SpeedLadder callback (no trials).

    Returns the Trainer and the SpeedLadder callback (which records what it applied and skipped).
    """
    import lightning.pytorch as pl

    from speedkit.lightning import SpeedLadder

    torch.manual_seed(recipe.seed)
    model = recipe.build_model()
    datamodule = recipe.build_datamodule()
    kwargs = recipe.build_trainer_kwargs()
    callbacks = list(kwargs.pop("callbacks", None) or [])
    ladder = SpeedLadder(rungs=recipe.ladder)
    trainer = pl.Trainer(**kwargs, callbacks=[ladder, *callbacks, *(extra_callbacks or [])])
    trainer.fit(model, datamodule=datamodule)
    return trainer, ladder
