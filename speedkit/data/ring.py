"""Batches handed from DataLoader workers to the device through one block of shared, pinned memory.

By default a worker's batch reaches the training process as shared-memory tensors that the loader's
pinning thread maps, copies into pinned memory and queues: per batch a few thousand page faults, a
copy, and several turns of the GIL, each of which the thread issuing the step waits for. Here the
training process allocates a :class:`BatchRing` once, shared with the workers and registered with
CUDA as pinned; each worker writes its collated batch into one of its own slots
(:class:`RingCollate`, around the loader's own ``collate_fn``) and sends only a small
:class:`Packed` description. The training process copies the slot straight to the device and frees
it once the copy is done (:class:`~speedkit.data.prefetch.DevicePrefetcher`); no thread of its own
touches the batch.

A batch is packed only when every tensor in it is a plain, contiguous CPU tensor and all of them fit
a slot; else it travels the usual way (and is pinned and copied as before). A worker that finds its
next slot still in use waits ``wait_s`` for it, then sends its batch the usual way, so nothing ever
waits on a slot forever. Values, dtypes, shapes and the batch's structure are kept exactly.

Slots: worker ``w`` owns ``slots_per_worker`` of them and fills them in turn. A DataLoader keeps at
most ``prefetch_factor`` batches of a worker outstanding, and the prefetcher frees a batch's slot
before it takes the next batch, so ``prefetch_factor + 2`` slots per worker never make one wait.

Persistent workers outlive an epoch, and so does the ring. An epoch cut short (a ``break``,
``limit_train_batches``, a trial) leaves batches its workers had packed that nobody reads: the next
epoch's iterator, when it is made, drains them from the workers and drops them. Every packed batch
reaches the training process before it is dropped (each :class:`Packed` records its arrival as it is
unpickled there), so once the next epoch's iterator is made, the batches that arrived and were never
taken are exactly the dropped ones, and their slots are freed (:meth:`BatchRing.drop_untaken`), for
every worker alike: a worker none of whose batches the short epoch read gets its slots back too. Each
claim records its turn (the worker's count of claims), so a slot claimed again since is never freed.
A worker meanwhile skips a slot still claimed for the next free one of its own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

from speedkit import compat
from speedkit.data.batch import batch_leaves, map_batch
from speedkit.data.topology import iterate_with_threads_kept

#: byte alignment of each tensor in a slot (any dtype may view it)
ALIGN = 256


class RingLeaf:
    """A tensor a worker wrote into its slot: where, and as what. (A plain class, not a dataclass or a
    named tuple, so that walking a batch treats it as a leaf.)"""

    __slots__ = ("dtype", "offset", "shape")

    def __init__(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.offset, self.shape, self.dtype = offset, shape, dtype

    def __reduce__(self) -> tuple[Any, ...]:
        return RingLeaf, (self.offset, self.shape, self.dtype)

    def __repr__(self) -> str:
        return f"RingLeaf(offset={self.offset}, shape={self.shape}, dtype={self.dtype})"


#: per ring (by its token), in the training process: the (slot, turn) of each packed batch that arrived
#: and was not taken yet (an ordered set)
_ARRIVED: dict[str, dict[tuple[int, int], None]] = {}


class Packed:
    """A batch in ``slot`` of the ring ``ring`` (its token), claimed at its worker's ``turn``: the
    batch's structure with its tensors as :class:`RingLeaf`. Unpickled in the training process, it
    records its arrival with its ring."""

    __slots__ = ("batch", "ring", "slot", "turn")

    def __init__(self, slot: int, turn: int, batch: Any, ring: str = "") -> None:
        self.slot, self.turn, self.batch, self.ring = slot, turn, batch, ring

    def __reduce__(self) -> tuple[Any, ...]:
        return _arrived, (self.slot, self.turn, self.batch, self.ring)


def _arrived(slot: int, turn: int, batch: Any, ring: str) -> Packed:
    arrived = _ARRIVED.get(ring)
    if arrived is not None:  # the process that owns the ring (workers never unpickle a Packed)
        arrived[(slot, turn)] = None
    return Packed(slot, turn, batch, ring)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def packable(batch: Any) -> list[torch.Tensor] | None:
    """The tensors of ``batch`` when every one is a plain contiguous CPU tensor (and there is one), else None."""
    tensors = [leaf for leaf in batch_leaves(batch) if isinstance(leaf, torch.Tensor)]
    if not tensors or any(
        type(t) is not torch.Tensor or t.device.type != "cpu" or t.requires_grad or not t.is_contiguous() for t in tensors
    ):
        return None
    return tensors


def slot_bytes_for(batch_bytes: int, leaves: int = 64) -> int:
    """A slot for batches of up to ``batch_bytes`` bytes of tensors (and 5% more), each of up to ``leaves``
    tensors aligned."""
    return _aligned(int(batch_bytes * 1.05) + ALIGN * leaves)


class BatchRing:
    """Shared host memory in slots, ``slots_per_worker`` per worker, each ``slot_bytes`` long.

    Args:
        workers: loader workers that write into it (worker ``w`` uses slots ``w * slots_per_worker`` on).
        slots_per_worker: slots each worker fills in turn.
        slot_bytes: bytes of one slot.
        wait_s: how long a worker waits for its next slot to be freed before sending its batch the usual way.
        clock, sleep: the waiting worker's (injectable for tests).
    """

    def __init__(
        self,
        workers: int,
        slots_per_worker: int,
        slot_bytes: int,
        *,
        wait_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if workers < 1 or slots_per_worker < 1 or slot_bytes < ALIGN:
            raise ValueError(
                f"a ring needs workers >= 1, slots_per_worker >= 1 and slot_bytes >= {ALIGN}, found "
                f"{workers}, {slots_per_worker}, {slot_bytes}"
            )
        self.workers, self.slots_per_worker, self.slot_bytes = workers, slots_per_worker, _aligned(slot_bytes)
        self.wait_s, self.clock, self.sleep = wait_s, clock, sleep
        self.memory = torch.empty(workers * slots_per_worker * self.slot_bytes, dtype=torch.uint8).share_memory_()
        #: per slot, the turn of the worker's claim on it, or -1 where it is free: one word, written by one
        #: store, so a reader never sees a claim without its turn (no ordering between two stores to trust:
        #: x86 keeps stores in order, ARM does not)
        self.claim = torch.full((workers * slots_per_worker,), -1, dtype=torch.int64).share_memory_()
        self.turn = [0] * workers  # each worker process advances its own copy
        self.registered = False
        self.fallbacks = 0  # batches this process sent the usual way (counted in the worker that did)
        # the training process's side (its own copy): slots taken and not yet released, batches arrived
        self.held: set[int] = set()
        self.token = uuid.uuid4().hex
        _ARRIVED[self.token] = {}
        self.recovered = 0  # slots freed because the batch in them was dropped unread

    @property
    def free(self) -> torch.Tensor:
        """1 for each free slot, 0 for each claimed one."""
        return (self.claim < 0).int()

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    def register(self) -> bool:
        """Pin the ring for copies to CUDA devices (page-locked in place); False where it cannot be."""
        if not self.registered:
            self.registered = compat.cuda_host_register(self.memory)
        return self.registered

    def unregister(self) -> None:
        if self.registered:
            compat.cuda_host_unregister(self.memory)
            self.registered = False

    # -- the worker's side ------------------------------------------------------------------------
    def pack(self, batch: Any, worker: int) -> Any:
        """``batch`` written into ``worker``'s next slot, as a :class:`Packed`; or ``batch`` itself when
        it cannot be packed (see :func:`packable`), does not fit, or the slot stays in use."""
        tensors = packable(batch)
        if tensors is None or not 0 <= worker < self.workers:
            return batch
        if sum(_aligned(t.numel() * t.element_size()) for t in tensors) > self.slot_bytes:
            return batch
        turn, slot = self._next_free(worker)
        if slot is None:
            turn, slot = self.turn[worker], self._slot(worker, self.turn[worker])
            if not self._wait_free(slot):
                self.fallbacks += 1
                return batch
        self.claim[slot] = turn  # claimed, with the turn that claimed it, in one store (see ``claim``)
        self.turn[worker] = turn + 1
        base, used = slot * self.slot_bytes, [0]

        def put(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            offset = used[0]
            self.view(base + offset, tuple(leaf.shape), leaf.dtype).copy_(leaf)
            used[0] += _aligned(leaf.numel() * leaf.element_size())
            return RingLeaf(offset, tuple(leaf.shape), leaf.dtype)

        return Packed(slot, turn, map_batch(put, batch), self.token)

    def _slot(self, worker: int, turn: int) -> int:
        return worker * self.slots_per_worker + turn % self.slots_per_worker

    def _next_free(self, worker: int) -> tuple[int, int | None]:
        """The worker's first free slot from its turn on, and the turn that reaches it (None: all in use)."""
        start = self.turn[worker]
        for turn in range(start, start + self.slots_per_worker):
            slot = self._slot(worker, turn)
            if int(self.claim[slot]) < 0:
                return turn, slot
        return start, None

    def _wait_free(self, slot: int) -> bool:
        deadline = self.clock() + self.wait_s
        while int(self.claim[slot]) >= 0:
            if self.clock() >= deadline:
                return False
            self.sleep(0.0002)
        return True

    # -- the training process's side -------------------------------------------------------------
    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The ring's bytes at ``offset`` as a tensor of ``shape`` and ``dtype``."""
        size = torch.Size(shape).numel() * dtype.itemsize
        return self.memory[offset : offset + size].view(dtype).view(shape)

    def take(self, packed: Packed) -> Any:
        """The training process takes ``packed`` (see :meth:`host_batch`; :meth:`release` its slot once read)."""
        _ARRIVED.get(self.token, {}).pop((packed.slot, packed.turn), None)
        self.held.add(packed.slot)
        return self.host_batch(packed)

    def drop_untaken(self) -> None:
        """Free the slots of the batches that arrived here and were never taken: call it right after a
        persistent iterator's reset, which drained and dropped every batch its workers had made ahead.
        A slot claimed again since (by a later turn) or being read is left alone; the claims the new
        epoch's first tasks make meanwhile are of other slots and turns."""
        arrived = _ARRIVED.get(self.token, {})
        for slot, turn in list(arrived):
            if slot not in self.held and int(self.claim[slot]) == turn:  # the worker cannot claim a slot not free
                self.claim[slot] = -1
                self.recovered += 1
        arrived.clear()

    def host_batch(self, packed: Packed) -> Any:
        """The packed batch as views of its slot (valid until :meth:`release`)."""
        base = packed.slot * self.slot_bytes
        return map_batch(
            lambda leaf: self.view(base + leaf.offset, leaf.shape, leaf.dtype) if isinstance(leaf, RingLeaf) else leaf,
            packed.batch,
        )

    def release(self, slot: int) -> None:
        """The batch in ``slot`` was read (its copy is done): its worker may write the slot again."""
        self.claim[slot] = -1
        self.held.discard(slot)

    def reset(self) -> None:
        """Before new workers start (their turns count from 0), with no copy from the ring pending (the
        prefetcher waits for its copies before it pulls a batch and when it closes): every slot free
        (batches the last workers packed but nobody took leave their slots claimed)."""
        self.claim.fill_(-1)
        self.held.clear()
        _ARRIVED.get(self.token, {}).clear()

    def close(self) -> None:
        """The memory no longer pinned (its readers closed first)."""
        self.unregister()
        _ARRIVED.pop(self.token, None)


class RingCollate:
    """The loader's ``collate_fn``, then the batch written into the calling worker's slot of ``ring``
    (in the training process itself, where there is no worker, the batch is returned as it is).

    torch's own ``default_collate`` stacks a worker's batch into a fresh block of shared memory (so the
    batch can travel the usual way), which costs the worker a new mapping and its page faults every
    batch; here it stacks into ordinary memory instead, which the ring copy reads. Any other
    ``collate_fn`` runs exactly as in the loader."""

    def __init__(self, collate_fn: Callable[[Any], Any], ring: BatchRing) -> None:
        self.collate_fn, self.ring = collate_fn, ring

    def __call__(self, samples: Any) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self.collate_fn(samples)
        if self.collate_fn is torch.utils.data.default_collate:
            with compat.outside_worker():
                batch = self.collate_fn(samples)
            return self.ring.pack(batch, info.id)  # unpacked, its tensors move to shared memory as they are sent
        return self.ring.pack(self.collate_fn(samples), info.id)


def handoff_loader(loader: Any, ring: BatchRing) -> Any:
    """A copy of ``loader`` (a DataLoader with workers) whose workers pack their batches into ``ring``:
    its ``collate_fn`` wrapped by :class:`RingCollate` (the loader's own still collates), not pinned
    (the ring is pinned; a batch sent the usual way is pinned by the prefetcher)."""
    clone = compat.trial_loader(loader)
    clone.collate_fn = RingCollate(loader.collate_fn, ring)
    clone.pin_memory = False
    return clone


def persistent(loader: Any) -> bool:
    """Whether ``loader``'s workers outlive an epoch."""
    return bool(getattr(loader, "persistent_workers", False)) and getattr(loader, "num_workers", 0) > 0


def ring_epoch(loader: Any, ring: BatchRing) -> RingEpoch:
    """One epoch of a :func:`handoff_loader`, its iterator made now (as ``iter(loader)`` would: the
    shuffle and the workers' seeds are drawn from the RNGs as they are at this call, not at the first
    batch). Where its workers start afresh, every slot is free first; where persistent workers go on,
    the slots of the batches the last epoch left unread are freed once the new iterator dropped them."""
    going_on = persistent(loader) and compat.has_live_iterator(loader)
    if not going_on:
        ring.reset()
    it = iterate_with_threads_kept(loader)
    if going_on:
        ring.drop_untaken()
    return RingEpoch(loader, it)


class RingEpoch(Iterator[Any]):
    """The batches of one epoch of a handoff loader. :meth:`close` stops its workers, whether or not
    a batch was read (they started with the epoch); persistent workers that already run go on into
    the next epoch (see :func:`stop_ring_workers`)."""

    def __init__(self, loader: Any, it: Iterator[Any]) -> None:
        self.loader, self.it = loader, it

    def __next__(self) -> Any:
        return next(self.it)

    def close(self) -> None:
        if not persistent(self.loader):
            compat.shutdown_iterator(self.it)


def stop_ring_workers(loader: Any) -> None:
    """Stop a :func:`handoff_loader`'s persistent workers (once nobody reads its ring any more)."""
    compat.shutdown_workers(loader)


def make_ring(spec: tuple[int, int, int]) -> BatchRing | None:
    """A ring of ``spec`` (workers, slots per worker, bytes per slot), pinned; None where it cannot be made
    or pinned (the batches then travel the usual way)."""
    try:
        ring = BatchRing(*spec)
    except (RuntimeError, OSError, MemoryError):
        return None
    return ring if ring.register() else None


def describe_ring(ring: BatchRing) -> str:
    return (
        f"a ring of shared pinned memory ({ring.nbytes / 2**20:,.0f} MiB: {ring.slots_per_worker} slots of "
        f"{ring.slot_bytes / 2**20:.1f} MiB per worker), copied to the device from there"
    )


__all__ = [
    "ALIGN",
    "BatchRing",
    "Packed",
    "RingCollate",
    "RingEpoch",
    "RingLeaf",
    "describe_ring",
    "handoff_loader",
    "make_ring",
    "packable",
    "persistent",
    "ring_epoch",
    "slot_bytes_for",
    "stop_ring_workers",
]
