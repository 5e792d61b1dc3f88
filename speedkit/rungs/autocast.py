"""autocast: run the forward pass in bf16 (or fp16 with loss scaling) where it is safe.

Speeds up: GEMM- and bandwidth-bound models; halves activation memory. Uses ``torch.autocast``,
which keeps precision-sensitive ops (softmax, norms, losses) in fp32.
Does not help: tiny, launch-bound models (casts add kernels); CPUs without bf16 instructions.
Needs: bf16 on CUDA compute capability >= 8.0 (else fp16 with ``GradScaler``); bf16 on CPU.

Inside Lightning the rung does not wrap anything itself: it swaps the Trainer's precision plugin
for Lightning's own ``MixedPrecision`` ("bf16-mixed" / "16-mixed"), and leaves a Trainer whose
precision the user already chose alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from speedkit.config import loosest
from speedkit.rungs.base import Handle, Rung, set_attr
from speedkit.state import TrainState

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return None, "this CPU has no bf16 instructions; bf16 autocast would be slower than fp32"
        return "bf16", None
    return None, f"autocast is not supported by speedkit on device type {device.type!r}"


def apply_autocast(state: TrainState, dtype_name: str) -> Handle:
    handle = Handle("autocast")
    set_attr(handle, state, "autocast_dtype", _DTYPES[dtype_name], f"forward pass under torch.autocast({state.device.type!r}, {dtype_name})")
    if dtype_name == "fp16":
        set_attr(handle, state, "scaler", torch.amp.GradScaler(state.device.type), "loss scaled with torch.amp.GradScaler (fp16)")
    set_attr(handle, state, "precision", loosest(state.precision, dtype_name), f"numerics: {dtype_name}")
    return handle


class AutocastRung(Rung):
    name = "autocast"
    Options = AutocastOptions
    precision = "bf16"

    def check(self, state: TrainState) -> str | None:
        if state.autocast_dtype is not None:
            return f"autocast is already on ({state.autocast_dtype})"
        return pick_autocast_dtype(state.device, self.options.dtype)[1]

    def apply(self, state: TrainState) -> Handle:
        dtype_name, reason = pick_autocast_dtype(state.device, self.options.dtype)
        if reason:
            raise RuntimeError(reason)
        return apply_autocast(state, dtype_name)

    # -- Lightning: use its precision plugin, never fight it -------------------------------
    def check_lightning(self, trainer: Any, module: Any, state: TrainState) -> str | None:
        if str(trainer.precision) not in ("32-true", "32"):
            return f"the Trainer already runs precision={trainer.precision!r}; speedkit leaves it as chosen"
        return pick_autocast_dtype(state.device, self.options.dtype)[1]

    def apply_lightning(self, trainer: Any, module: Any, state: TrainState) -> Handle:
        from lightning.pytorch.plugins.precision import MixedPrecision

        dtype_name, reason = pick_autocast_dtype(state.device, self.options.dtype)
        if reason:
            raise RuntimeError(reason)
        precision = "bf16-mixed" if dtype_name == "bf16" else "16-mixed"
        handle = Handle("autocast")
        strategy = trainer.strategy
        previous = strategy.precision_plugin
        strategy.precision_plugin = MixedPrecision(precision, device=state.device.type)

        def restore() -> None:
            strategy.precision_plugin = previous

        handle.record(f"Trainer precision plugin: {type(previous).__name__}({previous.precision}) -> MixedPrecision({precision!r})", restore)
        return handle
