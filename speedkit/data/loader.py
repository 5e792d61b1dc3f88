"""The user's DataLoader with other loading settings, and those settings chosen by measurement.

:func:`rebuild_loader` copies a ``DataLoader`` (any subclass) keeping every object that decides
which samples come in which order (dataset, sampler, batch sampler, collate_fn, worker_init_fn,
generator, drop_last, timeout, multiprocessing context: the very same objects) and changes only
``num_workers``, ``pin_memory``, ``persistent_workers`` and ``prefetch_factor``.

Which of those keep every sample *exactly* as it was (``exact`` mode):

* ``pin_memory``: always (the same batches, the same workers in the same round-robin, the same
  draws from every generator).
* ``prefetch_factor``: the same, except with persistent workers whose samples depend on the
  worker's state (:func:`worker_dependence`). An epoch that ends before its loader does
  (``limit_train_batches``, a ``break``, ``on_train_batch_start`` returning -1) leaves the batches
  dispatched ahead (``prefetch_factor`` per worker) made and dropped; persistent workers carry what
  making them drew into every later epoch, so another factor would change later augmentations.
* ``num_workers``: only when a sample does not depend on the random state of the process that makes
  it (:func:`worker_dependence` probes the dataset, and the collate_fn, which workers run too): each
  worker seeds its RNGs from the loader's base seed and its worker id, so a dataset that augments
  with ``torch.rand`` (or a collate_fn that mixes batches) would draw other numbers for the same index
  with another worker count. An ``IterableDataset`` is replicated per
  worker, so its stream depends on the worker count: never changed.
  A sampler with a generator of its own is read to its end by workers, and may draw from it once
  more there (:func:`in_process_change_blocker`); where the fit without workers would not read it
  that far, the fit's copy reads it through :class:`StopAtLength` (the one object that is new).
* ``persistent_workers``: never turned on in exact mode. A persistent iterator does not draw a new
  base seed per epoch, which moves every later draw from the loader's generator (or the global RNG):
  the next epoch's shuffle would differ.

:func:`choose_settings` measures candidates (loader throughput over a warmed-up window of host
batches, plus the pinned copy to the device on CUDA) and picks the cheapest within a few percent of
the best. :func:`watch_fit_iterator_start` keeps the RNG and generator states at the moment a
Lightning fit creates its first train iterator, so that iterator can be made again exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from speedkit import compat
from speedkit.data.source import (
    PrivateRngStates,
    batch_leaves,
    loader_generators,
    loader_rng_owners,
    move_to_device,
    rng_object_state,
)
from speedkit.errors import ConfigError
from speedkit.snapshot import rng_state, set_rng_state

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class LoaderSettings:
    """The loading settings :func:`rebuild_loader` may change."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    #: the CPUs the workers may run on (None: wherever the process may)
    worker_cpus: tuple[int, ...] | None = None

    @classmethod
    def of(cls, loader: DataLoader) -> LoaderSettings:
        keeper = loader.worker_init_fn
        cpus = keeper.cpus if isinstance(keeper, WorkerAffinity) and loader.num_workers > 0 else None
        return cls(int(loader.num_workers), bool(loader.pin_memory), bool(loader.persistent_workers),
                   loader.prefetch_factor if loader.num_workers > 0 else None, cpus)

    @property
    def cost(self) -> tuple[int, int, bool, bool]:
        """What the settings hold (processes, buffered batches, pinned memory): lower is cheaper."""
        return (self.num_workers, self.num_workers * (self.prefetch_factor or 0), self.persistent_workers, self.pin_memory)

    def describe(self) -> str:
        parts = [f"num_workers={self.num_workers}"]
        if self.num_workers:
            parts += [f"prefetch_factor={self.prefetch_factor}", f"persistent_workers={self.persistent_workers}"]
            if self.worker_cpus is not None:
                parts.append(f"workers on CPUs {format_cpu_list(self.worker_cpus)}")
        return ", ".join([*parts, f"pin_memory={self.pin_memory}"])


def not_rebuildable(loader: Any) -> str | None:
    """None when :func:`rebuild_loader` can copy ``loader``; else why not."""
    if not isinstance(loader, DataLoader):
        return f"the train loader is a {type(loader).__name__}, not a torch DataLoader (its loading settings are its own)"
    return None


def needs_workers(loader: DataLoader) -> str | None:
    """What of ``loader``'s own settings a loader without workers refuses (a ``timeout``, a
    multiprocessing context), else None."""
    if loader.multiprocessing_context is not None:
        return "the loader names a multiprocessing context"
    if loader.timeout:
        return f"the loader sets timeout={loader.timeout}"
    return None


def rebuild_loader(loader: DataLoader, *, num_workers: int, pin_memory: bool, persistent_workers: bool,
                   prefetch_factor: int | None, worker_cpus: tuple[int, ...] | None = None,
                   stop_at_length: bool = False) -> DataLoader:
    """A copy of ``loader`` (same class, the same dataset, sampler, batch sampler, collate_fn,
    worker_init_fn, generator, drop_last, timeout and multiprocessing context objects) with these
    loading settings and no live iterator. ``worker_cpus``: each worker first keeps itself on those
    CPUs (:class:`WorkerAffinity`), then calls the loader's own ``worker_init_fn``.
    ``stop_at_length``: its batch sampler is a new ``BatchSampler`` (same batch size and drop_last)
    over the same sampler read through :class:`StopAtLength` (see :func:`needs_stop_at_length`).

    Raises:
        ConfigError: settings a DataLoader refuses (one line).
    """
    why = not_rebuildable(loader)
    if why is not None:
        raise ConfigError("data", why)
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError("data.num_workers", f"expected an integer >= 0, found {num_workers!r}")
    if num_workers == 0 and (persistent_workers or prefetch_factor is not None):
        raise ConfigError("data.num_workers", "persistent_workers and prefetch_factor need num_workers > 0")
    if num_workers > 0 and prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
        raise ConfigError("data.prefetch_factor", f"expected an integer >= 1, found {prefetch_factor!r}")
    if num_workers == 0 and (needs := needs_workers(loader)) is not None:
        raise ConfigError("data.num_workers", f"{needs}, which needs num_workers > 0")
    clone = compat.trial_loader(loader)  # a shallow copy without the live iterator
    clone.num_workers = num_workers
    clone.pin_memory = bool(pin_memory)
    clone.prefetch_factor = (2 if prefetch_factor is None else prefetch_factor) if num_workers > 0 else None
    compat.set_persistent_workers(clone, persistent_workers)
    own_init = loader.worker_init_fn.then if isinstance(loader.worker_init_fn, WorkerAffinity) else loader.worker_init_fn
    clone.worker_init_fn = WorkerAffinity(tuple(worker_cpus), own_init) if worker_cpus and num_workers > 0 else own_init
    if stop_at_length:
        from torch.utils.data import BatchSampler

        batch_sampler, sampler = loader.batch_sampler, StopAtLength(index_sampler(loader))
        if batch_sampler is None:  # no automatic batching: the loader reads the sampler itself
            compat.set_loader_samplers(clone, sampler, None)
        elif type(batch_sampler) is BatchSampler:
            compat.set_loader_samplers(clone, sampler, BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last))
        else:
            raise ValueError(f"stop_at_length needs a torch BatchSampler, found {type(batch_sampler).__name__}")
    return clone


class WorkerAffinity:
    """A DataLoader ``worker_init_fn`` that keeps its worker on ``cpus``, then calls ``then`` (the
    loader's own ``worker_init_fn``, if any) with the worker id. The CPUs a process runs on change no
    sample and no random draw."""

    def __init__(self, cpus: tuple[int, ...], then: Callable[[int], Any] | None = None) -> None:
        self.cpus, self.then = cpus, then

    def __call__(self, worker_id: int) -> None:
        try:
            os.sched_setaffinity(0, self.cpus)
        except (AttributeError, OSError, ValueError):  # not Linux, or CPUs gone: the worker runs where it may
            pass
        if self.then is not None:
            self.then(worker_id)


#: the threads a DataLoader iterator starts in the training process: one feeding each worker's index
#: queue, and the pinning thread
LOADER_THREADS = ("QueueFeederThread", "_pin_memory_loop")


def iterate_with_threads_kept(loader: Any) -> Iterator[Any]:
    """``iter(loader)``; the threads that iterator started in this process (:data:`LOADER_THREADS`)
    are moved onto the CPUs its workers were kept off (see :class:`WorkerAffinity`). Each of them
    takes the GIL for a moment per batch; on a CPU where a worker is busy it may wait for the CPU
    first, and the thread issuing the step waits for the GIL meanwhile."""
    before = {t.native_id for t in threading.enumerate()}
    it = iter(loader)
    keeper = getattr(loader, "worker_init_fn", None)
    if isinstance(keeper, WorkerAffinity) and getattr(loader, "num_workers", 0) > 0:
        keep_threads_on(allowed_cpus() - set(keeper.cpus), skip=before)
    return it


def keep_threads_on(cpus: set[int], *, skip: set[Any] = frozenset()) -> int:  # type: ignore[assignment]
    """Put this process's :data:`LOADER_THREADS` (but those in ``skip``, by native id) on ``cpus``;
    returns how many moved."""
    if not cpus:
        return 0
    moved = 0
    for thread in threading.enumerate():
        if thread.native_id is None or thread.native_id in skip or not any(n in thread.name for n in LOADER_THREADS):
            continue
        try:
            os.sched_setaffinity(thread.native_id, cpus)
            moved += 1
        except (AttributeError, OSError, ValueError):  # not Linux, or the thread ended
            pass
    return moved


# -- what a worker count changes ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerDependence:
    """Why a dataset's samples may depend on the worker that makes them: ``what`` (or why that could
    not be ruled out) and, where known, ``effect``, what another worker count would do."""

    what: str
    effect: str | None = None

    def __str__(self) -> str:
        return self.what if self.effect is None else f"{self.what}: {self.effect}"


def worker_dependence(dataset: Any, collate_fn: Callable[[Any], Any] | None = None, *,
                      batched: bool = True) -> WorkerDependence | None:
    """None when changing the number of workers leaves every sample as it is; else why it would not.

    A map-style dataset's first, middle and last items are each read twice, under two different seeds
    of every RNG a worker seeds (torch, Python, NumPy); the RNG states are put back afterwards. A read that moves
    one of those RNGs draws from the worker's random state, whatever it made of the draw (a flip with
    probability 0.5 may flip under neither seed); samples that differ depend on it too. A read that
    moves a generator the dataset keeps of its own (:func:`~speedkit.data.source.private_rngs`) does too:
    each worker draws from its own copy of it; those generators are put back afterwards as well.
    ``collate_fn`` (the loader's, unless torch's default), which workers run too, is probed the same
    way on those samples (a list of them; ``batched=False``: the first, as a loader without automatic
    batching calls it). An ``IterableDataset`` is split (or replicated) by worker: its stream is the
    worker count's.
    """
    if isinstance(dataset, IterableDataset):
        return WorkerDependence("an IterableDataset yields per worker", "its stream depends on the number of workers")
    try:
        length = len(dataset)
    except TypeError:
        return WorkerDependence("the dataset has no length to probe")
    if length < 1:
        return WorkerDependence("the dataset is empty")
    if collate_fn in _PURE_COLLATES:
        collate_fn = None
    saved, private = rng_state(), PrivateRngStates.capture(dataset, collate_fn)
    found: dict[str, tuple[list[str], bool]] = {}

    def probe(what: str, read: Callable[[], Any]) -> Any:
        results, drew = [], []
        for seed in (1, 2):
            seeded = _seeded(seed)
            set_rng_state({**saved, **seeded})
            before = [rng_object_state(g) for g, _ in private.states]
            results.append(read())
            now = rng_state()
            drew += [name for name, state in seeded.items() if not _same(now.get(name), state)]
            drew += [f"its own {type(g).__module__.split('.')[0]}.{type(g).__name__}"
                     for (g, _), state in zip(private.states, before) if not _same(rng_object_state(g), state)]
        was = found.get(what, ([], False))
        found[what] = (was[0] + drew, was[1] or not _same(results[0], results[1]))
        return results[0]

    stage = "reading a sample"
    try:
        samples = [probe("samples", lambda: dataset[index]) for index in sorted({0, length // 2, length - 1})]
        if collate_fn is not None:
            stage = "calling its collate_fn"
            probe("collate_fn", lambda: collate_fn(list(samples) if batched else samples[0]))
    except Exception as exc:  # a dataset that cannot be read here: assume the worst
        return WorkerDependence(f"{stage} to probe it raised {type(exc).__name__}")
    finally:
        set_rng_state(saved)
        private.restore()
    for what, (drew, differs) in found.items():
        process = [name for name in dict.fromkeys(drew) if not name.startswith("its own")]
        own = [name for name in dict.fromkeys(drew) if name.startswith("its own")]
        sources = ([f"the {' and '.join(process)} RNG"] if process else []) + own
        why = (f"{'reading one' if what == 'samples' else 'calling it'} draws from {' and '.join(sources)}" if drew
               else "the same index read under two seeds differs" if differs and what == "samples"
               else "the same samples collated under two seeds differ" if differs else None)
        if why is not None:
            owner = "its samples draw" if what == "samples" else "its collate_fn draws"
            return WorkerDependence(f"{owner} random numbers ({why})",
                                    "each worker seeds its own RNGs, so another worker count would draw other numbers")
    return None


def _pure_collates() -> tuple[Any, ...]:
    from torch.utils.data import default_collate, default_convert
    from torch.utils.data._utils import collate

    return (default_collate, default_convert, collate.default_collate, collate.default_convert)


#: torch's own collate functions, which draw no random numbers
_PURE_COLLATES = _pure_collates()


def in_process_change_blocker(loader: DataLoader) -> str | None:
    """None when moving ``loader`` between loading in this process (no workers) and in workers can
    leave every draw of its generators where it was; else why it would not.

    With workers, the sampler is read ahead, to its end by the epoch's last batches. Without, a fit
    that stops at the loader's length reads it to its end only when the last batch is partial
    (:func:`reads_sampler_to_its_end`). A ``RandomSampler`` with a generator draws one more (empty)
    permutation from it when it is read to its end, so the next epoch's shuffle would differ:

    * from no workers to workers, the fit's loader reads the sampler through :class:`StopAtLength`
      where the fit without workers would not read it to its end (:func:`needs_stop_at_length`);
    * from workers to none, only where the fit without workers reads it to its end too.

    Samplers known to draw only from a private generator at their start need nothing: a
    ``SequentialSampler``, a ``RandomSampler`` without a generator, and a ``DistributedSampler`` (the
    one Lightning puts in under DDP), whose shuffle is a generator seeded from its seed and epoch
    each time it is iterated.
    """
    from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return f"its batch sampler is a {type(batch_sampler).__name__}, whose draws speedkit cannot see"
    sampler = index_sampler(loader)
    if type(sampler) in (SequentialSampler, DistributedSampler) or (type(sampler) is RandomSampler and sampler.generator is None):
        return None
    if _shuffles_from_own_generator(sampler):
        if loader.num_workers == 0 or reads_sampler_to_its_end(loader):
            return None
        return ("its RandomSampler draws from a generator of its own, once more when workers read it to its end, which "
                "a fit without workers does not: the next epoch's shuffle would differ")
    if type(sampler) is RandomSampler:  # with replacement
        return ("its RandomSampler draws with replacement from a generator of its own, in chunks as it is read: "
                "workers reading ahead would draw at other moments")
    return f"its sampler is a {type(sampler).__name__}, whose draws speedkit cannot see"


def index_sampler(loader: DataLoader) -> Any:
    """The sampler whose indices ``loader`` reads: its batch sampler's, or (no automatic batching) its own."""
    return loader.batch_sampler.sampler if loader.batch_sampler is not None else loader.sampler


def _shuffles_from_own_generator(sampler: Any) -> bool:
    """A ``RandomSampler`` without replacement that draws from a generator of its own
    (``shuffle=True, generator=g``): one permutation per epoch, one more when read to its end."""
    from torch.utils.data import RandomSampler

    return type(sampler) is RandomSampler and sampler.generator is not None and not sampler.replacement


def reads_sampler_to_its_end(loader: DataLoader) -> bool:
    """Whether a loop that stops at ``len(loader)`` batches still reads the sampler to its end, as
    workers always do: when the last batch is partial (``drop_last=False`` and the batch size does
    not divide the sampler's length), the batch sampler asks for indices until there are none."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        return False
    return not loader.drop_last and len(batch_sampler.sampler) % loader.batch_size != 0


def needs_stop_at_length(loader: DataLoader, num_workers: int) -> bool:
    """Whether a fit of ``loader`` (no workers) moved to ``num_workers`` workers must read its sampler
    through :class:`StopAtLength` to draw what it draws now: a sampler with a generator of its own,
    which the fit without workers never reads to its end."""
    if loader.num_workers != 0 or num_workers == 0 or reads_sampler_to_its_end(loader):
        return False
    return _shuffles_from_own_generator(index_sampler(loader))


class StopAtLength(Sampler):
    """``sampler``'s indices, ``len(sampler)`` of them, without asking it for another: a sampler read
    to its end may draw from its generator once more (``RandomSampler`` does), which workers reading
    ahead would do and a fit without workers, stopping at the loader's length, does not. Every other
    attribute (``generator``, ``set_epoch``) is the sampler's own."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), len(self.sampler))

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)


def _seeded(seed: int) -> dict[str, Any]:
    import random

    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {"torch": gen.get_state(), "python": random.Random(seed).getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.RandomState(seed).get_state()
    except ImportError:
        pass
    return state


def _same(a: Any, b: Any) -> bool:
    """Whether two samples (or RNG states) are equal, leaf by leaf (tensors, arrays, images, nested containers)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, Mapping):  # dicts, and mappings that are none (transformers' BatchEncoding)
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if hasattr(a, "__array__") and not isinstance(a, (str, bytes)):
        import numpy as np

        x, y = np.asarray(a), np.asarray(b)
        return x.shape == y.shape and x.dtype == y.dtype and bool(np.array_equal(x, y))
    try:
        return bool(a == b)
    except Exception:
        return False


# -- RNG and generator states ---------------------------------------------------------------------


@dataclasses.dataclass
class RngStates:
    """The process RNGs' states and those of the given generators, at one moment."""

    rng: dict[str, Any]
    generators: list[tuple[torch.Generator, torch.Tensor]]

    @classmethod
    def capture(cls, generators: Iterable[torch.Generator]) -> RngStates:
        return cls(rng_state(), [(g, g.get_state()) for g in generators])

    def restore(self) -> None:
        set_rng_state(self.rng)
        for g, state in self.generators:
            g.set_state(state)

    def same_as(self, other: RngStates) -> bool:
        if [id(g) for g, _ in self.generators] != [id(g) for g, _ in other.generators]:
            return False
        if not all(torch.equal(a, b) for (_, a), (_, b) in zip(self.generators, other.generators)):
            return False
        return all(_same(self.rng.get(k), other.rng.get(k)) for k in ("torch", "cuda", "python", "numpy"))


@dataclasses.dataclass
class IteratorStart:
    """The RNG and generator states right before and right after a fit created its first train iterator."""

    loaders: list[Any]
    before: RngStates
    after: RngStates | None = None


_FIT_STARTS: weakref.WeakKeyDictionary[Any, IteratorStart] = weakref.WeakKeyDictionary()


def watch_fit_iterator_start(trainer: Any) -> Callable[[], None]:
    """Record, for :func:`fit_iterator_start`, the states around the creation of ``trainer``'s first
    train iterator (Lightning makes it in ``setup_data``, before ``on_train_start``). Call from
    ``on_fit_start``; the returned function removes the watch (by ``on_train_start``)."""
    _FIT_STARTS.pop(trainer, None)

    def before(loaders: list[Any]) -> None:
        _FIT_STARTS[trainer] = IteratorStart(loaders, RngStates.capture(loader_generators(loaders)))

    def after(loaders: list[Any]) -> None:
        start = _FIT_STARTS.get(trainer)
        if start is not None and start.after is None:
            start.after = RngStates.capture(loader_generators(start.loaders))

    remove = compat.watch_train_iterator_start(trainer, before, after)
    return remove if remove is not None else (lambda: None)


def fit_iterator_start(trainer: Any) -> IteratorStart | None:
    """The states recorded by :func:`watch_fit_iterator_start` for ``trainer``'s fit, if any."""
    return _FIT_STARTS.get(trainer)


# -- choosing the settings ----------------------------------------------------------------------


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """How many CPUs this process may run on."""
    return len(allowed_cpus())


def parse_cpu_list(text: str) -> set[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """CPU numbers as a Linux CPU list: runs of consecutive numbers as "a-b"."""
    ordered, runs = sorted(set(cpus)), []
    for _, run in itertools.groupby(enumerate(ordered), lambda iv: iv[1] - iv[0]):
        values = [v for _, v in run]
        runs.append(f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0]))
    return ",".join(runs)


def core_siblings(cpu: int) -> set[int]:
    """The CPUs sharing ``cpu``'s physical core (its hyperthreads, itself included), from sysfs."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return parse_cpu_list(f.read()) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def current_cpu() -> int | None:
    """The CPU the calling thread last ran on (Linux), else None."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def physical_cores(cpus: set[int], siblings: Callable[[int], set[int]] = core_siblings) -> list[set[int]]:
    """``cpus`` grouped by physical core (each CPU with its hyperthread siblings among ``cpus``), in
    order of each core's lowest CPU number."""
    cores, seen = [], set()
    for cpu in sorted(cpus):
        if cpu not in seen:
            core = (siblings(cpu) & cpus) | {cpu}
            seen |= core
            cores.append(core)
    return cores


def host_share(cpus: set[int], rank: int, processes: int,
               siblings: Callable[[int], set[int]] = core_siblings) -> set[int]:
    """Process ``rank``'s share of ``cpus`` when ``processes`` training processes (DDP ranks on one
    machine) run on them: the physical cores, in order, cut into ``processes`` runs as even as can be
    (hyperthreads of one core never split). With fewer cores than processes, each has all of them."""
    if processes <= 1:
        return set(cpus)
    cores = physical_cores(cpus, siblings)
    if len(cores) < processes or not 0 <= rank < processes:
        return set(cpus)
    per, extra = divmod(len(cores), processes)
    start = rank * per + min(rank, extra)
    return set().union(*cores[start:start + per + (1 if rank < extra else 0)])


def machine_cpus() -> set[int] | None:
    """The CPUs every process here may use unless a launcher narrowed its own: the container's cpuset
    (cgroup v2, then v1), else the CPUs online; None where none of them can be read."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",
                 "/sys/devices/system/cpu/online"):
        try:
            with open(path) as f:
                cpus = parse_cpu_list(f.read())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return None


def training_cpus(cores: int = 2, *, allowed: set[int] | None = None, here: int | None = None,
                  siblings: Callable[[int], set[int]] = core_siblings, processes: tuple[int, int] = (0, 1),
                  machine: set[int] | None = None) -> tuple[set[int], set[int]]:
    """Split the CPUs this process may use into those left to the training process and those for
    loader workers. The training process keeps ``cores`` physical cores, each with its hyperthread
    siblings: the one its calling thread runs on (``here``), then the lowest-numbered others. A worker
    on the sibling of the thread that issues the step slows that thread (they share one core), and on
    a GPU the step waits for it. Where fewer than two CPUs would be left to workers, none is kept.

    ``processes``: (this one's index, how many) training processes share the machine (DDP ranks). Where
    the CPUs this process may use are all of ``machine``'s (default :func:`machine_cpus`: nobody gave
    each rank its own), it takes only its :func:`host_share`, so that no rank's workers run on the
    cores another rank keeps. A process a launcher already pinned to fewer CPUs splits those as they are."""
    allowed = allowed_cpus() if allowed is None else set(allowed)
    rank, count = processes
    if count > 1:
        machine = machine_cpus() if machine is None else machine
        if machine is None or allowed >= machine:
            allowed = host_share(allowed, rank, count, siblings)
    here = current_cpu() if here is None else here
    order = ([here] if here in allowed else []) + sorted(allowed)
    kept: set[int] = set()
    taken = 0
    for cpu in order:
        if taken == cores:
            break
        if cpu in kept:
            continue
        kept |= siblings(cpu) & allowed
        taken += 1
    rest = allowed - kept
    if len(rest) < 2:
        return set(), allowed
    return kept, rest


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


def tensor_bytes(batch: Any) -> int:
    """Bytes of the tensors in a (nested) batch."""
    return sum(t.numel() * t.element_size() for t in batch_leaves(batch) if isinstance(t, torch.Tensor))


def loader_rate(loader: Iterable[Any], device: torch.device, *, clock: Clock = time.perf_counter, warmup: int = 2,
                batches: int = 16, max_s: float = 2.0, sizes: list[int] | None = None) -> float:
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

    def rate(self, settings: LoaderSettings) -> float | None:
        return next((r for s, r in self.rates if s == settings), None)

    def lines(self) -> list[str]:
        measured = "; ".join(f"{s.describe()}: {r:.1f}" for s, r in self.rates)
        return [f"loader settings measured (batches/s over a warmed-up window of host batches"
                f"{', with the pinned copy to the device' if self.settings.pin_memory else ''}): {measured}", *self.notes]


def choose_settings(loader: DataLoader, device: torch.device, *, vary_workers: bool = True, exact: bool = True,
                    same_side: bool = False, worker_cpus: tuple[int, ...] | None = None,
                    pin_memory: bool | None = None, workers: int | None = None, tolerance: float = 0.03,
                    cpus: int | None = None, measure: Callable[[LoaderSettings], float] | None = None,
                    clock: Clock = time.perf_counter, max_s: float = 2.0, factors: tuple[int, ...] = (2, 4)) -> Choice:
    """Choose ``loader``'s loading settings by measuring candidates.

    Candidates: the current settings; the same pinned on CUDA (``pin_memory`` forces it either way);
    with ``vary_workers``, each count of :func:`worker_counts` (``workers`` fixes it) with
    ``prefetch_factor`` 2, then each of ``factors`` for the best count (``factors=(f,)``, ``f`` the
    loader's own factor, keeps it: see the module docstring). ``exact`` keeps ``persistent_workers`` as it is
    (and so never goes from persistent workers to none); without it persistent workers are on wherever
    there are workers (they save the workers' start at every epoch, which a window inside one epoch
    does not see). ``same_side`` keeps loading where it is: in this process, or in workers.
    ``worker_cpus``: the workers of every candidate run on those CPUs (see :func:`training_cpus`), and
    there are at most that many. Each is measured by ``measure`` (default: :func:`loader_rate` of the rebuilt
    loader on ``clock``); the cheapest (fewest workers, fewest buffered batches, unpinned) within
    ``tolerance`` of the best allowed rate wins. The RNG and generator states (the process's, the loader's, and
    those its dataset, samplers and collate_fn keep of their own) are put back afterwards.
    """
    device = torch.device(device)
    current = LoaderSettings.of(loader)
    pin = (device.type == "cuda") if pin_memory is None else pin_memory

    def settings(n: int, factor: int | None) -> LoaderSettings:
        return LoaderSettings(n, pin, (current.persistent_workers if exact else True) and n > 0,
                              (factor or 2) if n > 0 else None, worker_cpus if n > 0 else None)

    def allowed(s: LoaderSettings) -> bool:
        return (workers is None or s.num_workers == workers) and (pin_memory is None or s.pin_memory == pin_memory) \
            and (vary_workers or workers is not None or s.num_workers == current.num_workers)

    def rate_of(s: LoaderSettings) -> float:
        buffered = s.num_workers * (s.prefetch_factor or 0)
        return loader_rate(rebuild_loader(loader, **dataclasses.asdict(s)), device, clock=clock, warmup=buffered + 2,
                           batches=max(16, 2 * buffered), max_s=max_s, sizes=sizes)

    sizes: list[int] = []

    run = measure or rate_of
    if workers is not None:
        counts = [workers]
    elif vary_workers:
        counts = worker_counts(current.num_workers, cpus if cpus is not None else available_cpus(),
                               limit=len(worker_cpus) if worker_cpus else None)
    else:
        counts = [current.num_workers]
    if same_side:
        counts = [n for n in counts if (n > 0) == (current.num_workers > 0)] or [current.num_workers]
    if exact and current.persistent_workers and 0 in counts:
        if counts == [0]:
            raise ConfigError("data.num_workers", "the loader has persistent workers: going to num_workers=0 would draw a "
                              "new base seed every epoch and change the shuffle (exact mode)")
        counts.remove(0)
    saved = RngStates.capture(loader_generators(loader))
    private = PrivateRngStates.capture(*loader_rng_owners(loader))  # a dataset's own generator, read here without workers
    rates: dict[LoaderSettings, float] = {}
    try:
        for s in [current, *(settings(n, current.prefetch_factor if n == current.num_workers else None) for n in counts)]:
            if s not in rates:
                rates[s] = run(s)
        best_count = max((s for s in rates if allowed(s)), key=rates.__getitem__).num_workers
        for factor in factors if best_count > 0 else ():
            s = settings(best_count, factor)
            if s not in rates:
                rates[s] = run(s)
    finally:
        saved.restore()
        private.restore()
    eligible = [s for s in rates if allowed(s)]
    best = max(rates[s] for s in eligible)
    chosen = min((s for s in eligible if rates[s] >= best * (1 - tolerance)), key=lambda s: (s.cost, -rates[s]))
    notes = []
    if chosen.persistent_workers and not current.persistent_workers:
        notes.append("persistent_workers on: the workers start once, not at every epoch (not measured: a window inside "
                     "one epoch does not see it)")
    return Choice(current, chosen, list(rates.items()), notes, max(sizes) if sizes else None)


__all__ = ["Choice", "IteratorStart", "LoaderSettings", "RngStates", "WorkerAffinity", "allowed_cpus", "available_cpus",
           "choose_settings", "core_siblings", "current_cpu", "format_cpu_list", "host_share", "machine_cpus", "parse_cpu_list",
           "physical_cores", "training_cpus",
           "fit_iterator_start", "in_process_change_blocker", "needs_workers", "index_sampler", "iterate_with_threads_kept", "keep_threads_on", "loader_rate", "needs_stop_at_length", "not_rebuildable",
           "reads_sampler_to_its_end", "rebuild_loader", "StopAtLength", "tensor_bytes", "watch_fit_iterator_start",
           "WorkerDependence", "worker_counts", "worker_dependence"]

