"""The data path bound into a Lightning fit: what of :mod:`speedkit.data` and the data_path rung knows
the Trainer (the core knows nothing of Lightning).

* the RNG and generator states at the moment a fit creates its first train iterator
  (:func:`watch_fit_iterator_start`), so that iterator can be made again exactly;
* :func:`bind_source`: the fit loop iterates a kept data_path source's loader (rebuilt, prefetched,
  its workers writing into a ring) in place of the user's (:class:`DataPathFit`), the module's
  ``on_train_batch_start`` followed by the pull of the batch ahead (:class:`PullAheadAfter`), a
  reloaded train loader served the same way;
* the batch-transfer hooks a module or datamodule overrides (:func:`overridden_transfer_hooks`), which
  must see the host batch.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from speedkit import compat
from speedkit.data.prefetch import PrefetchingLoader, TransferTimes
from speedkit.data.ring import BatchRing, describe_ring, handoff_loader, make_ring, persistent
from speedkit.data.rng import RngState, loader_generators
from speedkit.data.settings import LoaderSettings, needs_stop_at_length, rebuild_loader
from speedkit.handle import AttributeWrapper, Handle, set_attr

if TYPE_CHECKING:
    from speedkit.data.source import BatchSource
    from speedkit.rungs.data_path import DataPathSource


def bind_source(source: BatchSource, trainer: Any, module: Any) -> Handle | None:
    """Make a kept batch source's change take effect in a Lightning ``fit``, which iterates its own loader
    (:meth:`~speedkit.data.source.BatchSource.fit_serving`); None when there is nothing to bind. The
    returned handle undoes the binding."""
    serving = source.fit_serving()
    return DataPathFit(serving).bind(trainer, module) if serving is not None else None  # type: ignore[arg-type]


@dataclasses.dataclass
class IteratorStart:
    """The RNG and generator states right before and right after a fit created its first train iterator."""

    loaders: list[Any]
    before: RngState
    after: RngState | None = None


_FIT_STARTS: weakref.WeakKeyDictionary[Any, IteratorStart] = weakref.WeakKeyDictionary()


def watch_fit_iterator_start(trainer: Any) -> Callable[[], None]:
    """Record, for :func:`fit_iterator_start`, the states around the creation of ``trainer``'s first
    train iterator (Lightning makes it in ``setup_data``, before ``on_train_start``). Call from
    ``on_fit_start``; the returned function removes the watch (by ``on_train_start``)."""
    _FIT_STARTS.pop(trainer, None)

    def before(loaders: list[Any]) -> None:
        _FIT_STARTS[trainer] = IteratorStart(loaders, RngState.capture(loader_generators(loaders)))

    def after(loaders: list[Any]) -> None:
        start = _FIT_STARTS.get(trainer)
        if start is not None and start.after is None:
            start.after = RngState.capture(loader_generators(start.loaders))

    remove = compat.watch_train_iterator_start(trainer, before, after)
    return remove if remove is not None else (lambda: None)


def fit_iterator_start(trainer: Any) -> IteratorStart | None:
    """The states recorded by :func:`watch_fit_iterator_start` for ``trainer``'s fit, if any."""
    return _FIT_STARTS.get(trainer)


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


def overridden_transfer_hooks(trainer: Any, module: Any) -> list[str]:
    """The batch-transfer hooks the user overrides that must see the host batch (they run before
    the copy): ``on_before_batch_transfer`` and ``transfer_batch_to_device`` of the module or datamodule."""
    if "lightning.pytorch" not in sys.modules:
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
        what = (
            f"a copy of the user's DataLoader with {self.settings.describe()}"
            if self.settings is not None
            else "the user's DataLoader"
        )
        if self.stop_at_length:
            what += (
                " (its sampler read through StopAtLength: the workers read it no further than the fit without them, "
                "so its generator draws the same shuffles)"
            )
        if self.ring is not None:
            what += f", its workers writing each batch into {describe_ring(self.ring)}"
        if isinstance(self.served, PrefetchingLoader):
            what += f", each batch copied to {self.served.device} on a side stream while the step before runs"
            if self.served.ahead_when_told:
                what += (
                    " (the batch ahead pulled once the module's on_train_batch_start lets the step run: an epoch it "
                    "ends with -1 leaves the loader where the fit without speedkit leaves it)"
                )
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


class DataPathFit:
    """A kept data_path source (:class:`~speedkit.rungs.data_path.DataPathSource`) served to a Lightning fit."""

    def __init__(self, source: DataPathSource) -> None:
        self.source = source

    def bind(self, trainer: Any, module: Any) -> Handle | None:
        """Make the fit loop iterate the rebuilt loader (or the user's), prefetched; the first
        epoch's iterator made again from the states Lightning made it from (see :meth:`_first_epoch`).
        A fit that reloads its train loader (``reload_dataloaders_every_n_epochs``) gets each new
        loader served the same way (see :meth:`_reloaded`). The handle puts the user's loader back
        and stops the rebuilt loader's workers."""
        loaders = compat.lightning_train_loaders(trainer)
        if loaders is None:
            raise RuntimeError("the fit loop has no train loader set up (Lightning's internals moved?)")
        if len(loaders) != 1 or loaders[0] is not self.source.loader:
            raise RuntimeError("the fit iterates other train loaders than the trials measured")
        settings = self.source.plan.rebuild
        if settings is None and not self.source.plan.prefetch:
            return None
        if self.source.plan.prefetch:
            self.source.fit_times = TransferTimes()
            self.source.release_ring()  # the trials' ring: their workers stopped, their memory unpinned
        serving = self._serve(trainer, loaders[0])
        handle = Handle("data_path")
        watches: list[Callable[[], None]] = []

        def put_back() -> None:
            while watches:
                watches.pop()()
            serving.close(trainer)

        handle.record(f"fit: the train loop iterates {serving.describe()}", put_back)
        if isinstance(serving.served, PrefetchingLoader) and serving.served.ahead_when_told:
            set_attr(
                handle,
                module,
                "on_train_batch_start",
                PullAheadAfter(module.on_train_batch_start, serving),
                "fit: the module's on_train_batch_start is followed by the pull of the batch ahead",
            )
        handle.record(f"fit: {self._first_epoch(trainer, serving.original, serving.fit_loader, serving.served)}")
        reload_every = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
        if reload_every:
            unwatch = compat.lightning_watch_train_reload(trainer, lambda: self._reloaded(trainer, serving, handle))
            if unwatch is None:
                handle.record(
                    f"fit: reload_dataloaders_every_n_epochs={reload_every}, but its reloads cannot be watched "
                    "(Lightning's internals moved?): from the first reload on, the fit iterates the new loader "
                    "as Lightning makes it"
                )
            else:  # and the states each reload's iterator is made from (see _reloaded)
                watches += [unwatch, watch_fit_iterator_start(trainer)]
        handle.report = lambda: [line for line in self.source.report_lines() if line.startswith("fit:")]
        return handle

    def _serve(self, trainer: Any, original: Any) -> _Serving:
        """Make the fit loop iterate ``original`` rebuilt with the plan's settings and prefetched
        (each from its next ``iter()`` on)."""
        settings = self.source.plan.rebuild
        stop = settings is not None and needs_stop_at_length(original, settings.num_workers)
        fit_loader = (
            rebuild_loader(original, **dataclasses.asdict(settings), stop_at_length=stop) if settings is not None else original
        )
        served: Any = fit_loader
        ring = None
        if self.source.plan.prefetch:
            if self.source.plan.ring is not None and settings is not None and settings.num_workers > 0:
                ring = make_ring(self.source.plan.ring)
            served = PrefetchingLoader(
                handoff_loader(fit_loader, ring) if ring is not None else fit_loader,
                self.source.device,
                lookahead=self.source.plan.lookahead,
                times=self.source.fit_times,
                ring=ring,
                limit=epoch_batches(trainer),
                ahead_when_told=may_end_epoch_at_batch_start(trainer),
            )
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
                handle.record(
                    f"fit: a reloaded loader's persistent workers were not made again ({problem}): its copy "
                    "draws its workers' seeds where the fit without speedkit does not"
                )

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
        now = RngState.capture([g for g, _ in start.before.generators])
        same_moments = (getattr(original, "num_workers", 0) > 0) == (getattr(fit_loader, "num_workers", 0) > 0)
        if not same_moments and not now.same_as(start.after):
            return (
                "the RNGs were drawn from between its creation and the trials, and the new worker count "
                "draws the shuffle at another moment"
            )
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
