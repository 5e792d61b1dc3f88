"""Copy the next batch to the GPU on a side stream while the current step runs.

:class:`DevicePrefetcher` wraps an iterator of host batches. On CUDA, each batch is pinned (when
the loader did not pin it) and copied with ``non_blocking`` copies on a side CUDA stream, in a
background thread; the batch handed out is one whose copy the consumer's stream waits for (an
event), and every tensor of it is marked used by that stream (``record_stream``), so the caching
allocator never hands its memory to another copy while the step still reads it. Nested batches
(lists, tuples, named tuples, dicts, dataclasses) move recursively; other leaves are left as they
are. Host batches are pulled on the caller's thread, in order, ``lookahead`` ahead of the one handed
out: 1 overlaps the next copy with the current step; 0 pulls nothing early (for loaders that make
batches in the caller's process, where pulling early would move its RNG draws). ``limit`` caps the
host batches pulled: a loop that stops after ``limit`` batches then leaves the loader exactly as
deep as it would without the prefetcher (a persistent worker's RNG, a shuffle's generator). With
``ahead_when_told`` the batch ahead is pulled only when :meth:`~DevicePrefetcher.pull_ahead` is
called, for a loop that knows later than the handout whether its step runs (a Lightning module's
``on_train_batch_start`` may end the epoch there): an epoch ended before that leaves the loader as
deep as without the prefetcher.

The background thread waits for each copy to finish before the batch is handed out, so a loader
that refills one pinned buffer is never read after it moved on. On a CPU device nothing is copied:
the same batch objects, pulled on the same schedule.

A prefetcher serves one epoch. :class:`PrefetchingLoader` is an iterable over a loader that
prefetches each epoch this way and otherwise looks like the loader (its length, sampler, dataset):
what a Lightning fit iterates. Never reading into the next epoch early matters: making an epoch's
iterator draws its shuffle and its workers' seeds from the generators or the global RNG, which the
step itself may draw from (dropout), so it must happen after the last step of the epoch before.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from speedkit.data.batch import batch_leaves, map_batch, move_to_device
from speedkit.data.ring import BatchRing, Packed, ring_epoch, stop_ring_workers
from speedkit.data.topology import iterate_with_threads_kept
from speedkit.fork_safety import protect_forked_children


class TransferTimes:
    """Host-to-device copy times of the batches a prefetcher moved (CUDA events on the side stream)."""

    def __init__(self, keep: int = 512) -> None:
        self.ms: collections.deque[float] = collections.deque(maxlen=keep)
        self.batches = 0
        self.via_ring = 0  # of them, batches read from a ring slot

    def add(self, ms: float) -> None:
        self.ms.append(ms)
        self.batches += 1

    def median_ms(self) -> float | None:
        return statistics.median(self.ms) if self.ms else None


def pin_batch(batch: Any) -> Any:
    """``batch`` with its CPU tensors in pinned memory (tensors already pinned are kept as they are)."""
    return map_batch(
        lambda t: t.pin_memory() if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_pinned() else t, batch
    )


def all_pinned(batch: Any) -> bool:
    """Whether no tensor of ``batch`` is in pageable host memory (so its copy needs no pinning first)."""
    return all(t.device.type != "cpu" or t.is_pinned() for t in batch_leaves(batch) if isinstance(t, torch.Tensor))


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index (a bare "cuda" is the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DevicePrefetcher(Iterator[Any]):
    """Batches of ``batches`` on ``device``, the next one copied on a side stream while this one is used.

    Args:
        batches: host batches.
        device: where they go; on a CPU device nothing is copied (the same batch objects, on the same schedule).
        lookahead: host batches pulled ahead of the one handed out (0 or 1).
        times: collects each batch's copy time (ms).
        ring: the shared memory a handoff loader's workers pack their batches into.
        limit: host batches pulled at most (None: until ``batches`` ends).
        ahead_when_told: pull the batch ahead when :meth:`pull_ahead` is called, not when one is
            handed out (never told: nothing is pulled early).
    """

    def __init__(
        self,
        batches: Iterator[Any],
        device: torch.device | str,
        *,
        lookahead: int = 1,
        times: TransferTimes | None = None,
        ring: BatchRing | None = None,
        limit: int | None = None,
        ahead_when_told: bool = False,
    ) -> None:
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1, found {lookahead!r}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be None or an integer >= 0, found {limit!r}")
        self.batches = batches
        self.device = resolve_device(device)
        self.lookahead = lookahead
        self.limit = limit
        self.ahead_when_told = ahead_when_told
        self.pulled = 0  # host batches pulled from ``batches``
        self.times = times if times is not None else TransferTimes()
        self.ring = ring
        self.cuda = self.device.type == "cuda"
        if self.cuda:  # its copy events must not be freed by a worker forked later (see fork_safety)
            protect_forked_children()
        self._pending: collections.deque[Future[tuple[Any, Any]]] = collections.deque()
        #: copies issued on this thread, not yet waited for: (start, done, host batch, ring slot or None)
        self._issued: collections.deque[tuple[Any, Any, Any, int | None]] = collections.deque()
        self._exhausted = False
        self._pool: ThreadPoolExecutor | None = None
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="speedkit-h2d")

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        if not self._pending:
            self._stage()
        if not self._pending:
            self.close()
            raise StopIteration
        batch, done = self._pending.popleft().result()
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in batch_leaves(batch):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(current)
        if not self.ahead_when_told:
            self.pull_ahead()
        return batch

    def pull_ahead(self) -> None:
        """Pull the host batches ``lookahead`` ahead of the one handed out (if not pulled yet) and start their copies."""
        while len(self._pending) < self.lookahead and not self._exhausted:
            self._stage()

    def _stage(self) -> None:
        """Pull the next host batch (on this thread) and start its copy: here when its memory is pinned
        already (a ring slot, a pinning loader's batch), else on the background thread, which pins it."""
        if self._exhausted:
            return
        if self.limit is not None and self.pulled >= self.limit:
            self._exhausted = True
            return
        self._settle()  # before pulling: a loader may refill the buffer a copy issued here read
        try:
            host = next(self.batches)
        except StopIteration:
            self._exhausted = True
            return
        self.pulled += 1
        if not self.cuda:  # nothing to copy: the batch itself, on the same pull schedule
            here: Future[tuple[Any, Any]] = Future()
            here.set_result((host, None))
            self._pending.append(here)
            return
        slot = None
        if isinstance(host, Packed):
            if self.ring is None:
                raise RuntimeError("a batch packed into a ring reached a prefetcher that was not given the ring")
            slot, host = host.slot, self.ring.take(host)
            self.times.via_ring += 1
        if slot is not None or all_pinned(host):
            done_now: Future[tuple[Any, Any]] = Future()
            done_now.set_result(self._copy_here(host, slot))
            self._pending.append(done_now)
            return
        assert self._pool is not None
        self._pending.append(self._pool.submit(self._copy, host))

    def _issue(self, host: Any) -> tuple[Any, Any, Any]:
        """Start copying pinned ``host`` to the device on the side stream: the device batch, and the
        timing events around the copy."""
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            batch = move_to_device(host, self.device, non_blocking=True)
            done.record(self.stream)
        return batch, start, done

    def _copy_here(self, host: Any, slot: int | None) -> tuple[Any, Any]:
        """Issue the copy of a pinned batch on the side stream, on this thread; it is waited for (and
        its ring slot freed) before the next host batch is pulled."""
        batch, start, done = self._issue(host)
        self._issued.append((start, done, host, slot))
        return batch, done

    def _settle(self) -> None:
        """Wait for the copies issued on this thread (a step ago: done by now), time them, free their slots."""
        while self._issued:
            start, done, _, slot = self._issued.popleft()
            done.synchronize()
            self.times.add(start.elapsed_time(done))
            if slot is not None:
                self.ring.release(slot)  # type: ignore[union-attr]

    def _copy(self, host: Any) -> tuple[Any, Any]:
        pinned = pin_batch(host)  # held until its copy is done
        batch, start, done = self._issue(pinned)
        done.synchronize()  # the host buffers may be reused once this batch is handed out
        self.times.add(start.elapsed_time(done))
        return batch, done

    def close(self) -> None:
        """Stop the background thread (pending copies finish first)."""
        self._exhausted = True  # nothing is pulled after this, told or not
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self.cuda:
            self._settle()
        self._pending.clear()
        if self.ring is not None:  # stop the workers that write into the ring before anyone resets it
            close = getattr(self.batches, "close", None)
            if close is not None:
                close()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


class PrefetchingLoader:
    """An iterable over ``loader`` whose every epoch is a :class:`DevicePrefetcher` (pulling at most
    ``limit`` batches: where the loop stops an epoch early, it is told how early; with
    ``ahead_when_told``, pulling the batch ahead when :meth:`pull_ahead` says the step runs); anything else
    (``len``, ``sampler``, ``batch_sampler``, ``dataset``, ...) is the loader's."""

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str,
        *,
        lookahead: int = 1,
        times: TransferTimes | None = None,
        ring: BatchRing | None = None,
        limit: int | None = None,
        ahead_when_told: bool = False,
    ) -> None:
        self.loader = loader
        self.device = resolve_device(device)
        self.lookahead = lookahead
        self.ahead_when_told = ahead_when_told
        self.times = times if times is not None else TransferTimes()
        self.ring = ring
        self.limit = limit
        self._live: DevicePrefetcher | None = None

    def __iter__(self) -> Iterator[Any]:
        batches: Iterator[Any]
        if self.ring is not None:
            if self._live is not None:  # the last epoch's workers stop before the slots are reset
                self._live.close()
            batches = ring_epoch(self.loader, self.ring)
        else:
            batches = iterate_with_threads_kept(self.loader)
        return self.prefetch(batches)

    def prefetch(self, batches: Iterator[Any]) -> DevicePrefetcher:
        """One epoch's ``batches`` (an iterator of the loader made elsewhere: the first epoch's, which
        Lightning made before speedkit bound this loader), prefetched as every epoch is here."""
        self._live = DevicePrefetcher(
            batches,
            self.device,
            lookahead=self.lookahead,
            times=self.times,
            ring=self.ring,
            limit=self.limit,
            ahead_when_told=self.ahead_when_told,
        )
        return self._live

    def pull_ahead(self) -> None:
        """The live epoch's :meth:`DevicePrefetcher.pull_ahead` (the loop's step will run)."""
        if self._live is not None:
            self._live.pull_ahead()

    def close(self) -> None:
        """Stop the live epoch (its copies settled, its workers stopped, persistent ones too)."""
        if self._live is not None:
            self._live.close()
            self._live = None
        if self.ring is not None:
            stop_ring_workers(self.loader)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "device", "lookahead", "times", "ring", "limit", "ahead_when_told", "_live"):
            raise AttributeError(name)
        return getattr(self.loader, name)


__all__ = ["DevicePrefetcher", "PrefetchingLoader", "TransferTimes", "all_pinned", "pin_batch", "resolve_device"]
