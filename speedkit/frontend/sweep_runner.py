"""The batch-size sweep's runner part: each size a short timed fit of the recipe (:func:`timed_fit_trial`,
timed only after its last compile and the warm-up after it: :class:`SettledStepTimer`), the recipe's
trial function (:func:`recipe_trials`), the worst-case input it is fed, and ``speedkit sweep`` itself
(:func:`sweep_recipe`); :mod:`speedkit.engine.sweep` decides which sizes to try."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedkit import compat, config
from speedkit.errors import ConfigError, UnsupportedError, first_line
from speedkit.frontend.recipe import Recipe
from speedkit.frontend.runner import _OPTIMIZE_TRAINER, _quiet_lightning, check_model_takes_data, check_trainer
from speedkit.lightning import StepTimer
from speedkit.measure.clock import StepClock
from speedkit.measure.session import HostClock, MeasureSession

#: a size's fit may run this many times the steps it plans (its windows after a first compile), so
#: that compiles after the first (a recompile, a new shape) can each start the warm-up again
SETTLE_ROOM = 3


class SettledStepTimer(StepTimer):
    """A :class:`~speedkit.lightning.StepTimer` whose warm-up starts again after every optimizer step
    in which ``torch.compile`` compiled a graph (:func:`speedkit.compat.graph_count` moved): the
    windows timed before it are dropped, and ``warmup`` steps run untimed after it, so a size is timed
    only on steps after its last compile and a warm-up of its own, never on a compile's first call.
    It stops the fit once ``windows`` windows are timed (``trainer.should_stop``). ``clock`` and
    ``host_clock``: the measurement session's (tests inject a fake time line)."""

    def __init__(
        self,
        warmup: int,
        window: int,
        windows: int,
        *,
        clock: StepClock | None = None,
        host_clock: HostClock | None = None,
    ) -> None:
        super().__init__(warmup=warmup, window=window)
        self.wanted = windows
        self.clock, self.host_clock = clock, host_clock
        self.steps = 0  # optimizer steps seen
        self.compiled_steps = 0  # of them, those in which a graph compiled
        self.untimed_steps = warmup  # steps before the windows kept: through the last compile, and the warm-up after
        self._graphs = 0
        self._compiled = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        if self.clock is not None or self.host_clock is not None:
            self.session = MeasureSession(
                trainer.strategy.root_device, clock=self.clock, host_clock=self.host_clock or time.perf_counter
            )
            self.session.begin_steps(self.window, warmup=self.warmup)
        self._graphs = compat.graph_count()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        graphs = compat.graph_count()
        if graphs != self._graphs:  # a graph compiled in this (micro-)batch
            self._graphs, self._compiled = graphs, True
        if self._steps.in_step:  # the optimizer step goes on (accumulation): judge it when it ends
            return
        self.steps += 1
        if self._compiled:
            assert self.session is not None
            self._compiled = False
            self.compiled_steps += 1
            self.windows.clear()
            self.session.begin_steps(self.window, warmup=self.warmup)
            self.untimed_steps = self.steps + self.warmup
        elif len(self.windows) >= self.wanted:
            trainer.should_stop = True


def _batch_size_key(recipe: Recipe) -> tuple[str, int]:
    """The recipe's micro-batch: its dotted key and value (``data.batch_size`` of the synthetic data,
    ``data.init_args.batch_size`` of a data module)."""
    data = recipe.raw.get("data") or {}
    for key, node in (("data.batch_size", data), ("data.init_args.batch_size", data.get("init_args") or {})):
        value = node.get("batch_size") if isinstance(node, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return key, value
    raise ConfigError(
        "data",
        "no batch_size to sweep: give the data (or its init_args) a batch_size, e.g. data: {synthetic: tokens, batch_size: 8}",
    )


def _on_cuda(trainer_kwargs: dict[str, Any]) -> bool:
    """Whether a Trainer of these arguments trains on a CUDA GPU of this machine."""
    import torch

    return torch.cuda.is_available() and trainer_kwargs.get("accelerator") in (None, "auto", "gpu", "cuda")


class _RepeatBatch:
    """A train loader that yields one batch ``length`` times (a sweep's worst-case input)."""

    def __init__(self, batch: Any, length: int) -> None:
        self.batch, self.length = batch, length

    def __iter__(self) -> Any:
        return (self.batch for _ in range(self.length))

    def __len__(self) -> int:
        return self.length


def worst_case_data(data: dict[str, Any], scan: int = 512) -> tuple[dict[str, Any], str]:
    """``fit``'s data keyword arguments (``train_dataloaders`` or ``datamodule``) fed the worst-case
    input where the batches' shapes vary (per-batch padding): the batch of most tensor bytes among the
    first ``scan`` of its train loader, repeated as many times as the loader has batches, so a size
    is measured (its memory above all) on the longest batch a fit meets rather than on those its
    short trial happens to draw. Where every scanned batch has one shape, the data as it is. Returns
    the data and a line saying which."""
    from speedkit.data.batch import tensor_bytes
    from speedkit.data.static import signature

    dm = data.get("datamodule")
    if dm is not None:
        if hasattr(dm, "setup"):
            dm.setup("fit")
        loader = dm.train_dataloader()
    else:
        loader = data.get("train_dataloaders")
    if loader is None:
        return data, "the batches as the loader gives them (no single train loader to scan)"
    shapes: set[Any] = set()
    worst, most, seen = None, -1, 0
    for batch in loader:
        seen += 1
        shapes.add(signature(batch)[1])
        size = tensor_bytes(batch)
        if size > most:
            worst, most = batch, size
        if seen >= scan:
            break
    if len(shapes) <= 1 or worst is None:
        return data, f"the loader's batches (one shape in the first {seen})"
    try:
        length = len(loader)
    except TypeError:
        length = seen
    repeated = _RepeatBatch(worst, length)
    note = f"the worst-case input: the largest of the first {seen} batches ({most:,} bytes; {len(shapes)} shapes seen), repeated"
    if dm is not None:
        dm.train_dataloader = lambda: repeated  # the datamodule's own hooks stay
        return data, note
    return {**data, "train_dataloaders": repeated}, note


def timed_fit_trial(
    size: int,
    accumulate: int,
    build: Callable[[], tuple[Any, dict[str, Any]]],
    trainer_kwargs: dict[str, Any],
    *,
    warmup: int,
    window: int,
    windows: int | None = None,
    callbacks: Callable[[], list[Any]] = list,
    quiet_notes: bool = False,
    worst_case: bool = True,
    clock: StepClock | None = None,
    host_clock: HostClock | None = None,
) -> Any:
    """One size of a batch-size sweep: a short fit (``warmup`` untimed steps, then ``windows`` timed
    windows of ``window`` optimizer steps on speedkit's step clock) of what ``build()`` returns, the
    module and ``fit``'s data keyword arguments; a :class:`~speedkit.engine.sweep.SweepTrial`. A step
    in which ``torch.compile`` compiled a graph (the size's first call, a recompile) starts the
    warm-up again (:class:`SettledStepTimer`): the size is timed after its last compile and ``warmup``
    steps more, within ``SETTLE_ROOM`` times the planned steps (a size still compiling then is not
    timed: it cannot be chosen). ``clock``, ``host_clock``: the session's (tests). Out of device
    memory is a size that does not fit (its memory freed before the next). Where the loader's
    batches vary in shape, the size is measured on the worst-case input (``worst_case``:
    :func:`worst_case_data`). A compiled model is
    compiled for each size as its own static graph (:func:`speedkit.compat.static_batch_shapes`):
    every size is timed on the kernels a fit at that size runs, and a size measured again (the
    exhaustive pass of ``bench/batch_sweep.py``) finds its graph in the cache."""
    import gc

    import lightning.pytorch as pl
    import torch

    from speedkit.engine.sweep import SweepTrial

    cuda = _on_cuda(trainer_kwargs)
    windows = int(config.defaults("sweep")["windows"]) if windows is None else windows
    timer = SettledStepTimer(warmup, window, windows, clock=clock, host_clock=host_clock)
    kwargs = {
        **trainer_kwargs,
        **_OPTIMIZE_TRAINER,
        "max_steps": SETTLE_ROOM * (1 + warmup + window * windows),  # the timer stops it at its windows
        "accumulate_grad_batches": accumulate,
    }
    kwargs["callbacks"] = [*callbacks(), *(kwargs.get("callbacks") or []), timer]
    t0 = time.perf_counter()
    failed: str | None = None
    out_of_memory = False
    trainer = None
    input_note = "the loader's batches"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer = pl.Trainer(**kwargs)
        module, data = build()
        if worst_case:
            data, input_note = worst_case_data(data)
        with _quiet_lightning(), warnings.catch_warnings(), compat.static_batch_shapes():
            if quiet_notes:  # notes (a rung that does not apply) already shown with an earlier size
                warnings.simplefilter("ignore", UserWarning)
            trainer.fit(module, **data)
    except torch.OutOfMemoryError as exc:
        failed, out_of_memory = f"out of memory: {first_line(exc)[:120]}", True
    optimizer = type(trainer.optimizers[0]).__name__ if trainer is not None and trainer.optimizers else ""
    trainer = module = data = None  # noqa: F841 (what the fit held, freed before the next size)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    m = timer.measurement
    if failed is None and m is None:
        failed = (
            f"not timed: a graph compiled in {timer.compiled_steps} of its {timer.steps} steps, the last at step "
            f"{timer.untimed_steps - warmup}, with no window after it and its warm-up"
            if timer.compiled_steps
            else "no timed window"
        )
    if failed is not None or m is None:
        return SweepTrial(
            size,
            accumulate,
            None,
            "",
            None,
            False,
            failed or "no timed window",
            time.perf_counter() - t0,
            optimizer,
            input_note,
            untimed_steps=timer.untimed_steps,
            compiled_steps=timer.compiled_steps,
            short_of_memory=out_of_memory,
        )
    return SweepTrial(
        size,
        accumulate,
        m.throughput,
        m.throughput_unit,
        m.peak_memory_bytes,
        True,
        "",
        time.perf_counter() - t0,
        optimizer,
        input_note,
        window_rates=tuple(m.items_per_step / (ms / 1e3) for ms in m.window_ms if ms > 0),
        untimed_steps=timer.untimed_steps,
        compiled_steps=timer.compiled_steps,
    )


#: the activation_checkpointing rung as the sweep gives it: at any accumulation (the sweep chooses the batch)
CHECKPOINTING = {"name": "activation_checkpointing", "options": {"without_accumulation": True}}


def with_checkpointing(ladder: list[Any]) -> list[Any]:
    """``ladder`` (rung names or ``{name, options}`` entries) with the blocks checkpointed: the
    activation_checkpointing rung beneath compile (which then compiles the checkpointed blocks), at
    the end where there is no compile; in place of the recipe's own entry where it has one."""

    def name(entry: Any) -> str:
        return entry if isinstance(entry, str) else str(entry.get("name"))

    rest = [entry for entry in ladder if name(entry) != "activation_checkpointing"]
    at = next((i for i, entry in enumerate(rest) if name(entry) == "compile"), len(rest))
    return [*rest[:at], CHECKPOINTING, *rest[at:]]


def recipe_trials(recipe: Recipe) -> tuple[str, int, Callable[..., Any]]:
    """A recipe's batch size (its dotted key and value) and ``trial(size, accumulate, *, windows=None (``sweep.windows``),
    warmup=None, window=None)``: :func:`timed_fit_trial` of the recipe at that micro-batch, seeded as
    the recipe says, its ladder applied without trials as ``speedkit fit`` does; warm-up and window
    from the recipe's ``measure`` unless given. The ladder's notes (a rung that does not apply) are
    shown with the first size only."""
    from lightning.fabric.utilities.seed import seed_everything

    from speedkit.frontend.recipe import load_recipe
    from speedkit.lightning import SpeedLadder

    key, start = _batch_size_key(recipe)
    measured: list[int] = []

    def trial(
        size: int,
        accumulate: int,
        *,
        windows: int | None = None,
        warmup: int | None = None,
        window: int | None = None,
        checkpointed: bool = False,
    ) -> Any:
        sized = load_recipe(recipe.raw, overrides=[(key, size)])
        ladder = list(sized.ladder) if recipe.ladder_given else []
        if checkpointed:
            ladder = with_checkpointing(ladder)

        def build() -> tuple[Any, dict[str, Any]]:
            seed_everything(recipe.seed, verbose=False)
            return sized.build_model(), {"datamodule": sized.build_datamodule()}

        result = timed_fit_trial(
            size,
            accumulate,
            build,
            sized.build_trainer_kwargs(),
            warmup=recipe.measure.warmup if warmup is None else warmup,
            window=recipe.measure.steps if window is None else window,
            windows=windows,
            quiet_notes=bool(measured),
            callbacks=lambda: [SpeedLadder(rungs=ladder)] if ladder else [],
        )
        measured.append(size)
        return result

    return key, start, trial


def sweep_recipe(
    recipe: Recipe,
    out_dir: Path | None = None,
    *,
    keep_effective: bool = True,
    checkpointing: str = "auto",
    margin: float | None = None,
    max_trials: int | None = None,
    on_event: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> Any:
    """``speedkit sweep``: the micro-batch of highest throughput for a recipe (:mod:`speedkit.engine.sweep`).

    Each size is a short fit of the recipe (its ladder applied without trials, as ``speedkit fit``
    does), seeded as the recipe says, timed by speedkit's step clock after warm-up steps
    (:func:`timed_fit_trial`); an out-of-memory error is a size that does not fit. With
    ``keep_effective`` the recipe's effective batch (micro-batch x ``accumulate_grad_batches``) is
    kept through the accumulation. ``checkpointing``: "auto" measures a size that does not fit again with
    the model's repeated blocks checkpointed (and the larger ones so:
    :func:`~speedkit.engine.sweep.checkpointing_where_needed`), "off" never. Writes ``sweep.json`` (table rows and a plot-ready series) and
    ``sweep.md`` to ``out_dir`` when given; returns the :class:`~speedkit.engine.sweep.SweepResult`.
    """
    import torch

    from speedkit.engine import sweep as sweeping
    from speedkit.files import write_text_atomic

    key, start, trial = recipe_trials(recipe)
    devices = recipe.trainer.get("devices")
    if devices not in (None, 1, "1", "auto") or recipe.trainer.get("num_nodes", 1) != 1:
        raise UnsupportedError(
            f"speedkit sweep runs on one device (the recipe asks for devices: {devices!r}); sweep with "
            "--trainer.devices 1 and give each rank the chosen micro-batch"
        )
    accumulate = int(recipe.trainer.get("accumulate_grad_batches") or 1)
    effective = start * accumulate if keep_effective else None
    events = on_event or (lambda line: None)
    check_trainer(recipe)
    check_model_takes_data(recipe)
    memory = torch.cuda.get_device_properties(0).total_memory if _on_cuda(recipe.trainer) else None

    if checkpointing not in ("auto", "off"):
        raise ConfigError("checkpointing", f"expected 'auto' or 'off', found {checkpointing!r}")

    def measure(size: int, checkpointed: bool = False) -> sweeping.SweepTrial:
        return trial(size, effective // size if effective else 1, checkpointed=checkpointing == "auto" and checkpointed)

    kwargs: dict[str, Any] = {}
    if margin is not None:
        kwargs["margin"] = margin
    sized_measure = (
        sweeping.checkpointing_where_needed(
            measure, memory_bytes=memory, margin=sweeping.MARGIN if margin is None else margin, on_event=events
        )
        if checkpointing == "auto"
        else measure
    )
    if max_trials is not None:
        kwargs["max_trials"] = max_trials
    if on_progress is not None:
        kwargs["on_progress"] = on_progress
    result = sweeping.sweep(sized_measure, start, effective=effective, memory_bytes=memory, on_event=events, **kwargs)
    if out_dir is not None:
        import json

        out_dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "schema_version": 1,
            "recipe": str(recipe.path) if recipe.path else None,
            "batch_size_key": key,
            **result.to_dict(accumulate),
        }
        write_text_atomic(out_dir / "sweep.json", json.dumps(doc, indent=2) + "\n")
        c = result.comparison
        if c is not None and c.size == result.chosen:
            gain = f"{c.speedup:.2f}x your throughput, {c.confidence:.0%} CI [{c.low:.2f}, {c.high:.2f}]"
        elif c is not None:
            gain = (
                f"yours stays: the fastest other, {c.size}, measured {c.speedup:.2f}x yours, {c.confidence:.0%} CI "
                f"[{c.low:.2f}, {c.high:.2f}]: "
                + ("not faster by the minimum" if c.verdict == "not_faster" else "not shown faster (undecided)")
            )
        elif result.chosen == start:
            gain = "yours, the fastest measured"
        else:
            gain = "yours did not fit"
        chosen = result.trial(result.chosen)
        if chosen is not None and chosen.checkpointed:
            gain += (
                "; it fits with the model's blocks checkpointed: add {name: activation_checkpointing, options: "
                "{without_accumulation: true}} to the recipe's ladder with it"
            )
        md = [
            f"# Batch-size sweep{' of ' + recipe.path.name if recipe.path else ''}",
            "",
            f"Chosen micro-batch: **{result.chosen}** (yours: {start}; {gain}). Rule: {result.rule}.",
            "",
            "Each size is timed after its last compile and its warm-up steps (a step that compiles starts the warm-up again).",
            "",
            *result.table(),
            "",
        ]
        fed = next((t.input for t in result.trials if t.input), "")
        if fed:
            md += [f"Each size was fed {fed}.", ""]
        scaling = result.lr_scaling(accumulate)
        if scaling is not None:
            md += [f"Learning rate: {scaling['line']}.", ""]
        write_text_atomic(out_dir / "sweep.md", "\n".join(md))
    return result
