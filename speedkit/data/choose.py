"""Loader settings chosen by measurement: :func:`choose_settings` measures candidates (loader throughput
over a warmed-up window of host batches, plus the pinned copy to the device on CUDA, :func:`loader_rate`)
and picks the cheapest within a few percent of the best (``loader.tolerance`` in ``configs/defaults.yaml``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from speedkit import compat, config
from speedkit.data.batch import move_to_device, tensor_bytes
from speedkit.data.rng import RngState, loader_generators, loader_rng_owners
from speedkit.data.settings import LoaderSettings, rebuild_loader
from speedkit.data.topology import available_cpus
from speedkit.errors import ConfigError

Clock = Callable[[], float]


def worker_counts(current: int, cpus: int, *, limit: int | None = None) -> list[int]:
    """Worker counts to try: the current one, then 2, 4, 8, ... up to ``limit`` (default: the CPU
    count less two), and that count itself. Two cores stay for the training process: its Python
    thread issuing the step (on a GPU, starving it starves the device) and the thread pinning and
    copying batches. Loading alone measures fastest with every core busy; the step it feeds does not."""
    limit = max(1, cpus - 2) if limit is None else max(1, limit)
    counts = [current]
    n = 2
    while n <= limit:
        if n not in counts:
            counts.append(n)
        n *= 2
    if limit >= 2 and limit not in counts:
        counts.append(limit)
    return counts


def loader_rate(
    loader: Iterable[Any],
    device: torch.device,
    *,
    clock: Clock = time.perf_counter,
    warmup: int = 2,
    batches: int = 16,
    max_s: float = 2.0,
    sizes: list[int] | None = None,
) -> float:
    """Batches per second ``loader`` delivers once warmed up: ``warmup`` batches untimed (worker start,
    the prefetched queue), then ``batches`` timed (fewer, at least 2, past ``max_s`` seconds on
    ``clock``), each copied to ``device`` from pinned memory when it is a CUDA device (one wait at
    the end of the window). An epoch that ends is started again inside the window. ``sizes``: the
    tensor bytes of each timed batch are appended to it."""
    cuda = torch.device(device).type == "cuda"
    it = _endless(loader)
    try:
        for _ in range(warmup):
            batch = next(it)
            if cuda:
                move_to_device(batch, device, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(device)
        start = clock()
        n = 0
        while n < batches and (n < 2 or clock() - start < max_s):
            batch = next(it)
            if cuda:
                move_to_device(batch, device, non_blocking=True)
            if sizes is not None:
                sizes.append(tensor_bytes(batch))
            n += 1
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = clock() - start
    finally:
        it.close()
        compat.shutdown_workers(loader)
    return n / elapsed if elapsed > 0 else float("inf")


def _endless(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's batches, epoch after epoch; the workers of the iterator in use stop when this closes
    (an exhausted iterator stops its own, unless persistent: then the next epoch reuses it)."""
    it = None
    try:
        while True:
            it = iter(loader)
            empty = True
            for batch in it:
                empty = False
                yield batch
            if empty:
                raise ConfigError("data", "the train loader yielded no batch; check the dataset length and batch size")
    finally:
        if it is not None:
            compat.shutdown_iterator(it)


#: the settings a choice keeps (:meth:`Choice.kept`): the CPUs its workers ran on are the machine's, not the choice's
_KEPT_FIELDS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


def _taken(reuse: dict[str, Any], current: LoaderSettings, candidates: list[LoaderSettings]) -> LoaderSettings | None:
    """The candidate ``reuse`` (:meth:`Choice.kept`) chose, where ``current`` is what it was chosen for; else None."""
    try:
        if {k: getattr(current, k) for k in reuse["current"]} != reuse["current"]:
            return None
        chosen = {k: reuse["settings"][k] for k in _KEPT_FIELDS}
    except (KeyError, TypeError):
        return None
    return next((c for c in candidates if {k: getattr(c, k) for k in _KEPT_FIELDS} == chosen), None)


@dataclasses.dataclass
class Choice:
    """The settings chosen and what was measured (batches/s per candidate)."""

    current: LoaderSettings
    settings: LoaderSettings
    rates: list[tuple[LoaderSettings, float]]
    notes: list[str]
    #: the most tensor bytes one measured batch held (None: not measured)
    batch_bytes: int | None = None

    @property
    def changed(self) -> bool:
        return self.settings != self.current

    def kept(self) -> dict[str, Any]:
        """What to keep of it for ``choose_settings(reuse=...)``: the settings chosen, the loader's
        settings they were chosen for, and the largest batch's bytes (which size a ring)."""
        return {
            "current": {k: getattr(self.current, k) for k in _KEPT_FIELDS},
            "settings": {k: getattr(self.settings, k) for k in _KEPT_FIELDS},
            "batch_bytes": self.batch_bytes,
        }

    def rate(self, settings: LoaderSettings) -> float | None:
        return next((r for s, r in self.rates if s == settings), None)

    def lines(self) -> list[str]:
        if not self.rates:  # taken from an earlier measurement (its notes say which)
            return list(self.notes)
        measured = "; ".join(f"{s.describe()}: {r:.1f}" for s, r in self.rates)
        return [
            f"loader settings measured (batches/s over a warmed-up window of host batches"
            f"{', with the pinned copy to the device' if self.settings.pin_memory else ''}): {measured}",
            *self.notes,
        ]


def choose_settings(
    loader: DataLoader,
    device: torch.device,
    *,
    vary_workers: bool = True,
    exact: bool = True,
    same_side: bool = False,
    worker_cpus: tuple[int, ...] | None = None,
    pin_memory: bool | None = None,
    workers: int | None = None,
    tolerance: float | None = None,
    cpus: int | None = None,
    measure: Callable[[LoaderSettings], float] | None = None,
    clock: Clock = time.perf_counter,
    max_s: float = 2.0,
    factors: tuple[int, ...] = (2, 4),
    reuse: dict[str, Any] | None = None,
) -> Choice:
    """Choose ``loader``'s loading settings by measuring candidates.

    Candidates: the current settings; the same pinned on CUDA (``pin_memory`` forces it either way);
    with ``vary_workers``, each count of :func:`worker_counts` (``workers`` fixes it) with
    ``prefetch_factor`` 2, then each of ``factors`` for the best count (``factors=(f,)``, ``f`` the
    loader's own factor, keeps it: see the module docstring). ``exact`` keeps ``persistent_workers`` as it is
    (and so never goes from persistent workers to none); without it persistent workers are on wherever
    there are workers (they save the workers' start at every epoch, which a window inside one epoch
    does not see). ``same_side`` keeps loading where it is: in this process, or in workers.
    ``worker_cpus``: the workers of every candidate run on those CPUs (see :func:`training_cpus`), and
    there are at most that many. Each is measured by ``measure`` (default: :func:`loader_rate` of the
    rebuilt loader on ``clock``); the cheapest (fewest workers, fewest buffered batches, unpinned) within
    ``tolerance`` (default: ``loader.tolerance`` in ``configs/defaults.yaml``) of the best allowed rate
    wins. The RNG and generator states (the process's, the loader's, and those its dataset, samplers and
    collate_fn keep of their own) are put back afterwards.

    ``reuse``: what an earlier choice chose (:meth:`Choice.kept`, kept with a cached decision). Where the
    loader's settings are those it was chosen for and its settings are among these candidates and
    allowed, they are taken without measuring (the CPUs the workers run on are this call's).
    """
    device = torch.device(device)
    if tolerance is None:
        tolerance = float(config.defaults("loader")["tolerance"])
    current = LoaderSettings.of(loader)
    pin = (device.type == "cuda") if pin_memory is None else pin_memory

    def settings(n: int, factor: int | None) -> LoaderSettings:
        return LoaderSettings(
            n,
            pin,
            (current.persistent_workers if exact else True) and n > 0,
            (factor or 2) if n > 0 else None,
            worker_cpus if n > 0 else None,
        )

    def allowed(s: LoaderSettings) -> bool:
        return (
            (workers is None or s.num_workers == workers)
            and (pin_memory is None or s.pin_memory == pin_memory)
            and (vary_workers or workers is not None or s.num_workers == current.num_workers)
        )

    def rate_of(s: LoaderSettings) -> float:
        buffered = s.num_workers * (s.prefetch_factor or 0)
        return loader_rate(
            rebuild_loader(loader, **dataclasses.asdict(s)),
            device,
            clock=clock,
            warmup=buffered + 2,
            batches=max(16, 2 * buffered),
            max_s=max_s,
            sizes=sizes,
        )

    sizes: list[int] = []

    run = measure or rate_of
    if workers is not None:
        counts = [workers]
    elif vary_workers:
        counts = worker_counts(
            current.num_workers, cpus if cpus is not None else available_cpus(), limit=len(worker_cpus) if worker_cpus else None
        )
    else:
        counts = [current.num_workers]
    if same_side:
        counts = [n for n in counts if (n > 0) == (current.num_workers > 0)] or [current.num_workers]
    if exact and current.persistent_workers and 0 in counts:
        if counts == [0]:
            raise ConfigError(
                "data.num_workers",
                "the loader has persistent workers: going to num_workers=0 would draw a "
                "new base seed every epoch and change the shuffle (exact mode)",
            )
        counts.remove(0)
    # each worker count at the loader's own prefetch factor (where the count is its own) or the default
    by_count = [current, *(settings(n, current.prefetch_factor if n == current.num_workers else None) for n in counts)]
    if reuse is not None:
        candidates = by_count + [settings(n, f) for n in counts if n > 0 for f in factors]
        taken = _taken(reuse, current, [c for c in candidates if allowed(c)])
        if taken is not None:
            note = f"{taken.describe()}: chosen by measuring in the fit that made the cached decision (not measured again)"
            return Choice(current, taken, [], [note], reuse.get("batch_bytes"))
    # the process RNGs, the loader's generators and those its dataset (read here without workers), samplers and
    # collate_fn keep of their own
    saved = RngState.capture(loader_generators(loader), owners=loader_rng_owners(loader))
    rates: dict[LoaderSettings, float] = {}
    try:
        for s in by_count:
            if s not in rates:
                rates[s] = run(s)
        best_count = max((s for s in rates if allowed(s)), key=rates.__getitem__).num_workers
        for factor in factors if best_count > 0 else ():
            s = settings(best_count, factor)
            if s not in rates:
                rates[s] = run(s)
    finally:
        saved.restore()
    eligible = [s for s in rates if allowed(s)]
    best = max(rates[s] for s in eligible)
    chosen = min((s for s in eligible if rates[s] >= best * (1 - tolerance)), key=lambda s: (s.cost, -rates[s]))
    notes = []
    if chosen.persistent_workers and not current.persistent_workers:
        notes.append(
            "persistent_workers on: the workers start once, not at every epoch (not measured: a window inside "
            "one epoch does not see it)"
        )
    return Choice(current, chosen, list(rates.items()), notes, max(sizes) if sizes else None)
