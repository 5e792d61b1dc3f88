"""aligned_linear: compute linear layers with a misaligned output width on a zero-padded weight.

Speeds up: a ``nn.Linear`` whose out_features is not a multiple of 8 (GPT-2's vocabulary of 50,257,
BERT's 30,522, WikiText-2's 33,278). Its output rows then start at addresses cuBLAS cannot load
16 bytes at a time, and for half-precision GEMMs it falls back to much slower kernels, in the
forward and both backward GEMMs. Computing the layer on the weight padded with zero rows to a
multiple of 64 and slicing the output back gives the same values with aligned rows (measured on an
H100, bf16, a 16,384 × 768 → 50,257 head with its loss: 2.0× faster in eager; under torch.compile,
which pads some matmuls itself, 1.01× to 3.6× by shape: ``bench/gemm_align.py``).
Does not help: layers whose width is already aligned; small layers, whose GEMMs are launch-bound
(the pad is one more kernel; under ``min_out_features`` outputs, not tried); a run on the CPU (no known
gain, so not tried).
Needs: a CUDA device; nothing beyond PyTorch.
Numerics: unchanged. The padded rows are zeros and their outputs never leave the layer, so the values
and gradients are those of the layer itself.

Applied by a class swap (``nn.Linear`` → :class:`speedkit.kernels.layers.AlignedLinear`): the same module
object, parameters, hooks and state dict; undo swaps the class back. Only exact ``nn.Linear``
instances are swapped (a subclass's forward is user code) and not those whose ``forward`` was
replaced on the instance. The layer's output is a view whose rows are the padded width apart;
code that needs contiguous rows copies it, as it would any view.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from speedkit.kernels import layers
from speedkit.rungs.base import Handle, Rung, nested
from speedkit.training.state import TrainState

#: a half-precision GEMM's rows must start 16 bytes apart (8 bf16/fp16 elements) for cuBLAS's fast kernels
_ALIGNMENT = 8


@dataclasses.dataclass
class AlignedLinearOptions:
    """multiple: the output features are padded up to a multiple of this.
    min_out_features: narrower layers are left alone (their GEMMs are launch-bound)."""

    multiple: int = 64
    min_out_features: int = 1024

    def __post_init__(self) -> None:
        if self.multiple <= 0 or self.multiple % _ALIGNMENT:
            raise ValueError(f"multiple must be a positive multiple of {_ALIGNMENT}, found {self.multiple}")
        if self.min_out_features < 1:
            raise ValueError(f"min_out_features must be >= 1, found {self.min_out_features}")


def misaligned_linears(model: nn.Module, options: AlignedLinearOptions) -> tuple[list[tuple[str, nn.Linear]], list[str]]:
    """``([(name, linear) to pad], [notes on misaligned layers left alone])``."""
    found, notes = [], []
    for name, module in model.named_modules():
        if (
            not isinstance(module, nn.Linear)
            or module.out_features % _ALIGNMENT == 0
            or module.out_features < options.min_out_features
        ):
            continue
        label = name or type(module).__name__
        if type(module) is not nn.Linear:
            notes.append(f"{label} ({module.out_features} outputs) is a {type(module).__name__}, not an nn.Linear")
        elif "forward" in module.__dict__:
            notes.append(f"{label} ({module.out_features} outputs): its forward was replaced on the instance")
        else:
            found.append((label, module))
    return found, notes


class AlignedLinearRung(Rung):
    name = "aligned_linear"
    recompiles = True  # beneath a kept compile its trial compiles anew
    # the GEMMs of a misaligned Linear (forward and both backward ones)
    targets = ("gemm",)
    judged_at_full_precision = True
    Options = AlignedLinearOptions
    precision = None  # the same products and sums; only where the output rows are stored changes
    recheck = True  # torch.compile pads some matmuls itself: its gain under compile is judged again

    def check(self, state: TrainState) -> str | None:
        if state.device.type != "cuda":
            return f"misaligned GEMM rows are slow in cuBLAS; the run is on {state.device.type}, where no gain is known"
        found, notes = misaligned_linears(state.model, self.options)
        if not found:
            why = f"; left alone: {'; '.join(notes)}" if notes else ""
            return (
                f"no nn.Linear with {self.options.min_out_features} or more output features that are not a multiple "
                f"of {_ALIGNMENT}{why}"
            )
        return None

    def apply(self, state: TrainState) -> Handle:
        found, notes = misaligned_linears(state.model, self.options)
        aligned = layers.aligned_linear_class(self.options.multiple)
        handle, inner = Handle(self.name), Handle(self.name)
        for _, module in found:
            inner.record(
                "",
                functools.partial(setattr, module, "__class__", nn.Linear),
                functools.partial(setattr, module, "__class__", aligned),
            )
            module.__class__ = aligned
        sites = ", ".join(
            f"{name} ({m.out_features} → {layers.padded_width(m.out_features, self.options.multiple)})" for name, m in found
        )
        nested(
            handle,
            inner,
            f"linear layers computed on weights padded to a multiple of {self.options.multiple} output features: {sites}",
        )
        for note in notes:
            handle.record(f"left alone: {note}")
        handle.sites = {"padded": [name for name, _ in found], "left_alone": notes}  # type: ignore[attr-defined]
        return handle
