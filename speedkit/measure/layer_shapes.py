"""The input shapes of the norms, Linear layers and gated MLPs' activations in a model, recorded in one
eager pass (the baseline's counted forward and backward): what :mod:`speedkit.kernels.choice` measures a
norm's kernel at before ``torch.compile`` traces the step (inside a trace there is nothing eager to look
at), a SwiGLU's or GeGLU's gate (its activation's input) likewise, and the tokens per GEMM that the
``float8`` rung's per-shape prior reads.

:func:`recording` hooks every ``nn.LayerNorm`` / ``nn.RMSNorm`` / ``nn.Linear`` / ``nn.SiLU`` (their
subclasses included), and the modules ``also`` picks (the baseline: every SiLU and GELU, a library's own
module that computes one too, :func:`speedkit.kernels.recognise.gates`), for the length of a ``with``
block and yields what they were fed: ``{id(module): [(shape, dtype), ...]}``, each distinct input once,
in the order seen. The hooks are removed when the block ends. :func:`tokens` reads a Linear's GEMM rows
(M) from such a record.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: the key of the recorded inputs in ``TrainState.notes``
NOTE = "layer_shapes"
#: the modules whose inputs are recorded
RECORDED = (nn.LayerNorm, nn.RMSNorm, nn.Linear, nn.SiLU)
#: what a module was fed: its input's shape and dtype
Fed = tuple[tuple[int, ...], torch.dtype]


@contextmanager
def recording(
    model: nn.Module, when: bool = True, also: Callable[[nn.Module], bool] | None = None
) -> Iterator[dict[int, list[Fed]]]:
    """Record the inputs of ``model``'s modules of :data:`RECORDED`'s classes, and of those ``also`` picks,
    while the block runs (see the module doc); nothing (an empty record) unless ``when``."""
    seen: dict[int, list[Fed]] = {}
    if not when:
        yield seen
        return

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            fed = (tuple(args[0].shape), args[0].dtype)
            inputs = seen.setdefault(id(module), [])
            if fed not in inputs:
                inputs.append(fed)

    hooks = [
        m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, RECORDED) or (also is not None and also(m))
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def tokens(fed: list[Fed]) -> list[int]:
    """The rows of each GEMM a Linear ran with these inputs: every dimension but the last, multiplied."""
    return [math.prod(shape[:-1]) for shape, _ in fed]
