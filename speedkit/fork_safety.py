"""Keep forked children (DataLoader workers) from freeing the parent's CUDA objects.

A DataLoader with workers forks the training process. The child inherits every Python object of
the parent, garbage not yet collected included. When the child's cyclic garbage collector frees an
inherited ``torch.cuda.Event`` (or anything whose destructor calls into CUDA), the call fails, as
CUDA cannot be used in a forked process, inside a destructor, and the worker aborts ("DataLoader
worker is killed by signal: Aborted"). speedkit makes such objects (timing events, side streams,
prefetchers, measurement sessions), and some end up in reference cycles; seen on an H100 as a
later, plain fit in the same process losing a worker.

Two measures, both taken once speedkit runs on CUDA in a process:
- :func:`protect_forked_children`: every process forked from then on freezes the objects it
  inherits (``gc.freeze()`` right after the fork), so its collector never frees the parent's
  objects. Its own objects are collected as usual; what it inherited is the parent's to free (the
  memory is shared copy-on-write, so a worker that never frees it also copies fewer pages).
- :func:`collect_garbage`: after speedkit lets go of what it made (a fit's teardown), the parent
  collects at once, so the objects are freed in the process that made them.
"""

from __future__ import annotations

import gc
import os

_protected = False


def protect_forked_children() -> bool:
    """From now on, each process forked from this one starts with ``gc.freeze()``. Idempotent;
    False where the platform cannot fork (nothing to protect)."""
    global _protected
    if _protected:
        return True
    if not hasattr(os, "register_at_fork"):
        return False
    os.register_at_fork(after_in_child=gc.freeze)
    _protected = True
    return True


def collect_garbage() -> int:
    """Collect cyclic garbage now, in this process (see the module's docstring); the number of
    unreachable objects found."""
    return gc.collect()


__all__ = ["collect_garbage", "protect_forked_children"]
