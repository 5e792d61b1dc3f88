"""float8: the large Linear layers' GEMMs in float8 (e4m3, scaled) through torchao's ``Float8Linear``, where their shapes pay.

Speeds up: GEMM-bound training of wide models on GPUs with float8 tensor cores (compute capability 8.9
and up: Ada, Hopper), where a Linear's GEMMs are large enough that float8's doubled matrix rate
outweighs the casts and scales around them (torchao's table: 1.39× at M, K, N = 4096, 8192, 16384,
0.80× at 1024, 2048, 1024).
Does not help: narrow models (GPT-2 small's 768-wide Linears lose), steps not set by their GEMMs, and
eager mode: the casts pay only fused by ``torch.compile``, which it is tried beneath.
Needs: an NVIDIA GPU of compute capability 8.9 or newer, torchao (``pip install 'speedkit[float8]'``),
and Linears whose GEMM shape (M tokens from the baseline's recorded pass, K and N features) lands
nearest a shape where ``configs/float8_gemms.yaml`` (measured by ``bench/float8_gemms.py``, same compute
capability and scaling) shows at least ``min_speedup``; without such rows or recorded tokens, both
widths at least ``min_features`` (2048). Widths divisible by 16.
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
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speedkit import config
from speedkit.measure import layer_shapes
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
    #: the measured speedup (bf16 ms / float8 ms) a Linear's nearest shape in the table must show
    min_speedup: float = 1.05


@dataclass(frozen=True)
class Measured:
    """One row of the table: a GEMM shape and float8's speedup over bf16 there."""

    M: int
    K: int
    N: int
    speedup: float

    def distance(self, M: int, K: int, N: int) -> float:
        return math.dist((math.log2(self.M), math.log2(self.K), math.log2(self.N)), (math.log2(M), math.log2(K), math.log2(N)))


@dataclass
class Prior:
    """The table's rows for one GPU kind (compute capability) and scaling recipe."""

    source: str
    rows: list[Measured] = field(default_factory=list)

    def nearest(self, M: int, K: int, N: int) -> Measured:
        return min(self.rows, key=lambda row: row.distance(M, K, N))


def prior_for(capability: tuple[int, int], recipe: str, table: dict[str, Any] | None = None) -> Prior | None:
    """The measured rows for GPUs of ``capability`` with ``recipe``'s scaling, or None where the table has
    none (``table``: the loaded ``configs/float8_gemms.yaml`` unless given)."""
    table = config.load("float8_gemms") if table is None else table
    wanted = f"{capability[0]}.{capability[1]}"
    for entry in table.get("measured") or ():
        if str(entry["capability"]) == wanted and entry["recipe"] == recipe:
            rows = [Measured(int(m), int(k), int(n), float(x)) for m, k, n, x in entry["shapes"]]
            if rows:
                return Prior(f"{entry['device']} at {entry['commit']}, {entry['date']}", rows)
    return None


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


def chosen_linears(
    model: nn.Module, options: Float8Options, fed: dict[int, list] | None = None, prior: Prior | None = None
) -> tuple[list[tuple[nn.Module, str, nn.Linear]], list[str]]:
    """The ``(parent, name, linear)`` converted, and what is left alone (counted per reason). With a
    ``prior`` a Linear whose recorded inputs (``fed``: :mod:`speedkit.measure.layer_shapes`' record) all
    land nearest a measured shape of at least ``options.min_speedup`` is converted; without one, or for a
    Linear with nothing recorded, both widths at least ``options.min_features``."""
    heads = _output_heads(model)
    fed = fed or {}
    chosen: list[tuple[nn.Module, str, nn.Linear]] = []
    small = odd = other = unrecorded = 0
    losing: list[str] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            K, N = child.in_features, child.out_features
            rows = layer_shapes.tokens(fed.get(id(child), []))
            if type(child) is not nn.Linear or id(child) in heads:
                other += 1
            elif K % 16 or N % 16:
                odd += 1
            elif prior is not None and rows:
                M, worst = min(((m, prior.nearest(m, K, N)) for m in rows), key=lambda pair: pair[1].speedup)
                if worst.speedup >= options.min_speedup:
                    chosen.append((parent, name, child))
                else:
                    losing.append(f"{M}x{K}x{N} (nearest measured {worst.M}x{worst.K}x{worst.N}: {worst.speedup:.2f}x)")
            elif min(K, N) < options.min_features:
                small += 1
                unrecorded += prior is not None
            else:
                chosen.append((parent, name, child))
                unrecorded += prior is not None
    notes = []
    if losing:
        shapes = list(dict.fromkeys(losing))
        notes.append(
            f"{len(losing)} Linear(s) whose GEMM shapes lose or gain under {options.min_speedup:.2f}x in float8: "
            + "; ".join(shapes[:4])
            + (f"; {len(shapes) - 4} more shapes" if len(shapes) > 4 else "")
        )
    if unrecorded:
        notes.append(f"{unrecorded} Linear(s) without recorded tokens judged by width (at least {options.min_features})")
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
        chosen, notes, _ = self.choose(state)
        if not chosen:
            return "no Linear whose GEMMs pay in float8" + (f" ({'; '.join(notes)})" if notes else "")
        return None

    def choose(self, state: TrainState) -> tuple[list[tuple[nn.Module, str, nn.Linear]], list[str], str]:
        """The Linears converted, what is left alone, and what they were judged by."""
        recipe = _recipe(self.options, state.device)
        prior = prior_for(torch.cuda.get_device_capability(state.device), recipe)
        fed = state.notes.get(layer_shapes.NOTE) or {}
        chosen, notes = chosen_linears(state.model, self.options, fed, prior)
        if prior is None:
            judged = f"by width (configs/float8_gemms.yaml has no {recipe} rows for {torch.cuda.get_device_name(state.device)})"
        else:
            judged = f"by the measured table ({prior.source}), at least {self.options.min_speedup:.2f}x"
        return chosen, notes, judged

    def apply(self, state: TrainState) -> Handle:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

        recipe = _recipe(self.options, state.device)
        float8_config = Float8LinearConfig.from_recipe_name(recipe)
        chosen, notes, judged = self.choose(state)
        handle = Handle(self.name)
        for parent, name, linear in chosen:
            converted = Float8Linear.from_float(linear, config=float8_config)
            setattr(parent, name, converted)  # a registered child: nn.Module keeps it in _modules
            handle.record(
                "",
                lambda parent=parent, name=name, linear=linear: setattr(parent, name, linear),
                lambda parent=parent, name=name, converted=converted: setattr(parent, name, converted),
            )
        handle.record(f"{len(chosen)} Linear(s) in float8 ({recipe} scaling, torchao Float8Linear), chosen {judged}")
        for note in notes:
            handle.record(f"left alone: {note}")
        return handle
