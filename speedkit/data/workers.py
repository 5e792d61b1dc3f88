"""Whether a loader's samples depend on the worker that makes them (:func:`worker_dependence`): what
decides, in exact mode, whether the worker count may change (see :mod:`speedkit.data.settings`), and,
out of it, whether only the draws a worker seeds itself would change (:attr:`WorkerDependence.worker_seeded`).

A dataset whose transforms draw from the global torch RNG (torchvision's, as its documentation writes them)
is the common case. Every DataLoader worker seeds the torch, Python and NumPy RNGs from the loader's base
seed and its id, so another worker count draws other augmentations, from the same distributions, for the
same indices in the same order, with the same labels: what users get when they change ``num_workers``
themselves."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.utils.data import IterableDataset

from speedkit.data.batch import same_batch
from speedkit.data.rng import RngState, process_rng_state, rng_object_state, seeded_process_state


@dataclasses.dataclass(frozen=True)
class WorkerDependence:
    """Why a dataset's samples may depend on the worker that makes them: ``what`` (or why that could
    not be ruled out) and, where known, ``effect``, what another worker count would do."""

    what: str
    effect: str | None = None
    #: the process RNGs reading a sample (or collating) draws from, which every worker seeds from the loader's
    #: base seed and its id ("torch", "python", "numpy"); empty where none is drawn from
    draws: tuple[str, ...] = ()
    #: whether those draws are all that depends on the worker: another worker count then draws other numbers
    #: from the same RNGs for the same samples (not so where the dataset's own generators are drawn from,
    #: which every worker copies and draws alike, for an IterableDataset, or a probe that failed)
    worker_seeded: bool = False

    def __str__(self) -> str:
        return self.what if self.effect is None else f"{self.what}: {self.effect}"


def worker_dependence(
    dataset: Any, collate_fn: Callable[[Any], Any] | None = None, *, batched: bool = True
) -> WorkerDependence | None:
    """None when changing the number of workers leaves every sample as it is; else why it would not.

    A map-style dataset's first, middle and last items are each read twice, under two different seeds
    of every RNG a worker seeds (torch, Python, NumPy); the RNG states are put back afterwards. A read that moves
    one of those RNGs draws from the worker's random state, whatever it made of the draw (a flip with
    probability 0.5 may flip under neither seed); samples that differ depend on it too. A read that
    moves a generator the dataset keeps of its own (:func:`~speedkit.data.rng.private_rngs`) does too:
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
    saved = RngState.capture(owners=(dataset, collate_fn))  # the process RNGs, and the generators of its own
    found: dict[str, tuple[list[str], bool]] = {}

    def probe(what: str, read: Callable[[], Any]) -> Any:
        results, drew = [], []
        for seed in (1, 2):
            seeded = seeded_process_state(seed)
            RngState({**saved.process, **seeded}, []).restore()  # type: ignore[dict-item]
            before = [rng_object_state(g) for g, _ in saved.generators]
            results.append(read())
            now = process_rng_state()
            drew += [name for name, state in seeded.items() if not same_batch(now.get(name), state)]
            drew += [
                f"its own {type(g).__module__.split('.')[0]}.{type(g).__name__}"
                for (g, _), state in zip(saved.generators, before)
                if not same_batch(rng_object_state(g), state)
            ]
        was = found.get(what, ([], False))
        found[what] = (was[0] + drew, was[1] or not same_batch(results[0], results[1]))
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
        saved.restore()
    for what, (drew, differs) in found.items():
        process = [name for name in dict.fromkeys(drew) if not name.startswith("its own")]
        own = [name for name in dict.fromkeys(drew) if name.startswith("its own")]
        sources = ([f"the {' and '.join(process)} RNG"] if process else []) + own
        why = (
            f"{'reading one' if what == 'samples' else 'calling it'} draws from {' and '.join(sources)}"
            if drew
            else "the same index read under two seeds differs"
            if differs and what == "samples"
            else "the same samples collated under two seeds differ"
            if differs
            else None
        )
        if why is not None:
            owner = "its samples draw" if what == "samples" else "its collate_fn draws"
            # over the samples and the collate_fn: the process RNGs alone, and nothing that differs without a draw
            every = [name for names, _ in found.values() for name in names]
            drawn = tuple(name for name in dict.fromkeys(every) if not name.startswith("its own"))
            unexplained = any(moved and not names for names, moved in found.values())
            seeded = bool(drawn) and len(drawn) == len(set(every)) and not unexplained
            return WorkerDependence(
                f"{owner} random numbers ({why})",
                "each worker seeds its own RNGs, so another worker count would draw other numbers",
                draws=drawn,
                worker_seeded=seeded,
            )
    return None


def _pure_collates() -> tuple[Any, ...]:
    from torch.utils.data import default_collate, default_convert
    from torch.utils.data._utils import collate

    return (default_collate, default_convert, collate.default_collate, collate.default_convert)


#: torch's own collate functions, which draw no random numbers
_PURE_COLLATES = _pure_collates()
