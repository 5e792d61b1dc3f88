"""data_path: loader workers and pinning chosen by measurement, the next batch copied to the GPU during the step.

Speeds up: steps that wait for their batch (decoding and augmenting on too few workers, pageable
host-to-device copies on the compute stream). Does not help: a loader already faster than the step,
batches made on the device.
Needs: a torch ``DataLoader`` to rebuild (any other iterable is only prefetched); a CUDA device for
pinning and prefetching (on a CPU only the worker count can change).
Numerics: the same samples in the same order, with the same labels. Their augmentations may draw other
random numbers: a dataset whose transforms draw from the global torch RNG (torchvision's, as users write
them) draws, in each worker, from that worker's stream, seeded from the loader's base seed and its id, so
another worker count draws other augmentations from the same distributions, as when users change
``num_workers`` themselves; the report says which draws change. ``exact: true`` keeps every draw.

The user's loader is copied (:func:`~speedkit.data.settings.rebuild_loader`: the same dataset,
sampler, collate_fn, generator, ... objects) with settings chosen by measuring the loader alone
(:func:`~speedkit.data.choose.choose_settings`): the worker count from the measured pace and the CPUs
left to workers. What must not change never does: the sample order and every draw of the training
process (the sampler's shuffles, dropout). So the worker count stays on its side (workers, or none)
where the samples draw random numbers (made in the training process, those draws move its own), a
sampler drawing from a generator of its own gains workers only read no further than the fit without
them reads it (``shuffle=True, generator=g``, so the generator draws the same shuffles), and persistent
workers are never turned on (a persistent iterator draws no base seed per epoch, which moves the next
epoch's shuffle; see :mod:`speedkit.data.settings`). Where the worker count (or a persistent loader's
prefetch factor) changes the samples' draws, the trials' parity compares what must hold on the loaders
themselves (:func:`~speedkit.data.parity.compare_loaders`: the sample indices in order, the labels, every
leaf's shape and dtype) and says what it did not compare (the augmented values), as no loss trajectory
can match. With ``exact`` only settings that leave every sample and every RNG stream as they were are
changed: the worker count only when the dataset's samples (and its collate_fn) do not draw random
numbers, the prefetch factor only when they do not or the workers are not persistent. On
CUDA, batches are copied by a :class:`~speedkit.data.prefetch.DevicePrefetcher` on a side stream
(``record_stream``, stream waits), which never reads into the next epoch before the loop asks for it
(making an epoch's iterator draws its shuffle and its workers' seeds, which the step's own draws,
dropout, would otherwise move); in a fit, no further than the batches Lightning takes per epoch
(``limit_train_batches``, or ``on_train_batch_start`` returning -1, after which the batch ahead is
pulled: persistent workers then make, and draw random numbers for, the batches they would without
speedkit); a plain loop that ``break``s off an epoch has had one batch more read. Lightning's batch
hooks still run, in their order, on the batch already on the device (``on_before_batch_transfer``,
then ``transfer_batch_to_device``, which finds it there, then ``on_after_batch_transfer``). A module
or datamodule that overrides ``on_before_batch_transfer`` or ``transfer_batch_to_device`` expects the
host batch: the copy is then left to Lightning (not prefetched), the loader settings still apply.

Where the loader's work runs in workers, three things keep it from slowing the thread that issues
the step (on a GPU, the step waits for that thread): the workers run off two cores left to the
training process (``worker_cpus``; under DDP each rank takes its own share of the machine's cores,
the two kept for training apart); on CUDA each worker writes its batch into a ring of shared memory
pinned once, from which the copy to the device reads (``ring``, :mod:`speedkit.data.ring`:
persistent workers keep the ring across epochs, and the slots of batches an epoch cut short left
unread come back), so the training process runs no pinning thread and takes no handoff per tensor;
a batch that travels the usual way comes through named shared memory (``sharing``), without a
socket round trip per tensor. Each of those handoffs turned the GIL over to another thread of the
training process, which the step's thread then waited for.

In a Lightning fit the kept rung's source is bound (:class:`speedkit.lightning.data.DataPathFit`): the
fit loop iterates the rebuilt loader, prefetched, and its first epoch's iterator — which Lightning
made before the trials — is made again from the RNG and generator states Lightning made it from (the
user's own loader, only prefetched, keeps the iterator Lightning made, prefetched as it is), so the
fit sees the same samples in the same order as without speedkit. A fit that reloads its train
loader (``reload_dataloaders_every_n_epochs``) has each new loader served the same way. The report
gives data wait and copy time per step. The settings chosen are kept with a cached decision
(``chosen``); a later fit re-checking it applies them without measuring again (``reuse``), where
the user's loader is as it was.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import weakref
from collections import deque
from collections.abc import Generator, Iterator
from typing import Any, Literal

import torch

from speedkit import compat
from speedkit.data.choose import Choice, choose_settings
from speedkit.data.parity import BatchParity, compare_loaders
from speedkit.data.prefetch import PrefetchingLoader, TransferTimes
from speedkit.data.ring import BatchRing, handoff_loader, make_ring, persistent, slot_bytes_for
from speedkit.data.settings import (
    LoaderSettings,
    in_process_change_blocker,
    needs_workers,
    not_rebuildable,
    rebuild_loader,
)
from speedkit.data.source import BatchSource, SourceWrapper, chain_epochs
from speedkit.data.topology import format_cpu_list, physical_memory, shared_memory_free, training_cpus
from speedkit.data.workers import WorkerDependence, worker_dependence
from speedkit.errors import ConfigError
from speedkit.rungs.base import Handle, Rung, set_attr
from speedkit.training.state import TrainState


@dataclasses.dataclass
class DataPathOptions:
    """Options of the data_path rung."""

    #: "auto": chosen by measurement; "keep": the loader's; a number: that many
    workers: Literal["auto", "keep"] | int = "auto"
    #: "auto": pinned on CUDA (where the copy to the device reads it)
    pin_memory: Literal["auto"] | bool = "auto"
    #: copy the next batch to the device on a side stream while the step runs (CUDA)
    prefetch: bool = True
    #: True: change only what leaves every sample and RNG stream as it was (see speedkit.data.settings);
    #: False: the worker count (and a persistent loader's prefetch factor) may also change where that changes
    #: only the samples' draws from the RNGs every worker seeds (augmentations), never their order or labels
    exact: bool = False
    #: "auto": workers run off the two cores (and their hyperthreads) left to the training process
    #: (speedkit.data.topology.training_cpus); "any": wherever the process may run
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
    #: where the settings may change the samples' random draws (``exact`` off): what the samples draw from
    draws: WorkerDependence | None = None

    @property
    def draws_change(self) -> bool:
        """Whether the settings chosen change which random numbers the samples draw: another worker count,
        or another prefetch factor of persistent workers, of a dataset whose samples draw from the RNGs
        every worker seeds."""
        if self.draws is None or self.rebuild is None or self.choice is None:
            return False
        now, then = self.rebuild, self.choice.current
        return now.num_workers != then.num_workers or (then.persistent_workers and now.prefetch_factor != then.prefetch_factor)

    @property
    def rebuild(self) -> LoaderSettings | None:
        return self.choice.settings if self.choice is not None and self.choice.changed else None


class _Epochs:
    """An iterable whose every iterator is one epoch of ``source`` (:meth:`BatchSource.epoch`)."""

    def __init__(self, source: BatchSource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Any]:
        return self.source.epoch()


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

    def buffered_at_most(self) -> int:
        """What its loader's workers queue (:meth:`BatchSource.buffered_at_most`), or, with a ring, what the
        ring's slots hold where that is more, and the batch copied ahead."""
        ring = self.plan.ring[0] * self.plan.ring[1] if self.plan.ring is not None and self.rebuilt is not None else 0
        return max(super().buffered_at_most(), ring) + (self.plan.lookahead if self.plan.prefetch else 0)

    def _prefetched_epochs(self, ring: BatchRing | None, epochs: int | None = None) -> Generator[Any, None, None]:
        """Device batches epoch after epoch (``epochs`` of them, or without end), each epoch prefetched as a fit's is (a
        :class:`PrefetchingLoader`) and made when the loop asks for its first batch: the lookahead
        never reads into the next epoch, whose iterator (its shuffle, its workers' seeds: draws from
        the generators or the global RNG, which the step may draw from too) is made after the last
        step of the epoch before, as in the loop without speedkit. Closing this generator stops the
        epoch's copies and the ring's workers."""
        served = PrefetchingLoader(
            handoff_loader(self.rebuilt, ring) if ring is not None else _Epochs(self),
            self.device,
            lookahead=self.plan.lookahead,
            times=self.times,
            ring=ring,
        )
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
            if not self.reading_ahead:
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
                lines.append(
                    f"loader alone: {before:.1f} -> {after:.1f} batches/s ({1e3 / before:.2f} -> {1e3 / after:.2f} "
                    f"ms per batch) with {choice.settings.describe()}"
                )
        if self.times.batches:
            lines.append(
                f"host-to-device copy: {self.times.median_ms():.3f} ms per batch (median of {len(self.times.ms)}) "
                "on the side stream, overlapped with the step"
            )
        if self.waits:
            lines.append(
                f"trials with data_path: {statistics.median(self.waits):.3f} ms per batch waited for the next batch "
                "(median; the measurements' data_wait_ms gives it per step with and without)"
            )
        if self.fit_times is not None and self.fit_times.batches:
            ring = (
                f"; {self.fit_times.via_ring} of {self.fit_times.batches} batches read from the ring"
                if self.plan.ring is not None
                else ""
            )
            lines.append(
                f"fit: host-to-device copy {self.fit_times.median_ms():.3f} ms per batch (median) on the side stream{ring}"
            )
        return lines

    def fit_serving(self) -> BatchSource | None:
        """This source: a fit iterates the rebuilt loader, or prefetches its batches
        (:class:`speedkit.lightning.data.DataPathFit` binds it)."""
        return self


def describe_draws(plan: Plan) -> str | None:
    """Which random draws the plan's settings change (:attr:`Plan.draws_change`), and what they leave as it was."""
    if not plan.draws_change:
        return None
    draws, now, then = plan.draws, plan.rebuild, plan.choice.current  # type: ignore[union-attr]
    rngs = " and ".join(draws.draws)  # type: ignore[union-attr]
    what = "the samples" if draws.what.startswith("its samples") else "the collate_fn"  # type: ignore[union-attr]
    if now.num_workers != then.num_workers:  # type: ignore[union-attr]
        how = f"{now.num_workers} workers draw other numbers than {then.num_workers} did"  # type: ignore[union-attr]
    else:
        how = (
            f"prefetch_factor {now.prefetch_factor} (persistent workers) draws other numbers than {then.prefetch_factor} "  # type: ignore[union-attr]
            "from the first epoch cut short on"
        )
    return (
        f"draws that change: what {what} draw from the {rngs} RNG{'s' if len(draws.draws) > 1 else ''} (augmentations; "  # type: ignore[union-attr]
        f"each worker draws from its own stream, seeded from the loader's base seed and its worker id): {how}. "
        "Unchanged: the sample order, the labels and the distributions drawn from (data_path's exact: true keeps "
        "every draw)"
    )


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
        notes.append(
            f"no ring: {total / 2**30:.1f} GiB of pinned memory for {spec[0]} workers x {spec[1]} slots of "
            f"{spec[2] / 2**20:.0f} MiB is over ring_max_bytes ({cap / 2**30:.1f} GiB)"
        )
        return None
    free = shared_memory_free()
    if free is not None and 2 * total > free:  # the trials' ring and the fit's, and room for batches sent the usual way
        notes.append(
            f"no ring: {total / 2**30:.2f} GiB of shared memory per ring, and /dev/shm has {free / 2**30:.2f} GiB "
            "free (a full /dev/shm ends a process that writes to it; a container's is often 64 MiB: "
            "docker run --shm-size raises it)"
        )
        return None
    return spec


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
    handle.record(
        "workers hand batches over through named shared memory (torch.multiprocessing sharing strategy "
        "file_system, was file_descriptor: no socket round trips per tensor in the training process)",
        lambda: mp.set_sharing_strategy(before),
        persistent=True,
    )


class DataPathRung(Rung):
    name = "data_path"
    # the step's wait for its batch (loader workers, pinning, prefetch): nothing the device does
    targets = ("data_wait",)
    host_side = True  # the device waits for its batch: a busy device does not
    Options = DataPathOptions
    precision = None  # the same batches, in the same order
    #: needs the train loader, which a Lightning fit has from on_train_start on
    lightning_stage = "train_start"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._plans: dict[tuple[int, str], Plan] = {}
        #: the plan of the latest apply (what :meth:`chosen` keeps with a cached decision)
        self._applied: Plan | None = None
        #: what a cached decision's fit chose by measuring (:meth:`reuse`), taken where it still fits
        self._reused: dict[str, Any] | None = None

    def chosen(self) -> dict[str, Any] | None:
        """The loader settings the latest apply chose by measuring (:meth:`Choice.kept`); None where it measured none."""
        choice = self._applied.choice if self._applied is not None else None
        return choice.kept() if choice is not None else None

    def reuse(self, chosen: dict[str, Any]) -> None:
        self._reused = dict(chosen) if isinstance(chosen, dict) else None
        self._plans.clear()

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
            self._plans[key] = self._make_plan(source, state.device, state.step.host_processes())
        return self._plans[key]

    def _make_plan(self, source: BatchSource, device: torch.device, processes: tuple[int, int] = (0, 1)) -> Plan:
        opts, loader, notes = self.options, source.loader, []
        cuda = device.type == "cuda"
        prefetch = False
        if not opts.prefetch:
            notes.append("prefetching is off (option prefetch: false)")
        elif not cuda:
            notes.append("on a CPU there is no copy to a device to pin or overlap")
        elif hooks := source.host_batch_hooks():
            notes.append(f"{', '.join(hooks)} is overridden and expects the host batch: the copy is left to Lightning")
        else:
            prefetch = True
        choice, draws = None, None
        why = not_rebuildable(loader)
        if why is not None:
            notes.append(why)
        else:
            current = loader.num_workers
            workers = opts.workers if isinstance(opts.workers, int) else None
            vary = opts.workers == "auto"
            count_may_change = vary or (workers is not None and workers != current)
            # whether its samples depend on the worker's state: decides what may change
            dependence = (
                worker_dependence(loader.dataset, loader.collate_fn, batched=loader.batch_sampler is not None)
                if count_may_change or persistent(loader)
                else None
            )
            # outside exact mode, draws from the RNGs every worker seeds may change (augmentations): nothing else
            draws = dependence if dependence is not None and dependence.worker_seeded and not opts.exact else None
            blocking = dependence if draws is None else None
            if blocking is not None and count_may_change:
                vary, workers = False, None
                keeps = " (data_path's exact: true keeps every draw)" if blocking.worker_seeded else ""
                notes.append(f"num_workers kept at {current}: {blocking}{keeps}")
            factors: tuple[int, ...] = (2, 4)
            keep_factor = None
            if blocking is not None and persistent(loader):
                factors = (loader.prefetch_factor,)
                keep_factor = (
                    f"prefetch_factor kept at {loader.prefetch_factor}: the loader's workers are persistent and "
                    f"{blocking.what}; an epoch that ends before its loader (limit_train_batches, a break, "
                    "on_train_batch_start returning -1) leaves prefetch_factor batches per worker made ahead and "
                    "dropped, which moves what the workers make in every later epoch"
                )
            pin = None if opts.pin_memory == "auto" else opts.pin_memory
            if pin is None and not cuda:
                pin = bool(loader.pin_memory)  # pinning serves a copy to a device only
            if vary or workers is not None or pin != bool(loader.pin_memory):
                if workers == 0 and loader.persistent_workers:
                    notes.append(
                        f"num_workers kept at {current}: the loader's persistent workers draw one base seed per "
                        "fit, a loader without workers one per epoch (another shuffle from the next epoch on)"
                    )
                    workers = current
                if workers == 0 and current > 0 and (needs := needs_workers(loader)) is not None:
                    notes.append(f"num_workers kept at {current}: {needs}, which needs num_workers > 0")
                    workers = current
                same_side = False
                side = in_process_change_blocker(loader) if vary or workers is not None else None
                if side is None and draws is not None and (vary or workers is not None):
                    side = (
                        f"{draws.what}, from the training process's RNGs: made in workers instead, they would leave "
                        if current == 0
                        else f"{draws.what}, from each worker's RNGs: made here instead, they would draw from "
                    ) + "the training process's RNGs, which moves its own later draws (the next epoch's shuffle, dropout)"
                if side is not None:
                    same_side = True
                    if workers is not None and (workers > 0) != (current > 0):
                        workers = current
                    notes.append(f"num_workers stays {'0' if current == 0 else 'above 0'}: {side}")
                    vary = vary and current > 0
                kept, rest = training_cpus(processes=processes)  # with none kept, rest is this process's share
                if opts.worker_cpus != "auto":
                    kept, rest = set(), kept | rest
                if kept:
                    ranks = (
                        f" (training process {processes[0]} of {processes[1]} on this machine: its share of the CPUs)"
                        if processes[1] > 1
                        else ""
                    )
                    notes.append(
                        f"CPUs {format_cpu_list(kept)} left to the training process (the core issuing the step "
                        f"and one more, with their hyperthreads); workers on {format_cpu_list(rest)}{ranks}"
                    )
                if keep_factor is not None:
                    notes.append(keep_factor)
                try:
                    reuse, self._reused = self._reused, None  # once: a later plan (another loader) measures
                    choice = choose_settings(
                        loader,
                        device,
                        vary_workers=vary,
                        workers=workers,
                        pin_memory=pin,
                        # persistent workers as the loader's: turned on, they draw no base seed per epoch,
                        # which moves the next epochs' shuffle (in either mode)
                        exact=True,
                        same_side=same_side,
                        worker_cpus=tuple(sorted(rest)) if kept else None,
                        cpus=None if kept else len(rest),
                        factors=factors,
                        reuse=reuse,
                    )
                except ConfigError as exc:  # a loader that yields no batch, settings it refuses: left as it is
                    notes.append(f"the loader is left as it is: {exc}")
                    choice = None
                if choice is not None and len(choice.rates) == 1:  # only the current settings were candidates
                    choice = None
                elif choice is not None and not choice.changed and choice.rates:
                    notes.append(f"the loader's own settings ({choice.current.describe()}) were the fastest measured")
        settings = choice.settings if choice is not None else None
        served_workers = settings.num_workers if settings is not None else getattr(loader, "num_workers", 0)
        ring = plan_ring(choice if choice is not None and choice.changed else None, opts, notes) if prefetch else None
        return Plan(choice, prefetch, 1 if served_workers > 0 else 0, notes, ring, draws)

    def batch_parity(self, state: TrainState, batches: int) -> BatchParity | None:
        """Where the settings applied change the samples' random draws (:attr:`Plan.draws_change`), what must
        not change, compared between the user's loader and the rebuilt one (:func:`compare_loaders`: the
        sample indices in order, the labels, the shapes and dtypes); None where every sample is as it was."""
        source = state.data
        while source is not None and not isinstance(source, DataPathSource):
            source = getattr(source, "inner", None)
        if source is None or source.rebuilt is None or not source.plan.draws_change:
            return None
        return compare_loaders(source.loader, source.rebuilt, batches)

    def apply(self, state: TrainState) -> Handle:
        plan = self._applied = self.plan(state)
        handle = Handle(self.name)
        source = DataPathSource(state.data, plan)  # type: ignore[arg-type]
        changes = []
        if plan.rebuild is not None:
            changes.append(
                f"loader: a copy of the user's DataLoader (same dataset, sampler, collate_fn, generator) with "
                f"{plan.rebuild.describe()} (was {plan.choice.current.describe()})"
            )  # type: ignore[union-attr]
        if plan.prefetch:
            changes.append(
                f"batches copied to {state.device} on a side CUDA stream while the step before runs "
                f"({'one batch ahead' if plan.lookahead else 'pulled when needed: the loader works in this process'})"
            )
        if plan.ring is not None:
            workers, slots, slot = plan.ring
            changes.append(
                f"workers write each batch into shared memory pinned once ({workers} x {slots} slots of "
                f"{slot / 2**20:.1f} MiB), read from there by the copy (no pinning thread, no handoff per tensor)"
            )
        set_attr(handle, state, "data", source, "; ".join(changes))
        if (draws := describe_draws(plan)) is not None:
            handle.record(draws)
        if plan.rebuild is not None and plan.rebuild.num_workers > 0 and self.options.sharing == "auto":
            share_by_name(handle)
        handle.record("", source.release_rebuilt, persistent=True)  # at undo only: the trials' iterator lives on while suspended
        for line in [*(plan.choice.lines() if plan.choice is not None else []), *plan.notes]:
            handle.record(f"note: {line}")
        handle.report = source.report_lines
        return handle
