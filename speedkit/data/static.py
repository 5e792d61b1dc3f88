"""Static batch buffers: device tensors allocated once and refilled in place with ``copy_``.

A CUDA graph replays kernels on fixed addresses, so the batch it reads must live in the same
tensors every step. :class:`StaticBatch` allocates them from the first batch it sees (lists,
tuples, named tuples, dicts and dataclasses of tensors; other leaves are kept as they are) and
fills them from each new batch. A batch that does not fit (a short last batch, another dtype, a
changed non-tensor leaf) is refused (``fill`` returns None) and counted: the caller runs that batch
another way, so a buffer never serves a stale or partial sample.
"""

from __future__ import annotations

from typing import Any

import torch

from speedkit.data.batch import batch_leaves, map_batch


def signature(batch: Any) -> Any:
    """What a batch must match to be copied into buffers made for another: the structure, each
    tensor's shape, dtype and device, and each other leaf's value."""
    structure = map_batch(lambda leaf: None, batch)
    return repr(structure), tuple(
        (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else ("leaf", repr(t)) for t in batch_leaves(batch)
    )


class StaticBatch:
    """Device buffers shaped like the first batch; ``fill`` copies a batch into them.

    Attributes:
        batch: the buffers, in the batch's own structure (what a captured step reads).
        filled: batches copied in; ``refused``: batches that did not fit, with the first reason.
    """

    def __init__(self, example: Any) -> None:
        self._signature = signature(example)
        self.batch = map_batch(lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, example)
        self._buffers = [t for t in batch_leaves(self.batch) if isinstance(t, torch.Tensor)]
        self.filled = 0
        self.refused = 0
        self.refused_reason: str | None = None

    def fits(self, batch: Any) -> str | None:
        """None when ``batch`` can be copied into the buffers; else why not."""
        sig = signature(batch)
        if sig == self._signature:
            return None
        if sig[0] != self._signature[0]:
            return "the batch's structure differs from the first batch's"
        for got, want in zip(sig[1], self._signature[1]):
            if got != want:
                if got[0] != "leaf" and want[0] != "leaf" and got[1:] == want[1:]:
                    return f"a tensor of shape {list(got[0])} where the buffers hold {list(want[0])} (a short last batch?)"
                return f"a leaf {got} where the buffers hold {want}"
        return "the batch differs from the first batch"

    def fill(self, batch: Any) -> Any | None:
        """Copy ``batch`` into the buffers and return them; None (and counted) when it does not fit."""
        reason = self.fits(batch)
        if reason is not None:
            self.refuse(reason)
            return None
        return self.copy_in(batch)

    def refuse(self, reason: str) -> None:
        """Count a batch that runs outside the buffers, ``reason`` being :meth:`fits`' answer."""
        self.refused += 1
        self.refused_reason = self.refused_reason or reason

    def copy_in(self, batch: Any) -> Any:
        """Copy ``batch``, which :meth:`fits`, into the buffers and return them."""
        sources = [t for t in batch_leaves(batch) if isinstance(t, torch.Tensor)]
        for buffer, source in zip(self._buffers, sources):
            if buffer is not source:
                buffer.copy_(source, non_blocking=True)
        self.filled += 1
        return self.batch

    def report(self) -> str:
        line = f"static batch buffers: {len(self._buffers)} tensors, {self.nbytes / 2**20:.1f} MiB, filled {self.filled} times"
        if self.refused:
            line += f"; {self.refused} batches ran outside them ({self.refused_reason})"
        return line

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers)
