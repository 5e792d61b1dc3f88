"""float8: the large Linear layers' GEMMs in float8 (e4m3, scaled) through torchao's ``Float8Linear``, where their shapes pay.

Speeds up: GEMM-bound training of wide models on GPUs with float8 tensor cores (compute capability 8.9
and up: Ada, Hopper), where a Linear's GEMMs are large enough that float8's doubled matrix rate
outweighs the casts and scales around them: torchao's own table has 1.39× at M, K, N = 4096, 8192,
16384 and 0.80× at 1024, 2048, 1024; torchtitan reports +28% from float8 on top of compile on
Llama-3.1-8B.
Does not help: narrow models (GPT-2 small's 768-wide Linears lose), steps not set by their GEMMs, and
eager mode: the casts pay only fused by ``torch.compile``, which it is tried beneath.
Needs: an NVIDIA GPU of compute capability 8.9 or newer, torchao (``pip install 'speedkit[float8]'``),
Linear layers whose input and output features are both at least ``min_features`` (2048) and divisible
by 16.
Numerics: float8 (e4m3). Each GEMM's operands are scaled into float8's range and rounded to 3 mantissa
bits (rowwise scales on Hopper, one scale per tensor on Ada), accumulated in fp32; the parity tolerance
is calibrated for float8's rounding on the model, as for the other precisions.

Each chosen ``nn.Linear`` is replaced in its parent by ``Float8Linear.from_float`` of it (the same weight
and bias parameters, so the optimizer's state stays theirs); undo puts the original module back.
Left alone, with the reason: Linears below ``min_features`` or not divisible by 16, subclasses of
``nn.Linear``, and the output head of a language model (its logits' rounding is what the loss reads).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from speedkit.rungs.base import Handle, Rung
from speedkit.training.state import TrainState

#: the compute capability from which GPUs have float8 tensor cores (Ada, Hopper)
FLOAT8_CAPABILITY = (8, 9)
#: from which capability torchao's rowwise scaling runs (Hopper's CUTLASS kernels)
ROWWISE_CAPABILITY = (9, 0)


@dataclass
class Float8Options:
    """Options of the float8 rung."""

    #: the smallest input and output width of a Linear converted: torchao's table has float8 losing at
    #: K, N = 2048, 1024 and winning at 8192, 16384 (the tokens per step, M, in the thousands)
    min_features: int = 2048
    #: "auto": rowwise scales on compute capability 9.0 and up, tensorwise below; or either by name
    recipe: str = "auto"


def torchao_missing() -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'speedkit[float8]')"
    return None


def hardware_reason(device: torch.device) -> str | None:
    """Why float8 GEMMs do not run on ``device``, or None."""
    if device.type != "cuda":
        return f"float8 GEMMs need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); this run is on {device.type}"
    if torch.version.hip is not None:
        return "speedkit's float8 path is torchao's for NVIDIA GPUs; this is a ROCm build"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        return (
            f"float8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
        )
    return None


def _output_heads(model: nn.Module) -> set[int]:
    heads: set[int] = set()
    for m in model.modules():
        get = getattr(m, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except Exception:  # noqa: BLE001 (a library's method: whatever it raises, nothing is taken from it)
                head = None
            if isinstance(head, nn.Module):
                heads.add(id(head))
    return heads


def chosen_linears(model: nn.Module, options: Float8Options) -> tuple[list[tuple[nn.Module, str, nn.Linear]], list[str]]:
    """The ``(parent, name, linear)`` converted, and what is left alone (counted per reason)."""
    heads = _output_heads(model)
    chosen: list[tuple[nn.Module, str, nn.Linear]] = []
    small = odd = other = 0
    for parent in model.modules():
        for name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            if type(child) is not nn.Linear or id(child) in heads:
                other += 1
            elif min(child.in_features, child.out_features) < options.min_features:
                small += 1
            elif child.in_features % 16 or child.out_features % 16:
                odd += 1
            else:
                chosen.append((parent, name, child))
    notes = []
    if small:
        notes.append(f"{small} Linear(s) narrower than {options.min_features} features (float8 loses there)")
    if odd:
        notes.append(f"{odd} Linear(s) with features not divisible by 16 (float8 GEMMs need it)")
    if other:
        notes.append(f"{other} Linear subclass(es) or output head(s)")
    return chosen, notes


def _recipe(options: Float8Options, device: torch.device) -> str:
    if options.recipe != "auto":
        return options.recipe
    return "rowwise" if torch.cuda.get_device_capability(device) >= ROWWISE_CAPABILITY else "tensorwise"


class Float8Rung(Rung):
    name = "float8"
    Options = Float8Options
    precision = "fp8"
    targets = ("gemm",)
    recompiles = True
    partners = ("compile",)  # the casts pay only where compile fuses them

    def precision_in_play(self, state: TrainState) -> str | None:
        return None if hardware_reason(state.device) or torchao_missing() else self.precision

    def check(self, state: TrainState) -> str | None:
        if self.options.recipe not in ("auto", "rowwise", "tensorwise"):
            return f"recipe must be 'auto', 'rowwise' or 'tensorwise', found {self.options.recipe!r}"
        reason = hardware_reason(state.device) or torchao_missing()
        if reason:
            return reason
        chosen, notes = chosen_linears(state.model, self.options)
        if not chosen:
            return "no Linear whose GEMMs pay in float8" + (f" ({'; '.join(notes)})" if notes else "")
        return None

    def apply(self, state: TrainState) -> Handle:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

        recipe = _recipe(self.options, state.device)
        config = Float8LinearConfig.from_recipe_name(recipe)
        chosen, notes = chosen_linears(state.model, self.options)
        handle = Handle(self.name)
        for parent, name, linear in chosen:
            converted = Float8Linear.from_float(linear, config=config)
            setattr(parent, name, converted)  # a registered child: nn.Module keeps it in _modules
            handle.record(
                "",
                lambda parent=parent, name=name, linear=linear: setattr(parent, name, linear),
                lambda parent=parent, name=name, converted=converted: setattr(parent, name, converted),
            )
        handle.record(f"{len(chosen)} Linear(s) in float8 ({recipe} scaling, torchao Float8Linear)")
        for note in notes:
            handle.record(f"left alone: {note}")
        return handle
