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
(:class:`speedkit.lightning.step.LightningSource`) serves the Trainer's own train dataloader
through Lightning's transfer hooks. A data-path rung wraps ``state.data`` the way step rungs wrap
``state.step``: it returns another source around this one (pinned, prefetched, static buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from speedkit import compat
from speedkit.data.batch import host_copy, move_to_device
from speedkit.data.rng import RngState, loader_generators, loader_rng_owners
from speedkit.errors import ConfigError


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

    #: set while the trials read batches untimed to measure its pace (``Timing.loader_pace_ms``): a source that
    #: records its waits leaves those reads out
    reading_ahead: bool = False

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
        """The states of the loader's generators, and of the generators its dataset, samplers and
        collate_fn keep of their own (:func:`~speedkit.data.rng.private_rngs`): the trials read samples
        from them too."""
        return {"generators": RngState.capture(self.generators(), owners=loader_rng_owners(self.loader), process=False)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("generators")
        if saved is not None:
            saved.restore()

    def release(self) -> None:
        """After the trials: stop the workers the trials' copy of a persistent-workers loader started."""
        compat.shutdown_workers(self.iterable)

    def workers(self) -> int:
        """The processes making this source's batches side by side (a DataLoader's workers; 0: the reader
        makes each itself, within the step)."""
        return int(getattr(self.iterable, "num_workers", 0) or 0)

    def buffered_at_most(self) -> int:
        """The most batches this source's workers can have made ahead while nobody reads it (a
        DataLoader's workers times its prefetch factor; 0 without workers): a window that begins after
        slower steps or another source's windows may read that many without waiting for any."""
        workers = self.workers()
        factor = getattr(self.iterable, "prefetch_factor", None)
        return workers * (int(factor) if factor else 2) if workers > 0 else 0

    def fit_serving(self) -> BatchSource | None:
        """The source whose loading a ``fit`` that iterates its own loader must take over for this
        source's change to take effect (after the trials, :func:`speedkit.lightning.data.bind_source`
        binds it into a Lightning fit); None: the fit's own loading is this source's."""
        return None

    def host_batch_hooks(self) -> list[str]:
        """The user's hooks that run on each host batch before it is moved to the device, and expect it
        on the host (a Lightning module's ``on_before_batch_transfer``): none here."""
        return []

    def unmapped(self) -> tuple[BatchSource, list[Callable[[Any], Any]]]:
        """The source beneath the wrappers that only map each device batch (:attr:`SourceWrapper.maps_batches`),
        and those wrappers' maps, outermost first: its iterator, mapped by each innermost first, is this
        source's. Itself and no map here."""
        return self, []


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

    def fit_serving(self) -> BatchSource | None:
        return self.inner.fit_serving()

    def host_batch_hooks(self) -> list[str]:
        return self.inner.host_batch_hooks()

    def unmapped(self) -> tuple[BatchSource, list[Callable[[Any], Any]]]:
        if not self.maps_batches:
            return self, []
        source, maps = self.inner.unmapped()
        return source, [self.map_batch, *maps]
