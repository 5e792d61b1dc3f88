"""ddp_bucket_view: DDP's gradients as views into its all-reduce buckets (``gradient_as_bucket_view=True``).

Speeds up: DDP training on several processes: the backward writes each gradient where DDP all-reduces
it, so a gradient-sized copy per step goes, and a gradient-sized block of memory with it (GPT-2 small:
124M fp32 gradients, 0.5 GB a process).
Does not help: one process (there is no DDP); steps where copying the gradients is a negligible share.
Needs: DDP on several processes (Lightning's ``strategy="ddp"``, ``"ddp_spawn"``...), the strategy's
``gradient_as_bucket_view`` left unset; no code that detaches ``param.grad`` in place (``grad.detach_()``
fails on a view).
Numerics: unchanged. The same sums in the same buckets.

Before Lightning wraps the model (``SpeedLadder(rungs=[...])`` applies it at ``setup``) the rung sets
what the strategy wraps with; after (trials), the step wraps the same module anew and the undo puts the
previous wrapper back (:mod:`speedkit.lightning.ddp`).
"""

from __future__ import annotations

from typing import Any

from speedkit.rungs.ddp_knob import DDPKnobRung


class DDPBucketViewRung(DDPKnobRung):
    name = "ddp_bucket_view"
    # the copy of each gradient into its bucket (memcpy), and the gradient-sized memory it took
    targets = ("communication", "memcpy", "memory")
    knob = "gradient_as_bucket_view"

    def value(self) -> Any:
        return True
