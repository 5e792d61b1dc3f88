"""A forked child (a DataLoader worker) never frees objects it inherited from the training process:
a CUDA object freed in a forked process aborts it (speedkit.fork_safety)."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from speedkit.fork_safety import collect_garbage, protect_forked_children

fork_only = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork")


class _Cycle:
    """Garbage with a finalizer: in a reference cycle, freed only by the cyclic collector."""

    def __init__(self, on_free) -> None:
        self.me, self.on_free = self, on_free

    def __del__(self) -> None:
        self.on_free()


@fork_only
def test_a_forked_child_leaves_inherited_garbage_to_the_parent():
    read, write = os.pipe()
    freed_in: list[int] = []
    assert protect_forked_children() and protect_forked_children()  # idempotent
    gc.disable()  # the garbage must still be there when the child is forked
    try:
        _Cycle(lambda: os.write(write, b"x") if os.getpid() != parent else freed_in.append(parent))
        parent = os.getpid()
        child = os.fork()
        if child == 0:  # the child collects everything it can, then reports whether the finalizer ran
            try:
                gc.collect()
                os.write(write, b"done")
            finally:
                os._exit(0)
        os.waitpid(child, 0)
        os.close(write)
        assert os.read(read, 100) == b"done"  # no "x": the child never ran the parent's finalizer
        assert collect_garbage() > 0 and freed_in == [parent]  # the parent frees it, here
    finally:
        gc.enable()
        os.close(read)


class _CollectsInWorkers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        gc.collect()  # what allocations in a real dataset trigger sooner or later
        return torch.tensor(float(i))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@fork_only
def test_loader_workers_survive_cuda_events_left_in_garbage():
    """A CUDA event in cyclic garbage when a plain DataLoader forks its workers (as speedkit's
    prefetchers and sessions can leave one): without protection the worker that collects it
    aborts ("CUDA error: initialization error" in the event's destructor; seen on an H100)."""
    from speedkit.data.prefetch import DevicePrefetcher

    list(DevicePrefetcher(iter([torch.ones(2)]), "cuda"))  # speedkit used on CUDA: children protected
    gc.disable()
    try:
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # made now (an event is created lazily): freeing it calls into CUDA
        event.synchronize()
        _Cycle(lambda: None).event = event
        del event
        loader = torch.utils.data.DataLoader(_CollectsInWorkers(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        assert torch.cat(list(loader)).tolist() == [float(i) for i in range(8)]
    finally:
        gc.enable()
        collect_garbage()
