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
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from speedkit.errors import ConfigError, OutputError, SpeedkitError, UnsupportedError, failure_in_user_code, first_line
from speedkit.frontend.recipe import Recipe, dump_recipe
from speedkit.results import LadderResult

#: Trainer arguments ``optimize`` sets for its short run, whatever the recipe says
_OPTIMIZE_TRAINER = {
    "max_epochs": -1,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "enable_checkpointing": False,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
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
        super().__init__(
            f"interrupted ({signal_name}) during {phase}; partial report: {where}"
            if where
            else f"interrupted ({signal_name}) during {phase}; nothing was measured yet"
        )


#: the files ``optimize`` writes into its output folder, and how each begins when speedkit wrote it
_OUTPUTS = {
    "report.json": '{\n  "schema_version"',
    "report.md": "# ",
    "report.html": "<!DOCTYPE html>\n<!-- Written by speedkit",
    "optimized.yaml": "# Written by `speedkit optimize`",
}


#: environment variables in which launchers give a process its global rank: torchrun, SLURM, LSF, Open MPI
_GLOBAL_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_RANK")


def rank_label(env: Mapping[str, str] | None = None) -> str | None:
    """None in the run's global rank 0 (or a process no launcher started); in any other process, which
    one it is ("rank 3", "local rank 1", "node 1, local rank 0"), as its launcher's environment says:
    Lightning's own launcher sets NODE_RANK and LOCAL_RANK in the processes it starts, which run the
    command line again from the top. Read before any Trainer exists (only rank 0 checks the output
    folder, prints and writes)."""
    env = os.environ if env is None else env
    ranks: dict[str, int] = {}
    for name in (*_GLOBAL_RANK_VARIABLES, "NODE_RANK", "LOCAL_RANK"):
        with contextlib.suppress(KeyError, ValueError):
            ranks[name] = int(env[name])
    if not any(ranks.values()):
        return None
    global_rank = next((ranks[name] for name in _GLOBAL_RANK_VARIABLES if ranks.get(name)), None)
    if global_rank is not None:
        return f"rank {global_rank}"
    node, local = ranks.get("NODE_RANK", 0), ranks.get("LOCAL_RANK", 0)
    return f"node {node}, local rank {local}" if node else f"local rank {local}"


def check_output_dir(out: Path, recipe_path: Path | None = None) -> None:
    """A usable output folder, or a one-line ConfigError, before any work starts: one that can be
    created and written to, and whose files ``optimize`` would replace are its own earlier output (not
    the recipe being read, not a file of the user's with the same name)."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file, not a folder; give a folder for the report")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("--out", f"{existing} is a file, so {out} cannot be created; give another folder")
    try:  # permissions alone do not tell (a read-only mount, /proc): make something there and remove it
        os.rmdir(tempfile.mkdtemp(prefix=".speedkit-", dir=existing))
    except OSError as exc:
        raise ConfigError(
            "--out", f"cannot write in {existing} ({exc.strerror or exc}); give a folder you can write to"
        ) from None
    for name, start in _OUTPUTS.items():
        path = out / name
        if not path.exists():
            continue
        if recipe_path is not None and recipe_path.exists() and path.samefile(recipe_path):
            raise ConfigError(
                "--out", f"{path} is the recipe being optimized, and optimize writes {name} there; give another --out folder"
            )
        if not _written_by_speedkit(path, start):
            raise ConfigError(
                "--out",
                f"{path} exists and speedkit did not write it; optimize would replace it: move it or give another --out folder",
            )


def _written_by_speedkit(path: Path, start: str) -> bool:
    """Whether ``path`` looks like speedkit's own earlier output (how it begins; a report.md by its summary
    line), or is empty (what a write cut off by a full disk left before writes were atomic: nothing to lose)."""
    try:
        if path.stat().st_size == 0:
            return True
        with path.open(encoding="utf-8") as f:
            head = f.read(4096)
    except (OSError, UnicodeDecodeError):
        return False
    if path.name == "report.md":
        return head.startswith(start) and "\n**Summary:**" in head
    return head.startswith(start)


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
            # Lightning's notes on its own internals (its pytree helper on a newer torch): nothing the user can act on
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=r"lightning(_fabric)?\.")
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


def check_trainer(recipe: Recipe, here: bool = True) -> str | None:
    """Build the recipe's own Trainer (nothing runs, nothing is written) to have Lightning check the
    values it alone knows (``devices: 0``, ``max_steps: -5``, an accelerator this machine lacks): a
    one-line ConfigError naming what it refused, before any work. With ``here=False`` (validating a
    recipe meant for another machine) what only this machine lacks is returned as a note instead."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    refused = (MisconfigurationException, ValueError, TypeError)
    with _quiet_lightning(), warnings.catch_warnings():
        # the Trainer built here only to be checked says nothing the user needs (a logger it would make,
        # a device it would not use); the Trainer that trains says it again where it matters
        warnings.simplefilter("ignore")
        try:
            build_trainer(recipe, [])
            return None
        except ConfigError:  # a speedkit callback's own argument: it names the field itself
            raise
        except refused as exc:
            reason = f"Lightning refuses these Trainer arguments: {first_line(exc)}"
        if here or recipe.trainer.get("accelerator", "auto") in ("cpu", "auto"):
            raise ConfigError("trainer", reason)
        devices = recipe.trainer.get("devices", "auto")
        try:  # the same on CPUs: does it fail for want of this machine's accelerator, or for a wrong value?
            build_trainer(
                recipe,
                [],
                accelerator="cpu",
                strategy="auto",
                devices=len(devices) if isinstance(devices, (list, tuple)) else devices,
            )
        except refused as exc:  # wrong on any machine: that is what to fix
            raise ConfigError("trainer", f"Lightning refuses these Trainer arguments: {first_line(exc)}") from None
    return f"this machine cannot run it as it is: {reason}"


def check_model_takes_data(recipe: Recipe, model: Any = None, datamodule: Any = None) -> None:
    """With synthetic data (speedkit's own, cheap to draw), one training step's forward on one
    sample of the first batch, on the CPU, without gradients: a model that cannot take that data
    (floats for a language model, sequences longer than its ``block_size``) is a one-line ConfigError
    before any work, rather than a failure once the Trainer runs. A step that fails for another reason
    (it reads its Trainer, its own check) is left to the run, which shows the user's frames. A throwaway
    model and data module are built for it (or the ones given, which it may change: ``validate``'s,
    built only to be checked), under a forked RNG: the run's own are built as they would be without it."""
    import torch

    from speedkit import compat
    from speedkit.data.batch import batch_leaves, map_batch
    from speedkit.data.rng import RngState
    from speedkit.frontend.recipe import SYNTHETIC_DATA

    if recipe.data is None or recipe.data.class_path not in SYNTHETIC_DATA.values():
        return
    kind = next(k for k, v in SYNTHETIC_DATA.items() if v == recipe.data.class_path)
    saved = RngState.capture()
    try:
        with _quiet_lightning(), torch.random.fork_rng(devices=[]):
            model = model if model is not None else recipe.build_model()
            datamodule = datamodule if datamodule is not None else recipe.build_datamodule()
            assert datamodule is not None
            try:
                batch = next(iter(datamodule.train_dataloader()))
            except Exception as exc:  # the data's own arguments (num_workers: -1): the data section's line
                failure = failure_in_user_code(exc, "speedkit")
                if failure is not None:
                    raise failure from None
                raise
            rows = next((t.shape[0] for t in batch_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
            one = map_batch(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows else t, batch)
            logs: list[Any] = []
            try:
                with torch.no_grad(), compat.recording_logs(model, logs):
                    model.training_step(one, 0)
            except Exception as exc:
                failure = failure_in_user_code(exc, "speedkit")
                if isinstance(failure, ConfigError):  # speedkit's demo model on the recipe's arguments
                    raise failure from None
                if not _raised_in_torch(exc):  # the step needs more than a batch (its Trainer, its
                    return  # optimizers) or checks something of its own: the run will show it
                raise ConfigError(
                    "data.synthetic",
                    f"{model.__class__.__name__}.training_step cannot take {kind} batches "
                    f"({first_line(exc, type(exc).__name__)}); give the data your model takes: "
                    f"{', '.join(k for k in SYNTHETIC_DATA if k != kind)} or a data module of your own",
                ) from None
    finally:
        saved.restore()


def _raised_in_torch(exc: BaseException) -> bool:
    """The innermost frame of ``exc`` is torch's own: an operation refused the data it was given
    (an embedding given floats, a matmul given the wrong width)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}torch{os.sep}" in tb.tb_frame.f_code.co_filename


def optimize(
    recipe: Recipe,
    out_dir: Path,
    on_event: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
    cache: bool = True,
) -> tuple[LadderResult, dict[str, Path]]:
    """Climb the recipe's ladder inside its Trainer; write report.json, report.md and optimized.yaml
    (``cache``: re-check and keep decisions in the decision cache, as ``SpeedLadder(cache=...)``).

    Under DDP (``trainer: {devices: 2, strategy: ddp}``) Lightning's launcher runs the command again in
    each other process, and this function with it: every rank runs the trials, rank 0 alone checks
    ``out_dir``, hears ``on_event``/``on_progress`` and writes (elsewhere ``written`` is empty).

    Raises:
        ConfigError: an empty ladder, an unusable output folder or Trainer arguments Lightning refuses,
            before any work; a data module that cannot build its loader.
        UserCodeError: the user's own code raised (speedkit's changes undone).
        Interrupted: Ctrl-C or SIGTERM; the rungs finished so far are in the partial report.
        OutputError: a file could not be written (a full disk); its ``result`` holds the ladder's
            result, ``written`` the files that were written whole; none is left half-written.
    """
    from lightning.fabric.utilities.seed import seed_everything
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from speedkit import rungs
    from speedkit.lightning import SpeedLadder
    from speedkit.measure.holds import left_out_at_most
    from speedkit.report import write_report

    if not recipe.ladder:
        raise ConfigError(
            "ladder", f"is empty: nothing to optimize; list rungs to try, e.g. ladder: [{', '.join(rungs.names())}]"
        )
    if rank_label() is None:
        check_output_dir(out_dir, recipe.path)
    else:  # the other ranks write nothing: they start once rank 0 has checked the folder (and may have written there)
        on_event = on_progress = None
    check_trainer(recipe)
    check_model_takes_data(recipe)
    title = recipe.report.get("title") or (f"speedkit ladder: {recipe.path.name}" if recipe.path else "speedkit ladder")
    formats = tuple(recipe.report.get("formats", ("json", "md", "html")))
    measure = recipe.measure
    # an explicit request for trials: they run whatever the planned run's length (it is the run to be made fast)
    ladder = SpeedLadder(
        rungs=recipe.ladder, trials="always", measure=measure, stop_after_holds=True, on_event=on_event, cache=cache
    )
    planned = recipe.trainer.get("max_steps")  # the run the recipe describes, not this short fit
    ladder.planned_steps = planned if isinstance(planned, int) and planned > 0 else None
    ladder.trace_dir = out_dir / "traces"  # the profile's traces of the baseline and the final configuration, beside the report
    ladder.on_progress = on_progress
    # room for the holds check: the kept rungs' own warm-up in the fit (a CUDA graph warms up and
    # captures again), and windows timed in place of those in which torch.compile compiled
    windows = max(1, measure.holds_windows)
    fit_steps = max(measure.warmup, _FIT_SETTLE_ROOM) + (windows + left_out_at_most(windows)) * measure.steps
    with _quiet_lightning(), warnings.catch_warnings():
        # trials that cannot run are optimize's error, said once (SpeedLadder in a user's fit warns instead)
        warnings.filterwarnings("ignore", message=r"speedkit: .*SpeedLadder\(\) applies no rungs", category=UserWarning)
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
            if result is not None:  # every rank's figures are in rank 0's result: it alone writes them
                phase = (result.interrupted or "the fit check after the trials").split(" during ", 1)[-1]
                result.interrupted = result.interrupted or f"{type(cause).__name__} during {phase}"
                result.title = title
                try:
                    written = write_report(result, out_dir, formats=formats) if trainer.is_global_zero else {}
                except OutputError as failed:
                    failed.result = result
                    raise failed from None
            raise Interrupted("SIGTERM" if isinstance(cause, SIGTERMException) else "SIGINT", phase, written) from None
        except Exception as exc:
            _raise_as_user_failure(exc, "speedkit optimize")
            raise
    result = ladder.result
    if result is None:
        raise UnsupportedError(f"speedkit optimize could not run its trials: {ladder.not_run or 'the fit ended before them'}")
    result.title = title
    written: dict[str, Path] = {}
    if not trainer.is_global_zero:  # rank 0 writes the report and optimized.yaml, once
        return result, written
    try:
        written = write_report(result, out_dir, formats=formats)
        kept = [{"name": r.name, "options": r.options} if r.options else r.name for r in result.kept]
        optimized = out_dir / "optimized.yaml"
        final = result.final_measurement
        base = result.baseline.measurement
        header = (
            f"Written by `speedkit optimize` on {time.strftime('%Y-%m-%d %H:%M')} from {recipe.path or 'a recipe'}.\n"
            f"Kept rungs: {', '.join(r.name for r in result.kept) or 'none'}"
            + (f"; {final.throughput:,.0f} {final.throughput_unit} vs baseline {base.throughput:,.0f}" if final and base else "")
            + f" on {result.device}.\nTrain with: speedkit fit {optimized}"
        )
        dump_recipe(recipe.raw, kept, optimized, header)
        written["optimized"] = optimized
    except OutputError as exc:  # the results are not lost: the caller shows them
        exc.result = result
        exc.written = {**written, **exc.written}
        raise
    return result, written


#: untimed steps the fit after the trials leaves room for before the holds check's first window
_FIT_SETTLE_ROOM = 8


def fit(recipe: Recipe, extra_callbacks: list[Any] | None = None) -> tuple[Any, Any]:
    """Train a recipe with Lightning, its ``ladder`` applied by the SpeedLadder callback (no trials),
    watched by a SpeedProfiler (its figures logged under ``speedkit/`` through the recipe's loggers;
    its ``summary`` at the end), unless the recipe's callbacks have one.

    Returns the Trainer and the SpeedLadder callback (which records what it applied and skipped).
    Raises ConfigError (Trainer arguments Lightning refuses, before any work; a data module that cannot
    build its loader) or UserCodeError (the user's own code raised; the rungs undone).
    """
    from lightning.fabric.utilities.seed import seed_everything

    from speedkit.lightning import SpeedLadder, SpeedProfiler

    if not recipe.ladder_given:
        raise ConfigError(
            "ladder",
            "missing: `speedkit fit` applies the rungs a recipe lists, without trials; run `speedkit "
            "optimize` on it and fit the optimized.yaml it writes, or list the rungs (ladder: [] for none)",
        )
    check_trainer(recipe)
    check_model_takes_data(recipe)
    seed_everything(recipe.seed, verbose=False)
    model = recipe.build_model()
    datamodule = recipe.build_datamodule()
    ladder = SpeedLadder(rungs=recipe.ladder)
    trainer = build_trainer(recipe, [ladder, *(extra_callbacks or [])])
    if not any(isinstance(c, SpeedProfiler) for c in trainer.callbacks):
        trainer.callbacks.append(SpeedProfiler())
    try:
        trainer.fit(model, datamodule=datamodule)
    except Exception as exc:
        _raise_as_user_failure(exc, "speedkit fit")
        raise
    return trainer, ladder


def _raise_as_user_failure(exc: Exception, during: str) -> None:
    """A failure of the user's code (or of their data module building its data) as one-line error;
    returns when ``exc`` is speedkit's own or a library's (its traceback is what tells then)."""
    if isinstance(exc, SpeedkitError):
        return
    failure = failure_in_user_code(exc, during)
    if failure is not None:
        raise failure from exc
