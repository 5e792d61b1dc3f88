"""The host syncs a training step makes, each named with its source line.

A host sync (``.item()``, ``.cpu()``, ``bool(tensor)``, a ``nonzero``) makes the host wait until the
GPU has finished everything queued so far: the GPU then idles while the host issues the next work,
and a profile shows it as ``host_idle``. :func:`find_host_syncs` runs one step under CUDA's sync
debug mode (:func:`speedkit.cudagraph.step_watch.find_syncs`) and names each synchronizing line, library
code included. Example: Lightning's demo Transformer (``nn.Transformer``) makes one sync per step in
its causal-mask check (``_detect_is_causal_mask`` compares the mask with a freshly built causal one and reads the
answer on the host).

Sync detection needs CUDA's sync debug mode: on CPU there is nothing to wait for and the list is empty.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from speedkit.cudagraph.step_watch import find_syncs


def find_host_syncs(run_one: Callable[[], Any], device: torch.device | str) -> list[dict[str, Any]]:
    """Run one step (``run_one()``) and list its host syncs, most first: ``{"where": "file:line in fn",
    "code": the source line, "reason": what reached it, "count": syncs found at that line in the step}``.

    ``count`` is the number of synchronizing calls the line made in the step (a line run in a loop
    counts each time). On CPU: ``[]``, without running the step.
    """
    if torch.device(device).type != "cuda":
        return []
    _, blockers = find_syncs(run_one, unique=False)
    counts = Counter(blocker.where for blocker in blockers)
    first = {}
    for blocker in blockers:
        first.setdefault(blocker.where, blocker)
    return [
        {"where": short_path(where), "file": where, "code": first[where].code, "reason": first[where].reason, "count": count}
        for where, count in sorted(counts.items(), key=lambda item: -item[1])
    ]


def short_path(where: str) -> str:
    """``.../site-packages/torch/nn/modules/transformer.py:1252 in f`` -> ``torch/nn/modules/transformer.py:1252 in f``:
    an installed package's file from its package folder (the full path stays in ``file``)."""
    marker = "site-packages/"
    return where.rsplit(marker, 1)[1] if marker in where else where
