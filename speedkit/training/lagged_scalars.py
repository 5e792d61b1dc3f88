"""Read per-step scalars (a logged loss) from the GPU without waiting for it.

``tensor.item()`` on a CUDA tensor waits until every kernel queued before it has run: once per
step, that keeps the host from queueing the next step while the GPU runs this one, and the host's
own work (the data path, Python between launches) adds to the step instead of overlapping it.
:class:`LaggedScalars` instead starts a copy of the value into pinned host memory behind the step's
kernels and hands back, for each name, the newest value whose copy has finished: a step or two
late, with no wait. At most ``lag`` copies per name are outstanding; past that the oldest is
waited for (the host never runs more than ``lag`` steps ahead because of it). :meth:`flush` waits
for every copy and gives the exact latest values.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

#: a started copy: the host tensor it fills, whether it is done (without waiting), wait for it
Copy = tuple[torch.Tensor, Callable[[], bool], Callable[[], None]]


def cuda_copy(value: torch.Tensor) -> Copy:
    """Copy one CUDA scalar into pinned host memory on the current stream, behind the kernels that
    make it; an event records when it is done."""
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value.detach(), non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done.query, done.synchronize


def _same(held: torch.Tensor | None, value: torch.Tensor) -> bool:
    """Whether ``value`` is ``held`` again (Lightning hands out a new detached view of the same tensor
    at every read). ``held`` keeps its memory alive, so no new tensor can have its address."""
    return (
        held is not None and held.data_ptr() == value.data_ptr() and held._version == value._version and held.dtype == value.dtype
    )


class LaggedScalars:
    """Per-name scalars read without a host sync (see the module docstring).

    Args:
        lag: copies per name that may be outstanding before the oldest is waited for (>= 1).
        start_copy: starts a copy of a device scalar (:func:`cuda_copy`; tests give a fake).
        devices: the device types whose values are copied; any other value is read at once.
    """

    def __init__(
        self, lag: int = 2, start_copy: Callable[[torch.Tensor], Copy] = cuda_copy, devices: tuple[str, ...] = ("cuda",)
    ) -> None:
        if lag < 1:
            raise ValueError(f"lag must be >= 1, found {lag}")
        self.lag = lag
        self.start_copy, self.devices = start_copy, devices
        self.pending: dict[str, collections.deque[Copy]] = collections.defaultdict(collections.deque)
        self.latest: dict[str, float | int | bool] = {}
        self.source: dict[str, torch.Tensor] = {}  # the tensor each name's newest copy was started from
        self.reads = 0  # values asked for (copied or read at once)
        self.waits = 0  # copies waited for because more than `lag` were outstanding

    def read(self, name: str, value: torch.Tensor) -> float | int | bool | None:
        """The newest finished value of ``name`` after starting a copy of ``value`` (once per tensor:
        Lightning reads the same step's values again for the bar); None while no copy of ``name`` has
        finished yet. A value on another device than ``devices`` is read at once."""
        self.reads += 1
        if value.device.type not in self.devices:
            self.latest[name] = value.item()
            return self.latest[name]
        queue = self.pending[name]
        if not _same(self.source.get(name), value):  # read again within a step (the bar after the loop): no new copy
            self.source[name] = value
            queue.append(self.start_copy(value))
        self.waits += self._drain(name, queue, self.lag)
        return self.latest.get(name)

    def flush(self) -> dict[str, float | int | bool]:
        """Wait for every outstanding copy; the exact latest value of every name."""
        for name, queue in self.pending.items():
            self._drain(name, queue, 0)
        self.source.clear()
        return dict(self.latest)

    def _drain(self, name: str, queue: collections.deque[Copy], keep: int) -> int:
        """Take ``name``'s finished copies, then wait for the oldest until at most ``keep`` are
        outstanding; how many were waited for."""
        while queue and queue[0][1]():
            self.latest[name] = queue.popleft()[0].item()
        waited = 0
        while len(queue) > keep:
            host, _, wait = queue.popleft()
            wait()
            waited += 1
            self.latest[name] = host.item()
        return waited

    def convert(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with every one-element tensor read through :meth:`read`; names with no finished
        value yet are left out (a progress bar keeps showing what it showed). Anything else is
        passed on as it is."""
        out: dict[str, Any] = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                read = self.read(name, value)
                if read is not None:
                    out[name] = read
            else:
                out[name] = value
        return out


__all__ = ["Copy", "LaggedScalars", "cuda_copy"]
