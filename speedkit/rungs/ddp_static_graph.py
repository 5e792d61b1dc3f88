"""ddp_static_graph: tell DDP the training graph is the same every step (``static_graph=True``).

Speeds up: DDP's bookkeeping per step, modestly: after the first step DDP knows which parameters get
gradients and in which order, and skips the per-step checks for unused ones. (Its large gain, no graph
search every step, is over ``find_unused_parameters=True``, which the rung leaves alone; see below.)
It also lets DDP train a parameter used twice in a step (reentrant activation checkpointing).
Does not help: one process; steps whose all-reduce already hides behind the backward.
Needs: DDP on several processes, ``static_graph`` left unset, and the same graph every step: the same
parameters get gradients every step. The rung cannot see that ahead: a parameter used in some steps
only (a branch on the data, an auxiliary loss every N steps) makes DDP raise "Your training graph has
changed in this iteration" at the first step that differs. A strategy with
``find_unused_parameters=True`` expects such parameters, and the rung leaves it alone. No gradient
accumulation: under ``no_sync`` a static graph fails on its first step or silently stops all-reducing
(pytorch/pytorch#143580).
Numerics: unchanged. The same sums; the first step's all-reduce runs after its backward.
In trials its first step runs through DDP even inside guarded parity steps: a backward beside DDP
before then leaves it all-reducing nothing later (``compat.ddp_static_graph_pending``).
"""

from __future__ import annotations

from typing import Any

from speedkit.rungs.ddp_knob import DDPKnobRung
from speedkit.training.state import TrainState


class DDPStaticGraphRung(DDPKnobRung):
    name = "ddp_static_graph"
    # the reducer's per-step checks (host work) around the all-reduces
    targets = ("communication", "host")
    knob = "static_graph"

    def value(self) -> Any:
        return True

    def why_not(self, options: dict[str, Any], state: TrainState) -> str | None:
        if options.get("find_unused_parameters"):
            return (
                "the strategy sets find_unused_parameters=True: which parameters a step uses may change, and "
                "static_graph=True needs the same ones every step"
            )
        accumulate = state.step.accumulate
        if accumulate > 1:
            return (
                f"the step accumulates gradients over {accumulate} micro-batches (DDP's no_sync), which static_graph=True "
                "breaks: DDP fails on the first step or stops all-reducing (pytorch/pytorch#143580, #187732)"
            )
        return None
