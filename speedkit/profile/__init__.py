"""Where a training step's time goes: short profiled windows, broken down by category.

:func:`profile_window` runs a few optimizer steps under ``torch.profiler`` and returns a
:class:`ProfileWindow`: ms per step in each of :data:`CATEGORIES` (data wait, host-bound idle GPU,
GEMM, attention, normalization, elementwise, loss, optimizer, memcpy, communication, other), the
device's busy fraction, the longest ops and, if asked, a gzipped Chrome/Perfetto trace.
:func:`categorize` is the one table that puts a kernel or op name in a category.
:func:`find_host_syncs` names the lines of a step that make the host wait for the GPU (CUDA only).
Profiling costs time: these windows explain a step, timed windows (``speedkit.measure``) time it.
Profiler trouble raises :class:`ProfileUnavailable`; callers catch it and go on without a breakdown.
"""

from __future__ import annotations

from speedkit.profile.categories import CATEGORIES, CATEGORY_LABELS, categorize
from speedkit.profile.syncs import find_host_syncs
from speedkit.profile.window import ProfileUnavailable, ProfileWindow, profile_window

__all__ = [
    "CATEGORIES",
    "CATEGORY_LABELS",
    "ProfileUnavailable",
    "ProfileWindow",
    "categorize",
    "find_host_syncs",
    "profile_window",
]
