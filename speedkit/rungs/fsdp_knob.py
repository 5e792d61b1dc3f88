"""The base of the rungs that set one of FSDP2's choices on a model ``fully_shard`` sharded
(``fsdp_mixed_precision``, ``fsdp_reshard``, ``fsdp_prefetch``): whether the run shards with FSDP2 on
several processes, and which of its sharded modules are the repeated blocks (the layers of a
transformer, each sharded on its own: what FSDP2 gathers, prefetches and frees one at a time).

Lightning's ``ModelParallelStrategy`` runs the user's ``configure_model``, where ``fully_shard`` is
called, as the fit starts: the rungs apply then (``lightning_stage = "fit_start"``), never before.
Lightning's ``FSDPStrategy`` (FSDP1, ``FullyShardedDataParallel``) fixes these choices when it wraps the
module: the rungs say so and leave it.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

from torch import nn

from speedkit import compat
from speedkit.rungs.base import Rung
from speedkit.training.state import TrainState


def sharded_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` sharded one by one whose class repeats (two or more of it), in module
    order, which for a model's list of layers is the order its forward runs them."""
    modules = compat.fsdp2_modules(model)
    counts = Counter(type(m) for m in modules)
    return [m for m in modules if counts[type(m)] >= 2]


class FSDP2Rung(Rung):
    """A rung over FSDP2's sharded modules; ``needs_ranks``: it only matters across several processes."""

    lightning_stage = "fit_start"  # after configure_model ran fully_shard
    needs_ranks: ClassVar[bool] = True

    def check(self, state: TrainState) -> str | None:
        modules = compat.fsdp2_modules(state.model)
        if not modules:
            return self.not_sharded(state)
        world = state.step.world_size()
        if self.needs_ranks and world <= 1:
            return f"FSDP2 on one process gathers nothing: world size {world}"
        return self.why_not(modules, state)

    @staticmethod
    def not_sharded(state: TrainState) -> str:
        """Why a model without FSDP2's modules gives the rung nothing (FSDP1's wrapper named)."""
        if any(type(m).__name__ == "FullyShardedDataParallel" for m in state.model.modules()):
            return "the model is wrapped by FSDP1 (FSDPStrategy), which fixes this choice when it wraps the module"
        return "the model is not sharded with FSDP2's fully_shard (Lightning's ModelParallelStrategy)"

    def why_not(self, modules: list[nn.Module], state: TrainState) -> str | None:
        """Why the rung would change nothing on these FSDP2 modules (None: it applies)."""
        return None
