"""fsdp_prefetch: FSDP2 gathers the next two blocks' parameters ahead, in the forward and in the backward (explicit prefetching).

Speeds up: a sharded step whose all-gathers wait on each other: by default FSDP2 issues a block's
all-gather when the block before it runs (one ahead, and in the forward only as far as the host runs
ahead); told to prefetch two, the all-gathers of the blocks after the next are on their way while the
next one computes, which hides a slow or latency-bound gather (many small blocks, a slow link).
Does not help: a step whose all-gathers already hide (two GPUs on NVLink, large blocks).
Costs: memory: up to two more blocks' gathered parameters at a time.
Needs: the model sharded block by block with FSDP2's ``fully_shard`` (a repeated block class, as a
transformer's layers) on several processes, and no prefetching of the user's.
Numerics: unchanged. The same all-gathers, issued earlier.

The blocks are taken in module order, the order in which a list of layers runs; set through FSDP2's own
``set_modules_to_forward_prefetch`` and ``set_modules_to_backward_prefetch``; undo empties the lists
again (FSDP2's implicit prefetching).
"""

from __future__ import annotations

from torch import nn

from speedkit import compat
from speedkit.rungs.base import Handle
from speedkit.rungs.fsdp_knob import FSDP2Rung, sharded_blocks
from speedkit.training.state import TrainState

#: how many blocks ahead each one gathers (torchtitan's choice, and what FSDP2's docs call "more aggressive")
AHEAD = 2


class FSDPPrefetchRung(FSDP2Rung):
    name = "fsdp_prefetch"
    targets = ("communication",)

    def why_not(self, modules: list[nn.Module], state: TrainState) -> str | None:
        blocks = sharded_blocks(state.model)
        if len(blocks) <= AHEAD:
            return f"{len(blocks)} repeated sharded blocks: FSDP2's own one-ahead prefetch covers them"
        for m in modules:
            forward, backward = compat.fsdp2_prefetch(m)
            if forward or backward:
                return "the model sets FSDP2's prefetching itself (set_modules_to_forward/backward_prefetch)"
        return None

    def apply(self, state: TrainState) -> Handle:
        blocks = sharded_blocks(state.model)
        saved = [(b, *compat.fsdp2_prefetch(b)) for b in blocks]

        def prefetch() -> None:
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + AHEAD])  # type: ignore[operator]
                block.set_modules_to_backward_prefetch(blocks[max(0, i - AHEAD) : i][::-1])  # type: ignore[operator]

        def restore() -> None:
            for block, forward, backward in saved:
                compat.fsdp2_set_prefetch(block, forward, backward)

        prefetch()
        handle = Handle(self.name)
        handle.record(
            f"{len(blocks)} sharded {type(blocks[0]).__name__} blocks gather the next {AHEAD} ahead, forward and backward",
            restore,
            prefetch,
        )
        return handle
