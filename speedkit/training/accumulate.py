"""Out-of-memory fallback: the same batch split into micro-batches and accumulated, no sample lost.

When a CUDA out-of-memory error (``torch.OutOfMemoryError``) hits the forward or the backward of a
batch, :class:`MicroBatcher` puts the gradients back as they were before that batch, frees what the
failed attempt held (outside the ``except`` block, where its frames are gone), and runs the *same*
batch again as 2, 4, 8 ... micro-batches along its first dimension, in order, each micro-batch's
loss weighted by its share of the batch's samples, the gradients accumulating. The effective batch,
the loss normalisation (a mean over the batch's samples) and the sample order are unchanged; every
sample counts once. The split is kept for the steps after (it never grows back on its own; with
``probe_after`` it tries half as many micro-batches after that many steps without an error, and
says so). An error at a split that has already run steps is retried once as it is before splitting
further: a passing error (a fragmented allocator) then costs one attempt, not a smaller micro-batch
for the rest of the run. An error at micro-batches of one sample stops the run with one line naming the sizes
tried (:class:`OutOfMemoryAtOneSample`).

Gradients are kept exact across a failed attempt without copying them: the gradients a batch finds
(earlier micro-batches of a gradient-accumulation cycle) are set aside before it runs, the batch's
own gradients are made fresh, and on success the two are added (``GradStash``); a failed attempt's
partial gradients are dropped. The running statistics of normalization layers (BatchNorm) and the
random-number generators are put back too, so the redone batch sees the state the first attempt saw.

What the split does change, as in any gradient accumulation: a BatchNorm's batch statistics are
taken over each micro-batch, dropout draws its masks per micro-batch, and a loss that is a mean over
something other than samples (tokens of padded sequences) is weighted by samples. Models without
those train to the same parameters within rounding.

This module knows nothing of Lightning: :class:`speedkit.lightning.OOMFallback` runs a Trainer's
steps through it, and ``speedkit.apply(..., oom_fallback=True)`` a plain loop's.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from speedkit.data.batch import batch_leaves, map_batch
from speedkit.data.rng import RngState
from speedkit.errors import ConfigError, SpeedkitError, first_line

#: fn(micro_batch, weight) -> the micro-batch's weighted loss, detached, after its backward ran; None
#: where the step skips the batch (a Lightning ``training_step`` that returned None)
ForwardBackward = Callable[[Any, float], "torch.Tensor | None"]


class OutOfMemoryAtOneSample(SpeedkitError):
    """Out of memory with micro-batches of one sample: splitting further cannot help."""


@dataclass(frozen=True)
class FallbackEvent:
    """One change of the micro-batch: an out-of-memory split, or a probe back to larger micro-batches."""

    step: int  # the optimizer step (or batch) it happened in, counted by the caller
    old_micro_batch: int  # samples per micro-batch before
    new_micro_batch: int  # samples per micro-batch after
    seconds_lost: float  # wall time of the failed attempt(s), freeing included
    kind: str  # "out of memory" or "probe"
    detail: str = ""  # where it hit ("forward or backward: CUDA out of memory. Tried to allocate ...")

    def describe(self) -> str:
        return (
            f"step {self.step}: {self.kind}, micro-batch {self.old_micro_batch} -> {self.new_micro_batch} "
            f"({self.seconds_lost:.2f} s lost){': ' + self.detail if self.detail else ''}"
        )


def is_out_of_memory(exc: BaseException) -> bool:
    """A device allocation failed (CUDA's caching allocator, or a test's simulated budget)."""
    return isinstance(exc, torch.OutOfMemoryError)


def batch_size(batch: Any) -> int | None:
    """The number of samples in a batch: the first dimension its tensors (of one dimension or more)
    share most often; None when it holds no such tensor."""
    sizes: dict[int, int] = {}

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            sizes[leaf.shape[0]] = sizes.get(leaf.shape[0], 0) + 1
        return leaf

    map_batch(visit, batch)
    return max(sizes, key=lambda s: (sizes[s], s)) if sizes else None


def split_batch(batch: Any, parts: int) -> list[tuple[Any, int]]:
    """``batch`` as ``parts`` micro-batches in order, with their sample counts (sizes differing by at
    most one, as ``torch.tensor_split`` makes them): every tensor whose first dimension is the batch
    size is split along it; other leaves (a shared mask, a scalar, a string) go whole to each."""
    total = batch_size(batch)
    if total is None:
        raise SpeedkitError("cannot split the batch into micro-batches: it holds no tensor with a batch dimension")
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    bounds = [i * base + min(i, extra) for i in range(parts + 1)]
    chunks = []
    for lo, hi in zip(bounds, bounds[1:]):
        chunks.append(
            (
                map_batch(
                    lambda t, lo=lo, hi=hi: (
                        t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == total else t
                    ),
                    batch,
                ),
                hi - lo,
            )
        )
    return chunks


def merge_batches(batches: Sequence[Any]) -> tuple[Any, str | None]:
    """``batches`` as one micro-batch, the inverse of :func:`split_batch`: every tensor whose first
    dimension is its batch's size concatenated along it, in order; other leaves (a shared mask, a
    scalar, a string) equal in every batch and kept once. Returns ``(merged, None)``, or ``(None, why)``
    where they do not merge (another structure, other shapes apart from the batch dimension, leaves
    that differ)."""
    if not batches:
        return None, "no batches"
    if len(batches) == 1:
        return batches[0], None
    sizes = [batch_size(b) for b in batches]
    if any(s is None for s in sizes):
        return None, "a batch holds no tensor with a batch dimension"
    leaves = [batch_leaves(b) for b in batches]
    if len({len(ls) for ls in leaves}) != 1:
        return None, "the batches differ in structure"
    columns: list[Any] = []
    for i, column in enumerate(zip(*leaves)):
        first = column[0]
        if isinstance(first, torch.Tensor) and first.dim() >= 1 and first.shape[0] == sizes[0]:
            if any(
                not isinstance(t, torch.Tensor)
                or t.dim() != first.dim()
                or t.shape[0] != s
                or t.shape[1:] != first.shape[1:]
                or t.dtype != first.dtype
                or t.device != first.device
                for t, s in zip(column, sizes)
            ):
                return None, f"leaf {i} differs in shape, dtype or device apart from the batch dimension (per-batch padding?)"
            columns.append(torch.cat(column))
        elif isinstance(first, torch.Tensor):
            if any(not isinstance(t, torch.Tensor) or t.shape != first.shape or not torch.equal(t, first) for t in column[1:]):
                return None, f"leaf {i}, which has no batch dimension, differs between the batches"
            columns.append(first)
        else:
            try:
                same = all(bool(x == first) for x in column[1:])
            except Exception:  # a leaf without a plain equality
                same = False
            if not same:
                return None, f"leaf {i} ({type(first).__name__}) differs between the batches"
            columns.append(first)
    it = iter(columns)
    return map_batch(lambda _: next(it), batches[0]), None


def largest_micro_batch(total: int, parts: int) -> int:
    """The largest micro-batch of ``total`` samples split in ``parts``."""
    return math.ceil(total / max(1, min(parts, total)))


def check_probe_after(value: Any, where: str) -> None:
    """One ConfigError where ``value`` is no number of steps >= 1 (None, never grow back, is fine)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(where, f"expected a number of steps >= 1 or None, found {value!r}")


class GradStash:
    """The gradients of ``params`` set aside while one batch makes its own (see the module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.saved: list[torch.Tensor | None] = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def drop_fresh(self) -> None:
        """Forget what a failed attempt accumulated."""
        for p in self.params:
            p.grad = None

    def restore(self) -> None:
        """The gradients as they were before the batch (a failed batch that is not redone)."""
        for p, g in zip(self.params, self.saved):
            p.grad = g

    def merge(self) -> None:
        """The batch's gradients added to those set aside (in place, into the ones set aside: the
        tensor an optimizer or a hook may hold stays the same object)."""
        for p, g in zip(self.params, self.saved):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                g.add_(p.grad)
                p.grad = g
        self.saved = []


class _ModelState:
    """What a failed attempt may have moved besides the gradients: normalization layers' running
    statistics and the random-number generators (torch's CPU and CUDA ones)."""

    def __init__(self, model: nn.Module | None) -> None:
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if model is not None:
            for m in model.modules():
                if getattr(m, "track_running_stats", False):
                    for name in ("running_mean", "running_var", "num_batches_tracked"):
                        b = getattr(m, name, None)
                        if isinstance(b, torch.Tensor):
                            self.buffers.append((b, b.detach().clone()))
        self.rng = RngState.capture(process=("torch", "cuda"))

    def restore(self) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        self.rng.restore()


def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is being captured into a graph (never on a CPU-only run)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def free_device_memory() -> None:
    """What a failed attempt left: reference cycles collected, the caching allocator's free blocks
    returned to the device."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass
class MicroBatcher:
    """Runs a batch's forwards and backwards as micro-batches, splitting further on out-of-memory.

    Args:
        params: the parameters whose gradients the batch accumulates (a callable, read at each batch,
            so that a swapped optimizer or module is followed).
        model: the module whose normalization statistics a failed attempt is undone in (optional).
        probe_after: after this many steps without an error at a split, try half as many
            micro-batches once (None: never grow back).
        clock: the wall clock for the time lost (a fake one in tests).
        free: frees what a failed attempt left (tests count its calls).
        agree: under several processes, ``agree(failed_here) -> failed_on_any_rank``, called once per
            attempt on every rank (:func:`speedkit.distributed.any_rank`): every rank then redoes the
            batch with the same split in the same step, and none leaves another waiting in a
            collective. The micro-batches' backwards must then make no collective of their own (run
            them under DDP's ``no_sync`` or on the module it wraps) and the gradients be averaged
            after :meth:`run` returns (:func:`speedkit.distributed.average_gradients`).
    """

    params: Callable[[], Iterable[nn.Parameter]]
    model: nn.Module | None = None
    probe_after: int | None = None
    clock: Callable[[], float] = time.perf_counter
    free: Callable[[], None] = free_device_memory
    agree: Callable[[bool], bool] | None = None
    parts: int = 1  # micro-batches per batch now
    events: list[FallbackEvent] = field(default_factory=list)
    _steady: int = 0  # steps since the last change of the split without an error
    _largest_failed: int | None = None  # the smallest micro-batch a probe failed at (never probed again)

    def run(self, batch: Any, step: int, forward_backward: ForwardBackward) -> torch.Tensor | None:
        """Forward and backward of ``batch`` at the current split (more parts on out-of-memory);
        returns the sum of the micro-batches' weighted losses (the batch's mean loss), detached; None
        where ``forward_backward`` skipped a micro-batch, the gradients then as before the batch (a
        step that skips a batch skips all of it)."""
        total = batch_size(batch)
        if total is None:  # nothing to split: run it whole, errors as they come
            return forward_backward(batch, 1.0)
        parts = min(self.parts, total)
        if capturing_cuda_graph():
            # a graph records one split: an out-of-memory error goes to the graph's capture, which runs the
            # step eagerly (split here) and captures again at the new split
            return self._run_as_is(batch, parts, total, forward_backward)
        probing = False
        if self.probe_after is not None and parts > 1 and self._steady >= self.probe_after:
            smaller = max(1, parts // 2)
            if self._largest_failed is None or largest_micro_batch(total, smaller) < self._largest_failed:
                probing, parts = True, smaller
        tried = [largest_micro_batch(total, parts)]
        # a split that has run steps without an error gets one retry as it is first: an error there is as
        # likely a passing one (a fragmented allocator, freed by the retry) as a batch that needs less
        retry = parts == self.parts and self._steady > 0 and not probing
        stash = GradStash([p for p in self.params() if p.requires_grad])
        state = _ModelState(self.model)
        started = self.clock()
        while True:
            failed: str | None = None
            loss: torch.Tensor | None = None
            skipped = False
            try:
                for chunk, n in split_batch(batch, parts):
                    weighted = forward_backward(chunk, n / total)
                    if weighted is None:
                        skipped = True
                        break
                    loss = weighted if loss is None else loss + weighted
            except torch.OutOfMemoryError as exc:
                failed = first_line(exc, "out of memory")[:200]
            if self.agree is not None and self.agree(failed is not None) and failed is None:
                failed = "another rank ran out of memory"
            if failed is None and skipped:
                stash.restore()  # the skipped batch's own gradients dropped
                return None
            if failed is None:
                break
            # outside the except block: the failed attempt's frames, and the tensors they held, are gone
            loss = None
            stash.drop_fresh()
            state.restore()
            self.free()
            old = largest_micro_batch(total, parts)
            if probing:  # the larger micro-batch does not fit: never probed again
                self._largest_failed = old if self._largest_failed is None else min(self._largest_failed, old)
            if retry:
                retry = False
                self.events.append(
                    FallbackEvent(step, old, old, self.clock() - started, "out of memory, retried as it was", failed)
                )
                started = self.clock()
                continue
            if parts >= total:
                stash.restore()
                raise OutOfMemoryAtOneSample(
                    f"out of memory at step {step} with micro-batches of 1 sample (tried "
                    f"{', '.join(str(s) for s in tried)} of a batch of {total}): the model does not fit this device "
                    f"even one sample at a time; use a smaller model or sequence, or more memory"
                ) from None
            parts = min(total, parts * 2)
            tried.append(largest_micro_batch(total, parts))
            self.events.append(
                FallbackEvent(
                    step,
                    old,
                    largest_micro_batch(total, parts),
                    self.clock() - started,
                    "out of memory" + (" (probe)" if probing else ""),
                    failed,
                )
            )
            started = self.clock()
            probing = False
        stash.merge()
        if parts != self.parts:
            if parts < self.parts:
                self.events.append(
                    FallbackEvent(
                        step,
                        largest_micro_batch(total, self.parts),
                        largest_micro_batch(total, parts),
                        0.0,
                        "probe",
                        f"{self.probe_after} steps without an error: fewer micro-batches",
                    )
                )
            self.parts, self._steady = parts, 0
        else:
            self._steady += 1
        assert loss is not None
        return loss

    def _run_as_is(self, batch: Any, parts: int, total: int, forward_backward: ForwardBackward) -> torch.Tensor | None:
        """The batch at ``parts`` micro-batches, errors raised as they come (no retry, no split)."""
        loss: torch.Tensor | None = None
        for chunk, n in split_batch(batch, parts):
            weighted = forward_backward(chunk, n / total)
            if weighted is None:
                return None
            loss = weighted if loss is None else loss + weighted
        return loss

    @property
    def steady_steps(self) -> int:
        """Steps run without an error since the split last changed (a probe waits for ``probe_after``)."""
        return self._steady

    @property
    def largest_failed(self) -> int | None:
        """The smallest micro-batch a probe failed at (never probed again), or None."""
        return self._largest_failed

    def restore(
        self, parts: int, *, steady_steps: int = 0, largest_failed: int | None = None, events: Sequence[Any] = ()
    ) -> None:
        """Take up a split decided earlier (a resumed run): ``parts`` micro-batches, the probe's count and
        the size it failed at, the splits so far (:class:`FallbackEvent` or their ``asdict``)."""
        self.parts = max(1, int(parts))
        self._steady = max(0, int(steady_steps))
        self._largest_failed = int(largest_failed) if largest_failed is not None else None
        self.events = [e if isinstance(e, FallbackEvent) else FallbackEvent(**e) for e in events]

    @property
    def micro_batch_note(self) -> str:
        """The split now, in words (for a report line)."""
        return f"{self.parts} micro-batch{'es' if self.parts > 1 else ''} a batch"

    def report(self) -> dict[str, Any]:
        """The fallback's record for the report: the split now and every change."""
        return {"micro_batches": self.parts, "events": [asdict(e) for e in self.events]}


@contextlib.contextmanager
def stop_on_out_of_memory(where: str, batcher: MicroBatcher) -> Iterator[None]:
    """Out-of-memory inside the block (the optimizer step: its state and update do not shrink with
    the micro-batch) stops the run with one line naming where and the micro-batches in use."""
    failed: str | None = None
    try:
        yield
    except torch.OutOfMemoryError as exc:
        failed = first_line(exc, "out of memory")[:200]
    if failed is not None:
        batcher.free()
        sizes = ", ".join(e.describe() for e in batcher.events) or "no split before it"
        raise OutOfMemoryAtOneSample(
            f"out of memory in {where} ({failed}); smaller micro-batches cannot help there, the optimizer's state "
            f"and update do not shrink with them ({batcher.parts} micro-batch(es) per batch; {sizes}); free memory "
            "(a smaller model, an optimizer with less state, or more memory)"
        )
