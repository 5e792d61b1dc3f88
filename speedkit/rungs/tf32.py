"""tf32: run float32 matrix products on reduced-precision units.

Speeds up: every fp32 matmul/conv (on NVIDIA Ampere and newer, TF32 tensor cores run fp32 GEMMs
several times faster; 10-bit mantissa, fp32 range). Also helps under autocast, for the ops that
autocast keeps in fp32.
Does not help: runs already entirely in bf16/fp16, or that are not GEMM-bound.
Needs: CUDA compute capability >= 8.0; on CPU, a processor with bf16 instructions, where oneDNN's
reduced-precision fp32 matmul path is the analogue (``torch.set_float32_matmul_precision("medium")``).
Numerics: tf32. The GEMMs' inputs keep a 10-bit mantissa (on the CPU: bf16 products), with fp32 range and
accumulation; convolutions too with the ``cudnn`` option.

The rung changes process-global torch flags; ``undo`` restores the exact previous values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkit import compat
from speedkit.config import loosest
from speedkit.rungs.base import Handle, Rung, set_attr
from speedkit.training.state import TrainState


@dataclass
class TF32Options:
    """Options of the tf32 rung."""

    #: also let cuDNN convolutions use TF32
    cudnn: bool = True


def check_tf32(device: torch.device) -> str | None:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"TF32 needs compute capability >= 8.0 (Ampere); this GPU is {major}.{minor}"
    elif device.type == "cpu":
        if not compat.cpu_has_bf16():
            return "this CPU has no bf16 instructions for oneDNN's reduced-precision fp32 matmul"
    else:
        return f"no reduced-precision fp32 matmul on device type {device.type!r}"
    if torch.get_float32_matmul_precision() != "highest":
        return f"fp32 matmul precision is already {torch.get_float32_matmul_precision()!r}"
    return None


def apply_tf32(device: torch.device, *, cudnn: bool = True) -> Handle:
    handle = Handle("tf32")
    previous = torch.get_float32_matmul_precision()
    # CUDA: "high" = TF32 tensor cores. CPU: "medium" = oneDNN bf16 compute for fp32 matmuls.
    wanted = "high" if device.type == "cuda" else "medium"
    torch.set_float32_matmul_precision(wanted)
    handle.record(
        f"torch.set_float32_matmul_precision({wanted!r}) (was {previous!r})",
        lambda: torch.set_float32_matmul_precision(previous),
        lambda: torch.set_float32_matmul_precision(wanted),
    )
    if cudnn and device.type == "cuda" and not torch.backends.cudnn.allow_tf32:
        # a property of torch.backends.cudnn's module class, not an instance attribute: set it explicitly
        def cudnn_tf32(on: bool) -> None:
            torch.backends.cudnn.allow_tf32 = on

        cudnn_tf32(True)
        handle.record("torch.backends.cudnn.allow_tf32 = True (was False)", lambda: cudnn_tf32(False), lambda: cudnn_tf32(True))
    return handle


class TF32Rung(Rung):
    name = "tf32"
    recompiles = True  # beneath a kept compile its trial compiles anew
    # fp32 matmuls and convolutions (GEMM), and the fp32 attention products of SDPA's math path
    targets = ("gemm", "attention")
    acts_through_numerics = True
    Options = TF32Options
    precision = "tf32"

    def check(self, state: TrainState) -> str | None:
        return check_tf32(state.device)

    def apply(self, state: TrainState) -> Handle:
        handle = apply_tf32(state.device, cudnn=self.options.cudnn)
        set_attr(handle, state, "precision", loosest(state.precision, "tf32"), "numerics: tf32 matmuls")
        return handle
