"""activation_checkpointing: recompute each repeated block's activations in the backward instead of keeping them (``torch.utils.checkpoint``, non-reentrant).

Speeds up: nothing by itself: it frees memory (the activations inside every block, kept only at the
blocks' boundaries) and costs a second forward of each block in the backward. It pays with what the
memory buys: a larger micro-batch (``micro_batch`` merges more of an accumulation's micro-batches into
one when the activations shrink; ``speedkit sweep`` finds the batch that now fits), or a model that
fits at all. The ladder judges it alone on memory (kept where it frees memory and is not slower) and,
as it is slower alone, again with ``micro_batch`` in its second look.
Does not help: a step with memory to spare and no accumulation to merge.
Costs: about one more forward of the blocks per step (a third more arithmetic for a transformer).
Needs: gradient accumulation (the micro-batches the freed memory merges; ``without_accumulation``, which
``speedkit sweep`` sets, applies it without); a model built of repeated blocks (a ``ModuleList`` of one block class, as a transformer's layers;
under FSDP2 the blocks ``fully_shard`` sharded one by one), none checkpointed already (the library's
own switch, a ``checkpoint_wrapper``).
Numerics: unchanged. The recomputation runs the same ops, dropout with the random state of the forward
(``preserve_rng_state``).

Each block's ``forward`` is replaced (an instance attribute, the way compile replaces it; undo removes
it) by one that runs the block's own forward through ``torch.utils.checkpoint.checkpoint`` while
gradients are on; under FSDP2 that is inside FSDP's hooks, so each block is gathered once for its forward
and once for its backward's recomputation, as ``checkpoint_wrapper`` applied before ``fully_shard``
(torchtitan's order) does. It goes in beneath compile, which then compiles the checkpointed forward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speedkit.handle import AttributeWrapper
from speedkit.rungs.base import Handle, Rung, set_attr
from speedkit.rungs.fsdp_knob import sharded_blocks
from speedkit.training.state import TrainState


class CheckpointedForward(AttributeWrapper):
    """A block's forward run through ``torch.utils.checkpoint`` while gradients are on (eval and
    no-grad passes run it as it is)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.wrapped(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(self.wrapped, *args, use_reentrant=False, **kwargs)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a model repeats: FSDP2's sharded blocks where it has some, else the entries of its
    largest ``ModuleList`` whose entries are all of one class (two or more) and hold parameters."""
    sharded = sharded_blocks(model)
    if sharded:
        return sharded
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len(Counter(type(b) for b in m)) == 1:
            if any(True for _ in m[0].parameters()) and len(m) > len(best):
                best = list(m)
    return best


def _checkpointed_already(block: nn.Module) -> str | None:
    if getattr(block, "gradient_checkpointing", False):
        return "the model checkpoints its blocks already (the library's own switch, gradient_checkpointing)"
    if type(block).__name__ == "CheckpointWrapper" or isinstance(block.__dict__.get("forward"), CheckpointedForward):
        return "the model's blocks are wrapped in a checkpoint already"
    return None


@dataclass
class ActivationCheckpointingOptions:
    """Options of the activation_checkpointing rung."""

    #: apply where the run accumulates no gradients too: set by ``speedkit sweep``, which measures a
    #: micro-batch that fits only with the blocks checkpointed (the batch is what it chooses)
    without_accumulation: bool = False


class ActivationCheckpointingRung(Rung):
    name = "activation_checkpointing"
    Options = ActivationCheckpointingOptions
    targets = ("memory",)
    recompiles = True  # beneath a kept compile, its trial compiles the checkpointed forward anew
    # alone it is slower by its recomputation; with the micro-batch its memory buys it may pay
    partners = ("micro_batch",)

    def check(self, state: TrainState) -> str | None:
        if state.step.accumulate <= 1 and not self.options.without_accumulation:
            return (
                "the run accumulates no gradients: no micro-batches for the freed memory to merge (a larger batch "
                "changes the effective batch: `speedkit sweep --change-effective-batch`)"
            )
        blocks = repeated_blocks(state.model)
        if not blocks:
            return "no repeated blocks (a ModuleList of one block class, or FSDP2's sharded blocks) to checkpoint"
        for block in blocks:
            reason = _checkpointed_already(block)
            if reason is not None:
                return reason
        return None

    def apply(self, state: TrainState) -> Handle:
        blocks = repeated_blocks(state.model)
        handle = Handle(self.name)
        for block in blocks:
            set_attr(handle, block, "forward", CheckpointedForward(block.forward), "")
        handle.record(
            f"{len(blocks)} {type(blocks[0]).__name__} blocks recompute their activations in the backward "
            "(torch.utils.checkpoint, non-reentrant)"
        )
        return handle
