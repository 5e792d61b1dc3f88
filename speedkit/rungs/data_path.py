"""data_path: feed the step faster — loader workers and pinning chosen by measurement, and the next
batch copied to the GPU on a side stream while the current step runs.

Speeds up: steps that wait for their batch (decoding and augmenting on too few workers, pageable
host-to-device copies on the compute stream). Does not help: a loader already faster than the step,
batches made on the device.
Needs: a torch ``DataLoader`` to rebuild (any other iterable is only prefetched); a CUDA device for
pinning and prefetching (on a CPU only the worker count can change).

The user's loader is copied (:func:`~speedkit.data.loader.rebuild_loader`: the same dataset,
sampler, collate_fn, generator, ... objects) with settings chosen by measuring the loader alone
(:func:`~speedkit.data.loader.choose_settings`). With ``exact`` (the default) only settings that
leave every sample and every RNG stream as they were are changed: the worker count only when the
dataset's samples (and its collate_fn) do not draw random numbers, the prefetch factor only when they do not or the
workers are not persistent, persistent workers never (see :mod:`speedkit.data.loader`). On CUDA, batches are copied by a
:class:`~speedkit.data.prefetch.DevicePrefetcher`; Lightning's batch hooks still run, in their
order, on the batch already on the device (``on_before_batch_transfer``, then
``transfer_batch_to_device``, which finds it there, then ``on_after_batch_transfer``). A module or
datamodule that overrides ``on_before_batch_transfer`` or ``transfer_batch_to_device`` expects the
host batch: the copy is then left to Lightning (not prefetched), the loader settings still apply.

Where the loader's work runs in workers, three things keep it from slowing the thread that issues
the step (on a GPU, the step waits for that thread): the workers run off two cores left to the
training process (``worker_cpus``); on CUDA each worker writes its batch into a ring of shared memory
pinned once, from which the copy to the device reads (``ring``, :mod:`speedkit.data.ring`), so the
training process runs no pinning thread and takes no handoff per tensor; a batch that travels the
usual way comes through named shared memory (``sharing``), without a socket round trip per tensor.
Each of those handoffs turned the GIL over to another thread of the training process, which the
step's thread then waited for.

In a Lightning fit the kept rung binds itself (:meth:`DataPathSource.bind_fit`): the fit loop
iterates the rebuilt loader, prefetched, and its first epoch's iterator — which Lightning made
before the trials — is made again from the RNG and generator states Lightning made it from, so the
fit sees the same samples in the same order as without speedkit. A fit that reloads its train
loader (``reload_dataloaders_every_n_epochs``) has each new loader served the same way.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any, Literal

import torch

from speedkit import compat
from speedkit.data.loader import (
    Choice,
    LoaderSettings,
    RngStates,
    choose_settings,
    fit_iterator_start,
    format_cpu_list,
    in_process_change_blocker,
    needs_stop_at_length,
    needs_workers,
    not_rebuildable,
    rebuild_loader,
    training_cpus,
    watch_fit_iterator_start,
    worker_dependence,
)
from speedkit.data.prefetch import PrefetchingLoader, TransferTimes
from speedkit.data.ring import BatchRing, handoff_loader, persistent, slot_bytes_for
from speedkit.data.source import BatchSource, SourceWrapper, chain_epochs
from speedkit.errors import ConfigError
from speedkit.rungs.base import AttributeWrapper, Handle, Rung, set_attr
from speedkit.state import TrainState


@dataclasses.dataclass
class DataPathOptions:
    """Options of the data_path rung."""

    #: "auto": chosen by measurement; "keep": the loader's; a number: that many
    workers: Literal["auto", "keep"] | int = "auto"
    #: "auto": pinned on CUDA (where the copy to the device reads it)
    pin_memory: Literal["auto"] | bool = "auto"
    #: copy the next batch to the device on a side stream while the step runs (CUDA)
    prefetch: bool = True
    #: change only what leaves every sample and RNG stream as it was (see speedkit.data.loader)
    exact: bool = True
    #: "auto": workers run off the two cores (and their hyperthreads) left to the training process
    #: (speedkit.data.loader.training_cpus); "any": wherever the process may run
    worker_cpus: Literal["auto", "any"] = "auto"
    #: "auto": workers hand batches over through named shared memory (torch.multiprocessing's
    #: "file_system" sharing strategy) while the rung is on; "keep": the process's strategy
    sharing: Literal["auto", "keep"] = "auto"
    #: on CUDA with workers: they write each batch into shared memory pinned once (a ring of slots)
    #: and the copy to the device reads it there (speedkit.data.ring)
    ring: bool = True
    #: the most host memory the ring may pin (bytes); None: an eighth of the machine's memory, at most 8 GiB
    ring_max_bytes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.workers, int) and self.workers < 0:
            raise ValueError(f"workers must be 'auto', 'keep' or an integer >= 0, found {self.workers!r}")
        if self.worker_cpus not in ("auto", "any"):
            raise ValueError(f"worker_cpus must be 'auto' or 'any', found {self.worker_cpus!r}")
        if self.sharing not in ("auto", "keep"):
            raise ValueError(f"sharing must be 'auto' or 'keep', found {self.sharing!r}")


@dataclasses.dataclass
class Plan:
    """What the rung does to one source: the loader settings (None: not rebuilt) and the prefetching."""

    choice: Choice | None
    prefetch: bool
    lookahead: int
    notes: list[str]
    #: the ring the workers write into: (workers, slots per worker, bytes per slot); None: no ring
    ring: tuple[int, int, int] | None = None

    @property
    def rebuild(self) -> LoaderSettings | None:
        return self.choice.settings if self.choice is not None and self.choice.changed else None


class _Epochs:
    """An iterable whose every iterator is one epoch of ``source`` (:meth:`BatchSource.epoch`)."""

    def __init__(self, source: BatchSource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Any]:
        return self.source.epoch()


def epoch_batches(trainer: Any) -> int | None:
    """The batches a Lightning fit takes from its train loader per epoch (``num_training_batches``:
    its length, or fewer under ``limit_train_batches``), or None where it is not known in advance.
    The fit loop stops there without asking for another, so the prefetcher pulls no further."""
    n = getattr(trainer, "num_training_batches", None)
    return n if isinstance(n, int) and n >= 0 else None


def may_end_epoch_at_batch_start(trainer: Any) -> bool:
    """Whether the fitted module overrides ``on_train_batch_start``, which ends the epoch by returning
    -1 after Lightning fetched the batch and before its step: the loop knows there, not when the batch
    is handed out, whether it asks for another."""
    module = getattr(trainer, "lightning_module", None)
    if module is None or "lightning.pytorch" not in sys.modules:
        return False
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden("on_train_batch_start", module)


class PullAheadAfter(AttributeWrapper):
    """``hook`` (the module's ``on_train_batch_start``) followed, unless it ends the epoch (-1), by
    the served loader pulling the batch ahead, before the step. A copy of the module gets ``hook``."""

    def __init__(self, hook: Callable[..., Any], serving: _Serving) -> None:
        super().__init__(hook)
        self.serving = serving

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        response = self.wrapped(*args, **kwargs)
        if not (isinstance(response, int) and response == -1) and isinstance(self.serving.served, PrefetchingLoader):
            self.serving.served.pull_ahead()
        return response


def _lightning_parts(source: Any) -> tuple[Any, Any]:
    """The Trainer and LightningModule a (wrapped) Lightning source serves, else (None, None)."""
    while source is not None:
        if getattr(source, "trainer", None) is not None and getattr(source, "module", None) is not None:
            return source.trainer, source.module
        source = getattr(source, "inner", None)
    return None, None


def overridden_transfer_hooks(source: Any) -> list[str]:
    """The batch-transfer hooks the user overrides that must see the host batch (they run before
    the copy): ``on_before_batch_transfer`` and ``transfer_batch_to_device`` of the module or datamodule."""
    trainer, module = _lightning_parts(source)
    if trainer is None or "lightning.pytorch" not in sys.modules:
        return []
    from lightning.pytorch.utilities.model_helpers import is_overridden

    found = []
    owners = [("LightningModule", module), ("datamodule", getattr(trainer, "datamodule", None))]
    for hook in ("on_before_batch_transfer", "transfer_batch_to_device"):
        for what, owner in owners:
            if owner is not None and is_overridden(hook, owner):
                found.append(f"{what}.{hook}")
    return found


@dataclasses.dataclass
class _Serving:
    """What a fit's train loop iterates in place of the user's loader: ``original`` (the user's),
    ``fit_loader`` (its rebuilt copy, or ``original``), ``served`` (what the loop iterates: the
    prefetching loader, or ``fit_loader``) and the ring its workers write into."""

    original: Any
    fit_loader: Any
    served: Any
    ring: BatchRing | None
    settings: LoaderSettings | None
    stop_at_length: bool
    reloads: int = 0

    def describe(self) -> str:
        what = (f"a copy of the user's DataLoader with {self.settings.describe()}" if self.settings is not None
                else "the user's DataLoader")
        if self.stop_at_length:
            what += (" (its sampler read through StopAtLength: the workers read it no further than the fit without them, "
                     "so its generator draws the same shuffles)")
        if self.ring is not None:
            what += f", its workers writing each batch into {describe_ring(self.ring)}"
        if isinstance(self.served, PrefetchingLoader):
            what += f", each batch copied to {self.served.device} on a side stream while the step before runs"
            if self.served.ahead_when_told:
                what += (" (the batch ahead pulled once the module's on_train_batch_start lets the step run: an epoch it "
                         "ends with -1 leaves the loader where the fit without speedkit leaves it)")
        return what

    def replace(self, other: _Serving) -> None:
        for field in ("original", "fit_loader", "served", "ring", "settings", "stop_at_length"):
            setattr(self, field, getattr(other, field))

    def unserved(self, loader: Any) -> None:
        """The loop iterates ``loader`` as Lightning made it (nothing of speedkit's to close)."""
        self.original = self.fit_loader = self.served = loader
        self.ring, self.stop_at_length = None, False

    def close(self, trainer: Any, *, put_back: bool = True) -> None:
        """Stop serving: the user's loader back in the loop (``put_back``), the prefetcher closed,
        the ring unpinned, the workers of the rebuilt loader and of the user's stopped."""
        if put_back and compat.lightning_train_loaders(trainer) == [self.served]:
            compat.lightning_set_train_loaders(trainer, [self.original])
        if isinstance(self.served, PrefetchingLoader):
            self.served.close()
        if self.ring is not None:
            self.ring.close()
        if self.fit_loader is not self.original:
            compat.shutdown_workers(self.fit_loader)
        if put_back:
            compat.shutdown_workers(self.original)


class DataPathSource(SourceWrapper):
    """The batches of ``inner`` from the rebuilt loader (if any), prefetched to the device (if so);
    Lightning's transfer hooks (``inner.to_device``) still run on each; parity batches, generators,
    state and release are ``inner``'s."""

    def __init__(self, inner: BatchSource, plan: Plan) -> None:
        super().__init__(inner)
        self.plan = plan
        settings = plan.rebuild
        self.rebuilt = rebuild_loader(inner.loader, **dataclasses.asdict(settings)) if settings is not None else None  # type: ignore[arg-type]
        self.iterable = self.rebuilt if self.rebuilt is not None else inner.iterable
        self.times = TransferTimes()
        self.waits: deque[float] = deque(maxlen=512)
        self.fit_times: TransferTimes | None = None
        self._trial_ring: BatchRing | None = None
        self._live: Generator[Any, None, None] | None = None  # the batches of the live iterator reading the ring
        if self.rebuilt is not None:  # the trials' workers stop with this source at the latest
            weakref.finalize(self, compat.shutdown_workers, self.rebuilt)

    def epoch(self) -> Iterator[Any]:
        return iter(self.rebuilt) if self.rebuilt is not None else self.inner.epoch()

    def iterator(self, epochs: int | None = None) -> Iterator[Any]:
        if not self.plan.prefetch:
            return self._timed(self.host_batches(epochs))
        ring = None
        if self.plan.ring is not None and self.rebuilt is not None:
            if self._live is not None:  # the last iterator's workers stop before the ring is reset
                self._live.close()
            if self._trial_ring is None:
                self._trial_ring = make_ring(self.plan.ring)
            ring = self._trial_ring
        batches = self._prefetched_epochs(ring, epochs)
        self._live = batches if ring is not None else None
        return self._timed(batches)

    def _prefetched_epochs(self, ring: BatchRing | None, epochs: int | None = None) -> Generator[Any, None, None]:
        """Device batches epoch after epoch (``epochs`` of them, or without end), each epoch prefetched as a fit's is (a
        :class:`PrefetchingLoader`) and made when the loop asks for its first batch: the lookahead
        never reads into the next epoch, whose iterator (its shuffle, its workers' seeds: draws from
        the generators or the global RNG, which the step may draw from too) is made after the last
        step of the epoch before, as in the loop without speedkit. Closing this generator stops the
        epoch's copies and the ring's workers."""
        served = PrefetchingLoader(handoff_loader(self.rebuilt, ring) if ring is not None else _Epochs(self), self.device,
                                   lookahead=self.plan.lookahead, times=self.times, ring=ring)
        try:
            yield from chain_epochs(served.__iter__, epochs)
        finally:
            served.close()

    def release_ring(self) -> None:
        """Stop the trials' reading of the ring and unpin it."""
        if self._live is not None:
            self._live.close()
            self._live = None
        if self._trial_ring is not None:
            self._trial_ring.close()
            self._trial_ring = None

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.waits.append((time.perf_counter() - t0) * 1e3)
            yield self.inner.to_device(batch)

    def release(self) -> None:
        self.inner.release()
        self.release_rebuilt()

    def release_rebuilt(self) -> None:
        """Stop the workers the trials' iterator of the rebuilt loader started (persistent ones), and the ring's."""
        self.release_ring()
        if self.rebuilt is not None:
            compat.shutdown_workers(self.rebuilt)

    def report_lines(self) -> list[str]:
        """The figures behind the change: the loader alone before and after, the copies, the waits."""
        lines = []
        choice = self.plan.choice
        if choice is not None:
            before, after = choice.rate(choice.current), choice.rate(choice.settings)
            if before and after:
                lines.append(f"loader alone: {before:.1f} -> {after:.1f} batches/s ({1e3 / before:.2f} -> {1e3 / after:.2f} "
                             f"ms per batch) with {choice.settings.describe()}")
        if self.times.batches:
            lines.append(f"host-to-device copy: {self.times.median_ms():.3f} ms per batch (median of {len(self.times.ms)}) "
                         "on the side stream, overlapped with the step")
        if self.waits:
            lines.append(f"trials with data_path: {statistics.median(self.waits):.3f} ms per batch waited for the next batch "
                         "(median; the measurements' data_wait_ms gives it per step with and without)")
        if self.fit_times is not None and self.fit_times.batches:
            ring = (f"; {self.fit_times.via_ring} of {self.fit_times.batches} batches read from the ring"
                    if self.plan.ring is not None else "")
            lines.append(f"fit: host-to-device copy {self.fit_times.median_ms():.3f} ms per batch (median) on the side "
                         f"stream{ring}")
        return lines

    # -- the Lightning fit ---------------------------------------------------------------------
    def bind_fit(self, trainer: Any, module: Any) -> Handle | None:
        """Make the fit loop iterate the rebuilt loader (or the user's), prefetched; the first
        epoch's iterator made again from the states Lightning made it from (see :meth:`_first_epoch`).
        A fit that reloads its train loader (``reload_dataloaders_every_n_epochs``) gets each new
        loader served the same way (see :meth:`_reloaded`). The handle puts the user's loader back
        and stops the rebuilt loader's workers."""
        loaders = compat.lightning_train_loaders(trainer)
        if loaders is None:
            raise RuntimeError("the fit loop has no train loader set up (Lightning's internals moved?)")
        if len(loaders) != 1 or loaders[0] is not self.loader:
            raise RuntimeError("the fit iterates other train loaders than the trials measured")
        settings = self.plan.rebuild
        if settings is None and not self.plan.prefetch:
            return None
        if self.plan.prefetch:
            self.fit_times = TransferTimes()
            self.release_ring()  # the trials' ring: their workers stopped, their memory unpinned
        serving = self._serve(trainer, loaders[0])
        handle = Handle("data_path")
        watches: list[Callable[[], None]] = []

        def put_back() -> None:
            while watches:
                watches.pop()()
            serving.close(trainer)

        handle.record(f"fit: the train loop iterates {serving.describe()}", put_back)
        if isinstance(serving.served, PrefetchingLoader) and serving.served.ahead_when_told:
            set_attr(handle, module, "on_train_batch_start", PullAheadAfter(module.on_train_batch_start, serving),
                     "fit: the module's on_train_batch_start is followed by the pull of the batch ahead")
        handle.record(f"fit: {self._first_epoch(trainer, serving.original, serving.fit_loader, serving.served)}")
        reload_every = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
        if reload_every:
            unwatch = compat.lightning_watch_train_reload(trainer, lambda: self._reloaded(trainer, serving, handle))
            if unwatch is None:
                handle.record(f"fit: reload_dataloaders_every_n_epochs={reload_every}, but its reloads cannot be watched "
                              "(Lightning's internals moved?): from the first reload on, the fit iterates the new loader "
                              "as Lightning makes it")
            else:  # and the states each reload's iterator is made from (see _reloaded)
                watches += [unwatch, watch_fit_iterator_start(trainer)]
        handle.report = lambda: [line for line in self.report_lines() if line.startswith("fit:")]
        return handle

    def _serve(self, trainer: Any, original: Any) -> _Serving:
        """Make the fit loop iterate ``original`` rebuilt with the plan's settings and prefetched
        (each from its next ``iter()`` on)."""
        settings = self.plan.rebuild
        stop = settings is not None and needs_stop_at_length(original, settings.num_workers)
        fit_loader = rebuild_loader(original, **dataclasses.asdict(settings), stop_at_length=stop) if settings is not None \
            else original
        served: Any = fit_loader
        ring = None
        if self.plan.prefetch:
            if self.plan.ring is not None and settings is not None and settings.num_workers > 0:
                ring = make_ring(self.plan.ring)
            served = PrefetchingLoader(handoff_loader(fit_loader, ring) if ring is not None else fit_loader, self.device,
                                       lookahead=self.plan.lookahead, times=self.fit_times, ring=ring,
                                       limit=epoch_batches(trainer), ahead_when_told=may_end_epoch_at_batch_start(trainer))
        compat.lightning_set_train_loaders(trainer, [served])
        return _Serving(original, fit_loader, served, ring, settings, stop)

    def _reloaded(self, trainer: Any, serving: _Serving, handle: Handle) -> None:
        """The fit loop made a new train loader (``reload_dataloaders_every_n_epochs``): stop
        serving the last one and serve the new one, rebuilt and prefetched. The iterator of it that
        ``setup_data`` made is not the epoch's: past the first epoch, the epoch loop makes the
        epoch's iterator again when it starts (``iter(data_fetcher)``), from the served loader, at
        the moment it would without speedkit (the rebuilt loader draws its shuffle from the same
        sampler and generators)."""
        loaders = compat.lightning_train_loaders(trainer)
        serving.close(trainer, put_back=False)
        if loaders is None or len(loaders) != 1:
            serving.unserved(None)
            handle.record("fit: the reloaded train loaders are several (or none): iterated as Lightning makes them")
            return
        try:
            serving.replace(self._serve(trainer, loaders[0]))
        except Exception as exc:  # the fit goes on with the loader as Lightning made it
            compat.lightning_set_train_loaders(trainer, loaders)
            serving.unserved(loaders[0])
            line = f"fit: serving the reloaded train loader failed ({type(exc).__name__}: {exc}); iterated as Lightning makes it"
            handle.record(line)
            warnings.warn(f"speedkit: data_path {line}", UserWarning, stacklevel=2)
            return
        serving.reloads += 1
        if serving.reloads == 1:
            handle.record("fit: each train loader the fit reloads (reload_dataloaders_every_n_epochs) is served the same way")
        if persistent(serving.original) and serving.fit_loader is not serving.original:
            # the epoch loop resets the persistent iterator setup_data made (drawing only the shuffle);
            # a first iterator of the copy would draw its workers' base seed too: make it now instead
            problem = self._make_again(trainer, serving.original, serving.fit_loader)
            if problem is not None and serving.reloads == 1:
                handle.record(f"fit: a reloaded loader's persistent workers were not made again ({problem}): its copy "
                              "draws its workers' seeds where the fit without speedkit does not")

    def _first_epoch(self, trainer: Any, original: Any, fit_loader: Any, served: Any) -> str:
        """Lightning created the first epoch's iterator from ``original`` before the trials; make it
        again from ``fit_loader``, from the RNG and generator states recorded right before Lightning
        made it, so it draws the same base seed and shuffle. Afterwards the RNGs must be where the
        fit would have them at its first batch: put back where they are now when both loaders draw
        at the same moments (both with workers or both without), else left where the new iterator
        leaves them, which is exact when nothing drew between Lightning's creation and now.

        Where the loader is the user's own (only prefetched), the iterator Lightning made is
        prefetched as it is instead: making it again would restart a persistent-workers loader's
        live iterator, whose workers already made (and drew random numbers for) its first batches."""
        later = "the first epoch runs on the iterator Lightning made; the rebuilt loader serves from the next epoch on"
        if not compat.lightning_first_epoch_pending(trainer):
            return f"{later} (the fit already fetched a batch, or resumes)"
        if fit_loader is original:
            if isinstance(served, PrefetchingLoader) and compat.lightning_wrap_train_iterators(trainer, served.prefetch):
                return "the first epoch's iterator, which Lightning made, prefetched as it is"
            return "the first epoch runs on the iterator Lightning made; prefetching starts with the next epoch"
        problem = self._make_again(trainer, original, fit_loader)
        if problem is not None:
            return f"{later} ({problem})"
        return "the first epoch's iterator made again from the RNG and generator states Lightning made it from"

    @staticmethod
    def _make_again(trainer: Any, original: Any, fit_loader: Any) -> str | None:
        """Make the fit loop's train iterator again, now from the loader it iterates, from the RNG and
        generator states recorded right before Lightning made it from ``original`` (then put back
        where they are now, where both loaders draw at the same moments); stop ``original``'s
        workers. None when done, else why not (nothing changed)."""
        start = fit_iterator_start(trainer)
        if start is None or start.after is None or len(start.loaders) != 1 or start.loaders[0] is not original:
            return "the states it was made from were not recorded: SpeedLadder records them from on_fit_start"
        now = RngStates.capture([g for g, _ in start.before.generators])
        same_moments = (getattr(original, "num_workers", 0) > 0) == (getattr(fit_loader, "num_workers", 0) > 0)
        if not same_moments and not now.same_as(start.after):
            return ("the RNGs were drawn from between its creation and the trials, and the new worker count "
                    "draws the shuffle at another moment")
        start.before.restore()
        try:
            replaced = compat.lightning_restart_train_iterator(trainer)
        except BaseException:
            now.restore()
            raise
        if same_moments:
            now.restore()
        for it in replaced:
            compat.shutdown_iterator(it)
        compat.shutdown_workers(original)  # a persistent-workers loader's live iterator
        return None


def make_ring(spec: tuple[int, int, int]) -> BatchRing | None:
    """A ring of ``spec`` (workers, slots per worker, bytes per slot), pinned; None where it cannot be made
    or pinned (the batches then travel the usual way)."""
    try:
        ring = BatchRing(*spec)
    except (RuntimeError, OSError, MemoryError):
        return None
    return ring if ring.register() else None


def describe_ring(ring: BatchRing) -> str:
    return (f"a ring of shared pinned memory ({ring.nbytes / 2**20:,.0f} MiB: {ring.slots_per_worker} slots of "
            f"{ring.slot_bytes / 2**20:.1f} MiB per worker), copied to the device from there")


def plan_ring(choice: Choice | None, options: DataPathOptions, notes: list[str]) -> tuple[int, int, int] | None:
    """The ring for the chosen settings: one slot per batch a worker may have outstanding, plus two."""
    if not options.ring or choice is None or choice.settings.num_workers == 0 or not choice.batch_bytes:
        return None
    settings = choice.settings
    spec = (settings.num_workers, (settings.prefetch_factor or 2) + 2, slot_bytes_for(choice.batch_bytes))
    total, cap = spec[0] * spec[1] * spec[2], options.ring_max_bytes
    if cap is None:
        cap = min(8 << 30, physical_memory() // 8)
    if total > cap:
        notes.append(f"no ring: {total / 2**30:.1f} GiB of pinned memory for {spec[0]} workers x {spec[1]} slots of "
                     f"{spec[2] / 2**20:.0f} MiB is over ring_max_bytes ({cap / 2**30:.1f} GiB)")
        return None
    free = shared_memory_free()
    if free is not None and 2 * total > free:  # the trials' ring and the fit's, and room for batches sent the usual way
        notes.append(f"no ring: {total / 2**30:.2f} GiB of shared memory per ring, and /dev/shm has {free / 2**30:.2f} GiB "
                     "free (a full /dev/shm ends a process that writes to it; a container's is often 64 MiB: "
                     "docker run --shm-size raises it)")
        return None
    return spec


def shared_memory_free(path: str = "/dev/shm") -> int | None:
    """Bytes free where shared memory lives (None where there is no such place to ask)."""
    try:
        stat = os.statvfs(path)
    except (AttributeError, OSError):
        return None
    return stat.f_bavail * stat.f_frsize


def physical_memory() -> int:
    """Bytes of memory the machine reports (0 where it does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0


def share_by_name(handle: Handle) -> None:
    """Workers hand their batches to this process through named shared memory while ``handle`` is on.

    torch's default strategy ("file_descriptor") passes each tensor's memory as a file descriptor:
    for every tensor of every batch the receiving thread (the loader's pinning thread) opens an
    authenticated socket connection to the worker, a few round trips, each one releasing and taking
    back the GIL, which the thread issuing the step then waits for. "file_system" passes a name,
    opened without a round trip. Which memory carries a batch changes none of its values.
    """
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    if before != "file_descriptor" or "file_system" not in mp.get_all_sharing_strategies():
        return
    mp.set_sharing_strategy("file_system")
    handle.record("workers hand batches over through named shared memory (torch.multiprocessing sharing strategy "
                  "file_system, was file_descriptor: no socket round trips per tensor in the training process)",
                  lambda: mp.set_sharing_strategy(before), persistent=True)


class DataPathRung(Rung):
    name = "data_path"
    host_side = True  # the device waits for its batch: a busy device does not
    Options = DataPathOptions
    precision = None  # the same batches, in the same order
    #: needs the train loader, which a Lightning fit has from on_train_start on
    lightning_stage = "train_start"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._plans: dict[tuple[int, str], Plan] = {}

    def check(self, state: TrainState) -> str | None:
        if state.data is None:
            return "no data source: the batches are fed by hand"
        plan = self.plan(state)
        if plan.rebuild is None and not plan.prefetch:
            return "nothing to change: " + "; ".join(plan.notes)
        return None

    def plan(self, state: TrainState) -> Plan:
        """What to do for ``state.data`` (measured once per loader and device)."""
        source = state.data
        assert source is not None
        key = (id(source.loader), str(state.device))
        if key not in self._plans:
            step = getattr(state, "step", None)
            self._plans[key] = self._make_plan(source, state.device, step.host_processes() if step is not None else (0, 1))
        return self._plans[key]

    def _make_plan(self, source: BatchSource, device: torch.device, processes: tuple[int, int] = (0, 1)) -> Plan:
        opts, loader, notes = self.options, source.loader, []
        cuda = device.type == "cuda"
        prefetch = False
        if not opts.prefetch:
            notes.append("prefetching is off (option prefetch: false)")
        elif not cuda:
            notes.append("on a CPU there is no copy to a device to pin or overlap")
        elif hooks := overridden_transfer_hooks(source):
            notes.append(f"{', '.join(hooks)} is overridden and expects the host batch: the copy is left to Lightning")
        else:
            prefetch = True
        choice = None
        why = not_rebuildable(loader)
        if why is not None:
            notes.append(why)
        else:
            current = loader.num_workers
            workers = opts.workers if isinstance(opts.workers, int) else None
            vary = opts.workers == "auto"
            count_may_change = vary or (workers is not None and workers != current)
            # whether its samples depend on the worker's state: decides what exact mode may change
            dependence = (worker_dependence(loader.dataset, loader.collate_fn, batched=loader.batch_sampler is not None)
                          if opts.exact and (count_may_change or persistent(loader)) else None)
            if dependence is not None and count_may_change:
                vary, workers = False, None
                notes.append(f"num_workers kept at {current}: {dependence}")
            factors: tuple[int, ...] = (2, 4)
            keep_factor = None
            if dependence is not None and persistent(loader):
                factors = (loader.prefetch_factor,)
                keep_factor = (f"prefetch_factor kept at {loader.prefetch_factor}: the loader's workers are persistent and "
                               f"{dependence.what}; an epoch that ends before its loader (limit_train_batches, a break, "
                               "on_train_batch_start returning -1) leaves prefetch_factor batches per worker made ahead and "
                               "dropped, which moves what the workers make in every later epoch")
            pin = None if opts.pin_memory == "auto" else opts.pin_memory
            if pin is None and not cuda:
                pin = bool(loader.pin_memory)  # pinning serves a copy to a device only
            if vary or workers is not None or pin != bool(loader.pin_memory):
                if opts.exact and workers == 0 and loader.persistent_workers:
                    notes.append(f"num_workers kept at {current}: the loader's persistent workers draw one base seed per "
                                 "fit, a loader without workers one per epoch (another shuffle from the next epoch on)")
                    workers = current
                if workers == 0 and current > 0 and (needs := needs_workers(loader)) is not None:
                    notes.append(f"num_workers kept at {current}: {needs}, which needs num_workers > 0")
                    workers = current
                same_side = False
                if opts.exact and (vary or workers is not None) and (side := in_process_change_blocker(loader)) is not None:
                    same_side = True
                    if workers is not None and (workers > 0) != (current > 0):
                        workers = current
                    notes.append(f"num_workers stays {'0' if current == 0 else 'above 0'}: {side}")
                    vary = vary and current > 0
                kept, rest = training_cpus(processes=processes)  # with none kept, rest is this process's share
                if opts.worker_cpus != "auto":
                    kept, rest = set(), kept | rest
                if kept:
                    ranks = (f" (training process {processes[0]} of {processes[1]} on this machine: its share of the CPUs)"
                             if processes[1] > 1 else "")
                    notes.append(f"CPUs {format_cpu_list(kept)} left to the training process (the core issuing the step "
                                 f"and one more, with their hyperthreads); workers on {format_cpu_list(rest)}{ranks}")
                if keep_factor is not None:
                    notes.append(keep_factor)
                try:
                    choice = choose_settings(loader, device, vary_workers=vary, workers=workers, pin_memory=pin,
                                             exact=opts.exact, same_side=same_side,
                                             worker_cpus=tuple(sorted(rest)) if kept else None,
                                             cpus=None if kept else len(rest), factors=factors)
                except ConfigError as exc:  # a loader that yields no batch, settings it refuses: left as it is
                    notes.append(f"the loader is left as it is: {exc}")
                    choice = None
                if choice is not None and len(choice.rates) == 1:  # only the current settings were candidates
                    choice = None
                elif choice is not None and not choice.changed:
                    notes.append(f"the loader's own settings ({choice.current.describe()}) were the fastest measured")
        settings = choice.settings if choice is not None else None
        served_workers = settings.num_workers if settings is not None else getattr(loader, "num_workers", 0)
        ring = plan_ring(choice if choice is not None and choice.changed else None, opts, notes) if prefetch else None
        return Plan(choice, prefetch, 1 if served_workers > 0 else 0, notes, ring)

    def apply(self, state: TrainState) -> Handle:
        plan = self.plan(state)
        handle = Handle(self.name)
        source = DataPathSource(state.data, plan)  # type: ignore[arg-type]
        changes = []
        if plan.rebuild is not None:
            changes.append(f"loader: a copy of the user's DataLoader (same dataset, sampler, collate_fn, generator) with "
                           f"{plan.rebuild.describe()} (was {plan.choice.current.describe()})")  # type: ignore[union-attr]
        if plan.prefetch:
            changes.append(f"batches copied to {state.device} on a side CUDA stream while the step before runs "
                           f"({'one batch ahead' if plan.lookahead else 'pulled when needed: the loader works in this process'})")
        if plan.ring is not None:
            workers, slots, slot = plan.ring
            changes.append(f"workers write each batch into shared memory pinned once ({workers} x {slots} slots of "
                           f"{slot / 2**20:.1f} MiB), read from there by the copy (no pinning thread, no handoff per tensor)")
        set_attr(handle, state, "data", source, "; ".join(changes))
        if plan.rebuild is not None and plan.rebuild.num_workers > 0 and self.options.sharing == "auto":
            share_by_name(handle)
        handle.record("", source.release_rebuilt, persistent=True)  # at undo only: the trials' iterator lives on while suspended
        for line in [*(plan.choice.lines() if plan.choice is not None else []), *plan.notes]:
            handle.record(f"note: {line}")
        handle.report = source.report_lines
        return handle
