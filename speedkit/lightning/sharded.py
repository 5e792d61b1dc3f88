"""Lightning's sharding strategies: which one a fit runs, and what that changes for the trials.

``ModelParallelStrategy`` (FSDP2: the user's ``configure_model`` calls ``fully_shard``, parameters are
DTensors, each rank holding its shard) and ``FSDPStrategy`` (FSDP1: the module wrapped in
``FullyShardedDataParallel``). Under either, the gradients are reduced inside the backward by FSDP's
own hooks, so a trial step runs the strategy's step as it is: the DDP guard (each micro-batch's
backward outside the wrapper, the gradients averaged by hand) does not apply, and no switch takes the
reduction out of a step to time it alone. The snapshot saves and restores each rank's shards
(:mod:`speedkit.training.snapshot`).
"""

from __future__ import annotations

from typing import Any


def sharding(strategy: Any) -> str | None:
    """What shards the fit's module: "FSDP2 (ModelParallelStrategy)", "FSDP (FSDPStrategy)", or None."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return "FSDP2 (ModelParallelStrategy)"
    if isinstance(strategy, FSDPStrategy):
        return "FSDP (FSDPStrategy)"
    return None
