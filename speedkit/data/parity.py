"""What another worker count must leave as it was where it changes the samples' random draws
(:func:`compare_loaders`): the sample indices in their order, the labels, every leaf's shape and dtype.

Each DataLoader worker seeds the process RNGs from the loader's base seed and its id, so a dataset whose
transforms draw from them (torchvision's, as users write them) draws other augmentations with another
worker count; no loss trajectory can match then, and the ladder's, on batches drawn once, never reads
the loader's. What must hold is read from the loaders themselves instead: both, from the same RNG and
generator states, give their first batches; the indices each one's sampler handed out per batch, and the
leaves of each batch (:func:`batch_leaves`) are compared. Exactly: integer and boolean tensors (labels,
token ids, masks) and leaves that are no tensor; by shape and dtype alone: floating-point and uint8
tensors, the augmented pixels, whose values are what may change (:attr:`BatchParity.not_compared`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from speedkit import compat
from speedkit.data.batch import batch_parts, same_batch
from speedkit.data.rng import RngState, loader_generators, loader_rng_owners
from speedkit.data.settings import LoaderSettings, rebuild_loader


@dataclasses.dataclass(frozen=True)
class BatchParity:
    """Two loaders' first ``batches`` batches compared: what was (``compared``), what was not
    (``not_compared``: the leaves whose values may differ), and the first difference found (None: none)."""

    batches: int
    compared: tuple[str, ...]
    not_compared: tuple[str, ...]
    difference: str | None = None

    @property
    def passed(self) -> bool:
        return self.difference is None

    @property
    def failure(self) -> str | None:
        """The reason a rung fails on it, or None where it passed."""
        if self.difference is None:
            return None
        return f"the batches differ where another worker count must leave them as they were: {self.difference}"

    def lines(self) -> list[str]:
        """What the report says of it: what was compared over how many batches, and what was not."""
        verdict = "the same" if self.passed else f"NOT the same ({self.difference})"
        lines = [
            f"the batches' parity (the samples' augmentations draw other numbers, so no loss trajectory can "
            f"match): over the first {self.batches} batches from the same RNG state, {verdict}: {', '.join(self.compared)}"
        ]
        if self.not_compared:
            lines.append(
                f"not compared: the values of {', '.join(self.not_compared)} (the augmented samples; only their "
                "shapes and dtypes)"
            )
        return lines


class _RecordedSampler(Sampler):
    """``sampler``'s items (index lists of a batch sampler, or indices), each also appended to ``given``."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.given = sampler, []

    def __iter__(self) -> Iterator[Any]:
        for item in self.sampler:
            self.given.append(list(item) if isinstance(item, (list, tuple)) else item)
            yield item

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)


def _exact(leaf: Any) -> bool:
    """Whether a leaf's values are compared: integer and boolean tensors (labels, token ids, masks) and any
    leaf that is no tensor; not floating-point or uint8 tensors (pixels: what augmentations draw for)."""
    if not isinstance(leaf, torch.Tensor):
        return True
    return not (leaf.is_floating_point() or leaf.is_complex() or leaf.dtype == torch.uint8)


def leaves_with_paths(batch: Any, path: str = "batch") -> list[tuple[str, Any]]:
    """The leaves of a nested batch with where each sits (``batch[0]``, ``batch['labels']``), in the order
    :func:`~speedkit.data.batch.batch_leaves` visits them."""
    parts = batch_parts(batch)
    if parts is None or parts[1] is None:
        return [(path, batch)]
    return [leaf for key, child in parts[0] for leaf in leaves_with_paths(child, f"{path}[{key!r}]")]


def read_with_indices(loader: DataLoader, batches: int) -> list[tuple[Any, Any]]:
    """The first ``batches`` batches of a copy of ``loader`` (its settings, no live iterator: the user's
    iterator is left alone), each with the indices its sampler handed out for it; its workers stopped after."""
    clone = rebuild_loader(loader, **dataclasses.asdict(LoaderSettings.of(loader)))
    if clone.batch_sampler is not None:
        recorded = _RecordedSampler(clone.batch_sampler)
        compat.set_loader_samplers(clone, clone.sampler, recorded)
    else:  # no automatic batching: each index is a batch
        recorded = _RecordedSampler(clone.sampler)
        compat.set_loader_samplers(clone, recorded, None)
    it = iter(clone)
    try:
        read = []
        for _, batch in zip(range(batches), it):
            read.append(batch)
    finally:
        compat.shutdown_iterator(it)
        compat.shutdown_workers(clone)
    return list(zip(recorded.given, read))  # workers hand batches back in the order their indices were given


def compare_loaders(reference: DataLoader, candidate: DataLoader, batches: int) -> BatchParity:
    """``candidate`` (another worker count of ``reference``'s copy) against ``reference``: the first
    ``batches`` batches of each, read from the same RNG and generator states (the process RNGs, the
    loaders' generators, those the dataset, samplers and collate_fn keep; put back afterwards), compared
    by the sample indices of each batch, the values of every leaf :func:`_exact` keeps, and every leaf's
    type, shape and dtype."""
    saved = RngState.capture(loader_generators([reference, candidate]), owners=loader_rng_owners([reference, candidate]))
    read = []
    try:
        for loader in (reference, candidate):
            saved.restore()
            read.append(read_with_indices(loader, batches))
    finally:
        saved.restore()
    want, got = read
    exact_paths: dict[str, None] = {}
    loose_paths: dict[str, None] = {}
    difference = None if len(got) == len(want) else f"{len(got)} batches against {len(want)}"
    for k, ((indices, batch), (want_indices, want_batch)) in enumerate(zip(got, want)):
        if difference is not None:
            break
        if indices != want_indices:
            difference = f"batch {k}: sample indices {_short(indices)} against {_short(want_indices)}"
            break
        leaves, want_leaves = leaves_with_paths(batch), leaves_with_paths(want_batch)
        if [p for p, _ in leaves] != [p for p, _ in want_leaves]:
            difference = f"batch {k}: its structure {[p for p, _ in leaves]} against {[p for p, _ in want_leaves]}"
            break
        for (path, leaf), (_, want_leaf) in zip(leaves, want_leaves):
            (exact_paths if _exact(want_leaf) else loose_paths)[path] = None
            if type(leaf) is not type(want_leaf):
                difference = f"batch {k}: {path} is a {type(leaf).__name__} against a {type(want_leaf).__name__}"
            elif isinstance(leaf, torch.Tensor) and (leaf.shape, leaf.dtype) != (want_leaf.shape, want_leaf.dtype):
                difference = (
                    f"batch {k}: {path} is {leaf.dtype} {tuple(leaf.shape)} against {want_leaf.dtype} {tuple(want_leaf.shape)}"
                )
            elif _exact(want_leaf) and not same_batch(leaf, want_leaf):
                difference = f"batch {k}: the values of {path} differ"
            if difference is not None:
                break
    compared = (
        "the sample indices of each batch, in order",
        *(f"the values of {p}" for p in exact_paths),
        "every leaf's shape and dtype",
    )
    return BatchParity(len(want), compared, tuple(loose_paths), difference)


def _short(indices: Any) -> str:
    text = str(indices)
    return text if len(text) <= 60 else text[:57] + "..."
