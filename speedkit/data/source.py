"""Where training batches come from: the ``BatchSource`` seam.

A source gives the engine

* a **fresh iterator per trial** of batches already on the device (:meth:`BatchSource.iterator`),
  restarting the loader at the end of an epoch, so every measurement sees the loader as training
  would: its workers, its collation, its transfer;
* **parity batches kept on the host** (:meth:`BatchSource.parity_batches`), copied once, moved to
  the device when a trial uses them, so they hold no device memory while other rungs are timed;
* the **state iteration consumes** (the loader's and sampler's own generators, and those its
  dataset, samplers and collate_fn keep in their attributes) so a snapshot can put the data order
  and the samples back exactly after trials.

:class:`BatchSource` itself serves any iterable of batches (``speedkit.apply``); the Lightning source
(:class:`speedkit.lightning.source.LightningSource`) serves the Trainer's own train dataloader
through Lightning's transfer hooks. A data-path rung wraps ``state.data`` the way step rungs wrap
``state.step``: it returns another source around this one (pinned, prefetched, static buffers).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from speedkit import compat
from speedkit.errors import ConfigError
from speedkit.handle import Handle


def map_batch(fn: Callable[[Any], Any], batch: Any) -> Any:
    """Apply ``fn`` to every leaf of a nested batch (lists, tuples, named tuples, dicts and other
    mutable mappings, dataclasses), keeping its structure."""
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(map_batch(fn, b) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_batch(fn, b) for b in batch)
    if isinstance(batch, dict):
        return type(batch)((k, map_batch(fn, v)) for k, v in batch.items())
    if isinstance(batch, MutableMapping):  # a mapping that is no dict (transformers' BatchEncoding, a UserDict):
        mapped = copy.copy(batch)  # a copy of it, with what else it carries (a BatchEncoding's encodings)
        for k, v in batch.items():
            mapped[k] = map_batch(fn, v)
        return mapped
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: map_batch(fn, getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
    return fn(batch)


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
    """Tokens or samples in a batch: integer (B, T) inputs count tokens; anything else (floats, uint8
    images) samples."""
    first = batch
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(first, Mapping) and first:
        first = next(iter(first.values()))
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 1, "samples/s"
    is_tokens = not torch.is_floating_point(first) and first.dtype != torch.uint8 and first.dim() == 2
    if unit == "tokens" or (unit == "auto" and is_tokens):
        return first.numel(), "tokens/s"
    return first.shape[0], "samples/s"


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators that iterating ``loader`` advances: its own, its sampler's, its batch sampler's;
    for several loaders (a list, tuple or dict, as Lightning combines them), each one's."""
    if isinstance(loader, dict):
        loader = list(loader.values())
    owners: list[Any] = []
    for one in loader if isinstance(loader, (list, tuple)) else [loader]:
        owners += [one, getattr(one, "sampler", None), getattr(one, "batch_sampler", None),
                   getattr(getattr(one, "batch_sampler", None), "sampler", None)]
    found: list[torch.Generator] = []
    for owner in owners:
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def rng_object_state(obj: Any) -> Any:
    """The state of a random generator object (a ``torch.Generator``, NumPy ``Generator`` or
    ``RandomState``, Python ``random.Random``); None when ``obj`` is none of those."""
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if isinstance(obj, random.Random):
        return obj.getstate()
    kind = type(obj).__module__ or ""
    if kind.startswith("numpy.random"):
        if hasattr(obj, "bit_generator"):  # numpy.random.Generator
            return obj.bit_generator.state
        if hasattr(obj, "get_state"):  # numpy.random.RandomState
            return obj.get_state()
    return None


def set_rng_object_state(obj: Any, state: Any) -> None:
    """Put a generator found by :func:`private_rngs` back to ``state`` (from :func:`rng_object_state`)."""
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, random.Random):
        obj.setstate(state)
    elif hasattr(obj, "bit_generator"):
        obj.bit_generator.state = state
    else:
        obj.set_state(state)


def private_rngs(*roots: Any, depth: int = 4, visit_limit: int = 512, width: int = 64) -> list[Any]:
    """The random generator objects a dataset, sampler or collate_fn keeps of its own (in attributes,
    small lists, tuples and dicts, ``functools.partial`` arguments, closures and bound methods, up to
    ``depth`` levels down): reading samples draws from them, and the process RNGs' states
    (:func:`speedkit.snapshot.rng_state`) do not hold them. Large containers (over ``width`` items)
    and modules are not searched."""
    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> None:
        if id(obj) in seen or len(seen) >= visit_limit:
            return
        seen.add(id(obj))
        if rng_object_state(obj) is not None:
            found.append(obj)
            return
        if level >= depth or obj is None or isinstance(obj, (str, bytes, int, float, complex, torch.Tensor, type,
                                                             types.ModuleType, types.BuiltinFunctionType)):
            return
        children: Iterable[Any]
        if isinstance(obj, dict):
            children = obj.values() if len(obj) <= width else ()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj if len(obj) <= width else ()
        elif isinstance(obj, functools.partial):
            children = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, types.MethodType):
            children = [obj.__self__, obj.__func__]
        elif isinstance(obj, types.FunctionType):
            children = [cell.cell_contents for cell in obj.__closure__ or () if _cell_filled(cell)]
        else:
            try:
                attributes = vars(obj)
            except Exception:  # no __dict__ (slots, builtins), or a proxy that refuses it
                attributes = None
            children = attributes.values() if isinstance(attributes, dict) and len(attributes) <= width else ()
        for child in list(children):
            visit(child, level + 1)

    for root in roots:
        visit(root, 0)
    return found


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def loader_rng_owners(loader: Any) -> list[Any]:
    """What iterating ``loader`` may draw from besides the process RNGs and the generators of
    :func:`loader_generators`: its dataset, sampler, batch sampler and collate_fn (each one's for
    several loaders), where :func:`private_rngs` looks."""
    if isinstance(loader, dict):
        loader = list(loader.values())
    owners: list[Any] = []
    for one in loader if isinstance(loader, (list, tuple)) else [loader]:
        owners += [getattr(one, name, None) for name in ("dataset", "sampler", "batch_sampler", "collate_fn")]
    return [o for o in owners if o is not None]


@dataclasses.dataclass
class PrivateRngStates:
    """The states of the generators :func:`private_rngs` finds in ``roots``, at one moment."""

    states: list[tuple[Any, Any]]

    @classmethod
    def capture(cls, *roots: Any) -> PrivateRngStates:
        return cls([(g, rng_object_state(g)) for g in private_rngs(*roots)])

    def restore(self) -> None:
        for g, state in self.states:
            set_rng_object_state(g, state)


def chain_epochs(make_epoch: Callable[[], Iterator[Any]], epochs: int | None = None) -> Iterator[Any]:
    """Batches epoch after epoch (``epochs`` of them, or without end for None), each epoch's iterator
    made by ``make_epoch()`` when its first batch is asked for (not before the last batch of the
    epoch before is handed out); an epoch without a batch is a one-line error rather than an endless
    loop."""
    done = 0
    while epochs is None or done < epochs:
        done += 1
        empty = True
        for batch in make_epoch():
            empty = False
            yield batch
        if empty:
            raise ConfigError("data", "the train loader yielded no batch; check the dataset length and batch size")


class BatchSource:
    """Batches for the training step: host batches from ``loader``, moved by :meth:`to_device`.

    Subclasses override :meth:`to_device` (how a host batch reaches the device) or :meth:`epoch`
    (where one epoch of host batches comes from). Args:
        loader: any iterable of batches (a DataLoader, a list).
        device: where the step runs.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device) -> None:
        self.loader = loader
        self.device = torch.device(device)
        #: what the trials iterate: the loader, or a copy of it that leaves its live iterator alone
        self.iterable = compat.trial_loader(loader)

    def epoch(self) -> Iterator[Any]:
        """One epoch of host batches: a fresh iterator of the loader, made when this is called."""
        return iter(self.iterable)

    def host_batches(self, epochs: int | None = None) -> Iterator[Any]:
        """Host batches for ``epochs`` epochs, or forever (None): the loader is iterated again (a new
        epoch) when it runs out."""
        return chain_epochs(self.epoch, epochs)

    def to_device(self, batch: Any) -> Any:
        return move_to_device(batch, self.device, non_blocking=True)

    def iterator(self, epochs: int | None = None) -> Iterator[Any]:
        """A fresh iterator of device batches (one per trial): ``epochs`` epochs of the loader, or
        epoch after epoch without end (None)."""
        return (self.to_device(b) for b in self.host_batches(epochs))

    def parity_batches(self, n: int) -> list[Any]:
        """``n`` batches from a fresh iterator, copied and kept on the host."""
        it = self.host_batches()
        return [host_copy(next(it)) for _ in range(n)]

    # -- what iterating changes ------------------------------------------------------------------
    def generators(self) -> list[torch.Generator]:
        """The generators that iterating the loader advances (its own, its sampler's)."""
        return loader_generators(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The loader's generators' states, and those of the generators its dataset, samplers and
        collate_fn keep of their own (:func:`private_rngs`): the trials read samples from them too."""
        return {"generators": [g.get_state() for g in self.generators()],
                "private": PrivateRngStates.capture(*loader_rng_owners(self.loader))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for g, s in zip(self.generators(), state.get("generators", [])):
            g.set_state(s)
        private = state.get("private")
        if private is not None:
            private.restore()

    def release(self) -> None:
        """After the trials: stop the workers the trials' copy of a persistent-workers loader started."""
        compat.shutdown_workers(self.iterable)

    def bind_fit(self, trainer: Any, module: Any) -> Handle | None:
        """Make this source's change take effect in a Lightning ``fit`` that iterates its own loader
        (after the trials, a kept source wrapper is bound here); None when there is nothing to bind.
        The returned handle undoes the binding."""
        return None


class SourceWrapper(BatchSource):
    """A source around another one (what rungs wrap ``state.data`` with, as ``StepWrapper`` is for
    steps): everything is the inner source's; subclasses override what they change. The inner
    source owns the loader, so no ``BatchSource.__init__``.

    A wrapper that only changes each device batch of the inner source sets ``maps_batches`` and
    defines :meth:`map_batch`: an engine comparing it with the inner source then maps the inner
    source's iterator instead of asking it for a second one (a source may serve one live iterator at
    a time: data_path's ring of pinned memory)."""

    #: whether this wrapper only maps each device batch of the inner source (:meth:`map_batch`)
    maps_batches: bool = False

    def __init__(self, inner: BatchSource) -> None:
        self.inner = inner
        self.loader, self.device, self.iterable = inner.loader, inner.device, inner.iterable

    def epoch(self) -> Iterator[Any]:
        return self.inner.epoch()

    def to_device(self, batch: Any) -> Any:
        return self.map_batch(self.inner.to_device(batch))

    def iterator(self, epochs: int | None = None) -> Iterator[Any]:
        inner = self.inner.iterator(epochs)
        return (self.map_batch(b) for b in inner) if self.maps_batches else inner

    def map_batch(self, batch: Any) -> Any:
        """One device batch of the inner source as this wrapper serves it (as it is, by default)."""
        return batch

    def parity_batches(self, n: int) -> list[Any]:
        return self.inner.parity_batches(n)

    def generators(self) -> list[torch.Generator]:
        return self.inner.generators()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def release(self) -> None:
        self.inner.release()

    def bind_fit(self, trainer: Any, module: Any) -> Handle | None:
        return self.inner.bind_fit(trainer, module)
