"""The plan: from a step's diagnosis, what each rung can gain at most, which rungs are not worth
timing, and which configuration to try first.

A rung declares what it cuts (``Rung.targets``: the data wait, host time, syncs, memory, device
categories, or ``"*"``) and which rungs must be in effect for it to work (``Rung.needs``).
:func:`gain_bound` bounds its speedup by the share ``s`` of the step its targets take in the diagnosis
(:meth:`~speedkit.engine.diagnose.Diagnosis.shares`): a rung removes at most its targets' time, so the
step can become at most ``1 / (1 - s)`` times faster. :func:`prune` sets aside the rungs bounded under
the minimum gain, each with its reason ("attention is 2% of the step: at most 1.02x, under the 1.05x
minimum"), and keeps those that a kept rung needs. :func:`first_configuration` names the bottleneck's
remedy with its prerequisites:

* data-bound: the rungs that cut the data wait (``data_path``);
* memory-bound: the rungs that free memory;
* sync-bound: the rungs that remove syncs (``explicit_mask``, ``async_progress_bar``) and ``cuda_graph``,
  which needs them gone;
* host-bound: those and ``compile`` (fewer, fused kernels for the host to issue);
* device-bound: the rungs that cut its top categories (precision and kernels).

A bound holds for the step the diagnosis describes. Once other rungs made that step ``k`` times
faster, the time a rung targets is up to ``k`` times its share there: bounds for a rung judged on top
of others come from a diagnosis of that step.

Plain inputs, plain outputs: a rung is anything with ``name``, ``targets`` and ``needs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from speedkit import config
from speedkit.engine.diagnose import DEVICE_CATEGORIES, Diagnosis, percent
from speedkit.profile.categories import CATEGORY_LABELS

#: targets that are not device categories: the step waiting for its batch, the device idle behind the
#: host (on a CPU, the step's time outside its ops), the host waiting for the device, device memory
HOST_TARGETS: tuple[str, ...] = ("data_wait", "host", "syncs", "memory")
#: every name a rung may declare in ``targets`` ("*": anything in the step)
TARGET_NAMES: tuple[str, ...] = HOST_TARGETS + DEVICE_CATEGORIES + ("*",)
#: besides the rungs that remove syncs, what a host-bound step tries first: fewer, fused kernels for the
#: host to issue (compile; the fused optimizer: one update kernel a group where foreach issues a dozen
#: multi-tensor ops, each dispatched per parameter under FSDP2's DTensors, where a 1.1B Llama's step
#: on two H200s was host-bound; FSDP2 kept gathered between forward and backward: one all-gather a block
#: a step, not two, 1.12x there), and the step cuda_graph captures best
HOST_REMEDY: tuple[str, ...] = ("compile", "fused_optimizer", "fsdp_reshard")

_LABELS = {**CATEGORY_LABELS, "data_wait": "the data wait", "host": "host time", "syncs": "the host syncs' wait"}


class PlannedRung(Protocol):
    """What the plan reads of a rung."""

    name: str
    targets: tuple[str, ...]
    needs: tuple[str, ...]


def gain_bound(
    rung_targets: Iterable[str], diagnosis: Diagnosis, precision_factor: float | None = None
) -> tuple[float | None, str]:
    """The most a rung cutting ``rung_targets`` can speed up the diagnosed step, and why: ``1 / (1 - s)``
    for its targets' share ``s`` of the step, each share taken ``precision_factor`` times (default:
    ``diagnosis.precision_factor`` in the defaults: a profile's shares are estimates). None where the
    diagnosis cannot bound it: ``"*"`` (or no targets), a target whose share it does not show (no
    profile), memory on a memory-bound step, or targets taking the whole step.

    Host time and syncs are one pool: the syncs' cost is the device's idle time behind the host, which
    is what ``host`` counts; a rung cutting both cuts that time once.

    Raises:
        ValueError: a target that is not one of :data:`TARGET_NAMES`.
    """
    targets = tuple(dict.fromkeys(rung_targets))
    unknown = [t for t in targets if t not in TARGET_NAMES]
    if unknown:
        raise ValueError(f"unknown rung target(s) {', '.join(map(repr, unknown))}; the known ones: {', '.join(TARGET_NAMES)}")
    if not targets or "*" in targets:
        return None, "it can change any part of the step"
    if "memory" in targets and diagnosis.kind == "memory-bound":
        return None, "it frees memory, and the step is memory-bound"
    timed = [t for t in targets if t != "memory"]
    if not timed:
        return 1.0, "it only frees memory, and the step is not memory-bound"
    shares = diagnosis.shares()
    missing = [t for t in timed if t not in shares]
    if missing:
        why = "the syncs were not looked for" if missing == ["syncs"] else "no profile window"
        return None, f"the share of {_names(missing)} is not known ({why})"
    share = sum(shares[t] for t in timed if t not in ("host", "syncs"))
    share += max((shares[t] for t in timed if t in ("host", "syncs")), default=0.0)
    factor = _precision_factor(precision_factor, diagnosis)
    counted = share * factor
    verb = "is" if len(timed) == 1 else "are"
    figure = f"{_names(timed)} {verb} {percent(share)} of the step"
    if counted >= 1.0:
        return None, f"{figure}: no bound"
    bound = 1.0 / (1.0 - counted)
    margin = f" (the share taken {factor:g} times: a profile's shares are estimates)" if factor != 1.0 and share > 0 else ""
    return bound, f"{figure}: at most {bound:.2f}x{margin}"


def prune(
    rungs: Sequence[PlannedRung], diagnosis: Diagnosis, min_gain: float, precision_factor: float | None = None
) -> tuple[list[PlannedRung], list[tuple[PlannedRung, str]]]:
    """Split ``rungs`` into those worth timing and those whose :func:`gain_bound` is under ``1 + min_gain``
    (``min_gain`` a fraction: 0.05 is 1.05x), each of those with its reason. A rung that a kept rung
    needs (``needs``, followed through) is kept whatever its bound: its gain shows through that rung.
    Both lists keep the order of ``rungs``."""
    if min_gain < 0:
        raise ValueError(f"min_gain must be 0 or more (a fraction: 0.05 is 1.05x), not {min_gain!r}")
    floor = 1.0 + min_gain
    reasons: dict[str, str] = {}
    for rung in rungs:
        bound, reason = gain_bound(rung.targets, diagnosis, precision_factor)
        if bound is not None and bound < floor:
            reasons[rung.name] = f"{reason}, under the {floor:.2f}x minimum"
    needed = prerequisites([r.name for r in rungs if r.name not in reasons], rungs)
    kept = [r for r in rungs if r.name not in reasons or r.name in needed]
    pruned = [(r, reasons[r.name]) for r in rungs if r.name in reasons and r.name not in needed]
    return kept, pruned


def prerequisites(names: Iterable[str], rungs: Sequence[PlannedRung]) -> list[str]:
    """``names`` with every rung they need (``needs``, followed through) that is among ``rungs`` (a need
    that does not apply to the run is not there), in the order of ``rungs``."""
    present = {r.name: r for r in rungs}
    chosen: set[str] = set()
    todo = [n for n in names if n in present]
    while todo:
        name = todo.pop()
        if name in chosen:
            continue
        chosen.add(name)
        todo.extend(n for n in present[name].needs if n in present and n not in chosen)
    return [r.name for r in rungs if r.name in chosen]


def first_configuration(rungs: Sequence[PlannedRung], diagnosis: Diagnosis) -> list[str]:
    """The rungs, among ``rungs`` (those that apply), that remove the diagnosed bottleneck, with their
    prerequisites, in the order of ``rungs`` ([] where the diagnosis names nothing to remove: a
    device-bound step without a profile)."""
    kind = diagnosis.kind
    if kind == "data-bound":
        remedy = [r for r in rungs if "data_wait" in r.targets]
    elif kind == "memory-bound":
        remedy = [r for r in rungs if "memory" in r.targets]
    elif kind == "sync-bound":
        remedy = [r for r in rungs if "syncs" in r.targets]
    elif kind == "host-bound":
        remedy = [r for r in rungs if "syncs" in r.targets or r.name in HOST_REMEDY]
    else:
        top = {t["category"] for t in diagnosis.top_categories}
        remedy = [r for r in rungs if "*" not in r.targets and top & set(r.targets)]
    return prerequisites([r.name for r in remedy], rungs)


def _precision_factor(given: float | None, diagnosis: Diagnosis) -> float:
    if given is not None:
        factor = float(given)
    elif "precision_factor" in diagnosis.thresholds:
        factor = float(diagnosis.thresholds["precision_factor"])
    else:
        factor = float(config.diagnosis_thresholds()["precision_factor"])
    if factor < 1.0:
        raise ValueError(f"precision_factor must be 1 or more (it widens the shares), not {factor!r}")
    return factor


def _names(targets: Sequence[str]) -> str:
    labels = [_LABELS.get(t, t) for t in targets]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"
