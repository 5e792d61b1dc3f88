"""fsdp_reshard: FSDP2 keeps each block's gathered parameters from its forward to its backward (``reshard_after_forward=False``).

Speeds up: a sharded step whose all-gathers show: FSDP2 by default frees each block's gathered
parameters after its forward and gathers them again for its backward; kept, the backward gathers
nothing, one all-gather a block a step instead of two (ZeRO-2 instead of ZeRO-3).
Does not help: a step whose all-gathers already hide behind its compute (NVLink between two GPUs, a
large micro-batch).
Costs: memory: every block's unsharded parameters stay on the device through the forward to their
backward, the whole model gathered at the forward's end, less this rank's shard of it.
Needs: the model sharded block by block with FSDP2's ``fully_shard`` on several processes, some block
resharding after its forward (FSDP2's default), and room for the gathered model: the rung refuses where
the device's free memory is under it.
Numerics: unchanged. The same parameters, gathered once instead of twice.

Set through FSDP2's own ``set_reshard_after_forward(False)`` on every sharded module; undo puts each
module's setting back as it was (the root's "auto" default included, through ``compat``).
"""

from __future__ import annotations

import torch
from torch import nn

from speedkit import compat
from speedkit.rungs.base import Handle
from speedkit.rungs.fsdp_knob import FSDP2Rung
from speedkit.training.state import TrainState

GIB = 1024**3


def held_bytes(modules: list[nn.Module], world: int) -> int:
    """The memory that keeping every resharding module's parameters gathered from forward to backward
    adds at the forward's end: their unsharded size, less this rank's shard."""
    return sum(compat.fsdp2_unsharded_bytes(m) for m in modules if compat.fsdp2_resharded_after_forward(m)) * (world - 1) // world


class FSDPReshardRung(FSDP2Rung):
    name = "fsdp_reshard"
    # the backward's all-gathers, and the host's work issuing each (its copy-in, the collective, its
    # copy-out and FSDP's hooks around them: on two H200s a 1.1B Llama's FSDP2 step was host-bound)
    targets = ("communication", "host")
    cuts_host_work = True

    def why_not(self, modules: list[nn.Module], state: TrainState) -> str | None:
        if not any(compat.fsdp2_resharded_after_forward(m) for m in modules):
            return "no sharded module frees its parameters after its forward (reshard_after_forward=False already)"
        if state.device.type == "cuda":
            needed = held_bytes(modules, state.step.world_size())
            free, _ = torch.cuda.mem_get_info(state.device)
            if needed > free:
                return (
                    f"keeping the gathered parameters to the backward would hold {needed / GIB:.1f} GiB more, "
                    f"and the device has {free / GIB:.1f} GiB free"
                )
        return None

    def apply(self, state: TrainState) -> Handle:
        model = state.model
        saved = compat.fsdp2_reshard_after_forward(model)
        modules = compat.fsdp2_modules(model)

        def keep() -> None:
            for m in modules:
                m.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]

        n = sum(1 for m in modules if compat.fsdp2_resharded_after_forward(m))
        held = held_bytes(modules, state.step.world_size())
        keep()
        handle = Handle(self.name)
        handle.record(
            f"{n} sharded modules keep their gathered parameters to the backward (about {held / GIB:.2f} GiB held)",
            lambda: compat.fsdp2_restore_reshard_after_forward(model, saved),
            keep,
        )
        return handle
