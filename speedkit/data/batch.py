"""Batches as nested containers: the one walker over them (:func:`map_batch`, :func:`batch_leaves`:
lists, tuples, named tuples, dicts and other mutable mappings, dataclasses) and what is built on it
(moving to a device, host copies, counting items and bytes, comparing two batches leaf by leaf)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


def batch_parts(batch: Any) -> tuple[list[tuple[Any, Any]], Callable[[list[Any]], Any] | None] | None:
    """The one walk over a batch's structure: a container's ``(key, child)`` pairs in order (a list's or
    tuple's by index, a named tuple's, mapping's or dataclass's by name; a dataclass's ``init`` fields)
    and how to make the same container of new children (None: a mapping that cannot be written to,
    which :func:`map_batch` leaves whole); None for a leaf."""
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return list(zip(batch._fields, batch)), lambda new: type(batch)(*new)
    if isinstance(batch, (list, tuple)):
        return list(enumerate(batch)), lambda new: type(batch)(new)
    if isinstance(batch, dict):
        return list(batch.items()), lambda new: type(batch)(zip(list(batch), new))
    if isinstance(batch, MutableMapping):  # a mapping that is no dict (transformers' BatchEncoding, a UserDict):

        def rebuild(new: list[Any]) -> Any:
            mapped = copy.copy(batch)  # a copy of it, with what else it carries (a BatchEncoding's encodings)
            for k, v in zip(list(batch), new):
                mapped[k] = v
            return mapped

        return list(batch.items()), rebuild
    if isinstance(batch, Mapping):
        return list(batch.items()), None
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        names = [f.name for f in dataclasses.fields(batch) if f.init]
        return [(n, getattr(batch, n)) for n in names], lambda new: dataclasses.replace(batch, **dict(zip(names, new)))
    return None


def map_batch(fn: Callable[[Any], Any], batch: Any) -> Any:
    """Apply ``fn`` to every leaf of a nested batch (:func:`batch_parts`: lists, tuples, named tuples,
    dicts and other mutable mappings, dataclasses), keeping its structure."""
    parts = batch_parts(batch)
    if parts is None or parts[1] is None:
        return fn(batch)
    children, rebuild = parts
    return rebuild([map_batch(fn, child) for _, child in children])


def batch_leaves(batch: Any) -> list[Any]:
    """The leaves of a nested batch, in the order :func:`map_batch` visits them."""
    leaves: list[Any] = []

    def visit(leaf: Any) -> Any:
        leaves.append(leaf)
        return leaf

    map_batch(visit, batch)
    return leaves


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Recursively move the tensors of a batch (lists, tuples, named tuples, dicts, dataclasses) to
    ``device``; other leaves are left as they are."""
    return map_batch(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, batch)


def host_copy(batch: Any) -> Any:
    """A copy of a batch whose tensors own their memory (a loader may reuse its buffers)."""
    return map_batch(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, batch)


def count_items(batch: Any, unit: str = "auto") -> tuple[int, str]:
    """Tokens or samples in a batch, read from its first leaf: integer (B, T) inputs count tokens; anything
    else (floats, uint8 images) samples."""
    first = batch
    while (parts := batch_parts(first)) is not None and parts[0]:  # the first leaf
        first = parts[0][0][1]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 1, "samples/s"
    is_tokens = not torch.is_floating_point(first) and first.dtype != torch.uint8 and first.dim() == 2
    if unit == "tokens" or (unit == "auto" and is_tokens):
        return first.numel(), "tokens/s"
    return first.shape[0], "samples/s"


def tensor_bytes(batch: Any) -> int:
    """Bytes of the tensors in a (nested) batch."""
    return sum(t.numel() * t.element_size() for t in batch_leaves(batch) if isinstance(t, torch.Tensor))


def same_batch(a: Any, b: Any) -> bool:
    """Whether two samples (or RNG states) are equal, leaf by leaf (tensors, arrays, images, nested containers)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    parts = batch_parts(a)
    if parts is not None:  # containers of one type, walked as map_batch walks them
        mine, theirs = parts[0], batch_parts(b)[0]  # type: ignore[index]
        if isinstance(a, Mapping):  # dicts, and mappings that are none (transformers' BatchEncoding)
            mine_by, theirs_by = dict(mine), dict(theirs)
            return mine_by.keys() == theirs_by.keys() and all(same_batch(mine_by[k], theirs_by[k]) for k in mine_by)
        return len(mine) == len(theirs) and all(same_batch(x, y) for (_, x), (_, y) in zip(mine, theirs))
    if hasattr(a, "__array__") and not isinstance(a, (str, bytes)):
        import numpy as np

        x, y = np.asarray(a), np.asarray(b)
        return x.shape == y.shape and x.dtype == y.dtype and bool(np.array_equal(x, y))
    try:
        return bool(a == b)
    except Exception:
        return False
