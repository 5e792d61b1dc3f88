"""The user's DataLoader with other loading settings: :class:`LoaderSettings`, :func:`rebuild_loader`,
and which settings a loader may change without changing a sample (exact mode).

:func:`rebuild_loader` copies a ``DataLoader`` (any subclass) keeping every object that decides
which samples come in which order (dataset, sampler, batch sampler, collate_fn, worker_init_fn,
generator, drop_last, timeout, multiprocessing context: the very same objects) and changes only
``num_workers``, ``pin_memory``, ``persistent_workers`` and ``prefetch_factor``.

Which of those keep every sample *exactly* as it was (``exact`` mode):

* ``pin_memory``: always (the same batches, the same workers in the same round-robin, the same
  draws from every generator).
* ``prefetch_factor``: the same, except with persistent workers whose samples depend on the
  worker's state (:func:`~speedkit.data.workers.worker_dependence`). An epoch that ends before its loader does
  (``limit_train_batches``, a ``break``, ``on_train_batch_start`` returning -1) leaves the batches
  dispatched ahead (``prefetch_factor`` per worker) made and dropped; persistent workers carry what
  making them drew into every later epoch, so another factor would change later augmentations.
* ``num_workers``: only when a sample does not depend on the random state of the process that makes
  it (:func:`~speedkit.data.workers.worker_dependence` probes the dataset, and the collate_fn, which workers run too): each
  worker seeds its RNGs from the loader's base seed and its worker id, so a dataset that augments
  with ``torch.rand`` (or a collate_fn that mixes batches) would draw other numbers for the same index
  with another worker count. An ``IterableDataset`` is replicated per
  worker, so its stream depends on the worker count: never changed.
  A sampler with a generator of its own is read to its end by workers, and may draw from it once
  more there (:func:`in_process_change_blocker`); where the fit without workers would not read it
  that far, the fit's copy reads it through :class:`StopAtLength` (the one object that is new).
* ``persistent_workers``: never turned on (by data_path, in either mode). A persistent iterator does not draw a new
  base seed per epoch, which moves every later draw from the loader's generator (or the global RNG):
  the next epoch's shuffle would differ.

Which settings are chosen is :mod:`speedkit.data.choose`'s; whether a sample depends on its worker,
:mod:`speedkit.data.workers`'.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Sampler

from speedkit import compat
from speedkit.data.topology import WorkerAffinity, format_cpu_list
from speedkit.errors import ConfigError


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
        return cls(
            int(loader.num_workers),
            bool(loader.pin_memory),
            bool(loader.persistent_workers),
            loader.prefetch_factor if loader.num_workers > 0 else None,
            cpus,
        )

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


def rebuild_loader(
    loader: DataLoader,
    *,
    num_workers: int,
    pin_memory: bool,
    persistent_workers: bool,
    prefetch_factor: int | None,
    worker_cpus: tuple[int, ...] | None = None,
    stop_at_length: bool = False,
) -> DataLoader:
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
        return (
            "its RandomSampler draws from a generator of its own, once more when workers read it to its end, which "
            "a fit without workers does not: the next epoch's shuffle would differ"
        )
    if type(sampler) is RandomSampler:  # with replacement
        return (
            "its RandomSampler draws with replacement from a generator of its own, in chunks as it is read: "
            "workers reading ahead would draw at other moments"
        )
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
