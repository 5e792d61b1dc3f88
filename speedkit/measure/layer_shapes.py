"""The input shapes of the norms in a model, recorded in one eager pass (the baseline's counted
forward and backward): what :mod:`speedkit.kernels.choice` measures a kernel at before
``torch.compile`` traces the step (inside a trace there is nothing eager to look at).

:func:`recording` hooks every ``nn.LayerNorm`` / ``nn.RMSNorm`` (their speedkit classes included) for
the length of a ``with`` block and yields what they were fed: ``{id(module): [(shape, dtype), ...]}``,
each distinct input once, in the order seen. The hooks are removed when the block ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: the key of the recorded inputs in ``TrainState.notes``
NOTE = "layer_shapes"
#: what a norm was fed: its input's shape and dtype
Fed = tuple[tuple[int, ...], torch.dtype]


@contextmanager
def recording(model: nn.Module, when: bool = True) -> Iterator[dict[int, list[Fed]]]:
    """Record the inputs of ``model``'s norms while the block runs (see the module doc); nothing
    (an empty record) unless ``when``."""
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

    hooks = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()
