"""autocast: run the forward pass in bf16 (or fp16 with loss scaling) where it is safe.

Speeds up: GEMM- and bandwidth-bound models; halves activation memory. Uses ``torch.autocast``,
which keeps precision-sensitive ops (softmax, norms, losses) in fp32.
Does not help: tiny, launch-bound models (casts add kernels); CPUs without bf16 instructions.
Needs: bf16 on CUDA compute capability >= 8.0 (else fp16 with ``GradScaler``); bf16 on CPU.
Numerics: bf16 / fp16. Autocast's GEMM-like ops round to it, the rest stays fp32; on CUDA dropout draws other
masks (its random stream maps onto elements by the dtype's vector width).

The rung asks the training step for the precision (``state.step.set_autocast``): in plain PyTorch
the step runs its forward under ``torch.autocast``; in a Lightning Trainer the step swaps the
Trainer's precision plugin for Lightning's own ``MixedPrecision`` ("bf16-mixed" / "16-mixed"); in bf16 it
clips gradients before a fused optimizer too, which Lightning's refuses for fear of clipping scaled gradients
(bf16 scales none). A precision the user chose (a Trainer's ``precision=``) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from speedkit import compat
from speedkit.config import loosest
from speedkit.rungs.base import Handle, Rung, nested, set_attr
from speedkit.training.state import TrainState


@dataclass
class AutocastOptions:
    """Options of the autocast rung."""

    #: "auto" picks bf16 where the device supports it, else fp16 with a GradScaler (CUDA only)
    dtype: Literal["auto", "bf16", "fp16"] = "auto"


def pick_autocast_dtype(device: torch.device, wanted: str = "auto") -> tuple[str | None, str | None]:
    """Return ``(dtype_name, None)`` or ``(None, reason it cannot run)``."""
    if device.type == "cuda":
        bf16_ok = torch.cuda.is_bf16_supported()
        if wanted == "bf16" and not bf16_ok:
            return None, "this GPU has no bf16 support; use dtype: fp16 (with loss scaling) or auto"
        if wanted == "auto":
            return ("bf16" if bf16_ok else "fp16"), None
        return wanted, None
    if device.type == "cpu":
        if wanted == "fp16":
            return None, "fp16 autocast on CPU is not worth it (no fp16 GEMM units); use bf16 or auto"
        if not compat.cpu_has_bf16():
            return None, "this CPU has no bf16 instructions; bf16 autocast would be slower than fp32"
        return "bf16", None
    return None, f"autocast is not supported by speedkit on device type {device.type!r}"


class AutocastRung(Rung):
    name = "autocast"
    recompiles = True  # beneath a kept compile its trial compiles anew
    # bf16 GEMMs and attention on tensor cores; half the bytes for the elementwise ops and norms between
    # them; half the activations' memory (losses and softmax stay fp32: no gain there)
    targets = ("gemm", "attention", "elementwise", "normalization", "memory")
    Options = AutocastOptions
    precision = "bf16"
    acts_through_numerics = True
    # on a convnet bf16 alone in eager NCHW was slower (0.93x); with channels_last and compile it pays
    partners = ("channels_last", "compile")

    def check(self, state: TrainState) -> str | None:
        chosen = state.step.precision_choice()
        if chosen is not None:
            return chosen
        return pick_autocast_dtype(state.device, self.options.dtype)[1]

    def apply(self, state: TrainState) -> Handle:
        dtype_name, reason = pick_autocast_dtype(state.device, self.options.dtype)
        if reason:
            raise RuntimeError(reason)
        handle = Handle(self.name)
        inner = state.step.set_autocast(dtype_name)  # type: ignore[arg-type]
        for change in inner.changes:
            handle.changes.append(change)
        nested(handle, inner, "")
        set_attr(handle, state, "precision", loosest(state.precision, dtype_name), f"numerics: {dtype_name}")  # type: ignore[arg-type]
        # CUDA's dropout kernels map their random stream onto elements by vector width, which follows
        # the dtype: a bf16 activation draws other masks than its fp32 self (parity: dropout off)
        handle.draws_differently = state.device.type == "cuda"
        return handle
