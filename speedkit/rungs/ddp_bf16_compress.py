"""ddp_bf16_compress: DDP all-reduces the gradients in bf16 (``bf16_compress_hook``): half the bytes.

Speeds up: steps bound by the gradient all-reduce (across machines, GPUs without NVLink, a large model
at a small batch): each all-reduce sends half the bytes.
Does not help: one process; an all-reduce that already hides behind the backward; gradients already in
bf16 (a ``bf16-true`` model: nothing to compress, a trial reverts the rung as inert).
Needs: DDP on several processes with no communication hook of the user's; a backend that all-reduces
bf16 (NCCL 2.10 or later, gloo). Lightning registers DDP's hooks on CUDA only; speedkit registers
this one on the CPU too.
Numerics: bf16 gradient all-reduce. Each gradient is divided by the world size, rounded to bf16
(8-bit mantissa), summed over the ranks in bf16 and cast back; the weights, the optimizer's state and
its update stay in fp32.
Costs: a cast each way per bucket.

The hook is ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook``. DDP takes
one hook per wrapper, registered once: after Lightning wrapped the model, the step wraps it anew.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from speedkit.config import loosest
from speedkit.rungs.base import Handle, set_attr
from speedkit.rungs.ddp_knob import DDPKnobRung
from speedkit.training.state import TrainState

#: process group backends that all-reduce bf16 tensors (NCCL from 2.10 on)
BF16_BACKENDS = ("nccl", "gloo")


class DDPBf16CompressRung(DDPKnobRung):
    name = "ddp_bf16_compress"
    # the all-reduces' bytes, halved
    targets = ("communication",)
    knob = "comm_hook"
    precision = "bf16"
    # its only saving is the bytes rounding to bf16 removes: a trajectory bit-identical to the one without
    # it (gradients already bf16) means it compressed nothing
    acts_through_numerics = True

    def value(self) -> Any:
        return default_hooks.bf16_compress_hook

    def why_not(self, options: dict[str, Any], state: TrainState) -> str | None:
        backend = str(options.get("backend") or "").lower()
        if backend not in BF16_BACKENDS:
            return f"the {backend or 'unknown'} backend is not known to all-reduce bf16 tensors (nccl and gloo do)"
        if backend == "nccl" and torch.cuda.is_available() and torch.cuda.nccl.version() < (2, 10):
            version = ".".join(map(str, torch.cuda.nccl.version()))
            return f"the nccl backend all-reduces bf16 from NCCL 2.10 on; this one is {version}"
        return None

    def apply(self, state: TrainState) -> Handle:
        handle = super().apply(state)
        set_attr(handle, state, "precision", loosest(state.precision, "bf16"), "numerics: bf16 gradient all-reduce")
        return handle
