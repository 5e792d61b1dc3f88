"""Attribution: what each kept rung bought, and the step-time categories it moved.

Inputs are plain data: the kept rungs in the final configuration's order, each with its figure from the
account (:func:`speedkit.figures.account.account`: its link's speedup on the first rung of its link,
the step time before and after that link), and the profile windows (:mod:`speedkit.profile`) of the
baseline and of each prefix of that order (the last one the final configuration). Per rung:

* ``speedup`` and ``figure`` — the account's: its own decided gain, or its group's (carried once, on
  the group's first rung; the figure names the group);
* ``step_ms`` and ``ms_per_step`` — the step time after its link and the change, the account's chain:
  the waterfall, the table and this line give one figure per rung (a profile window of a host-bound
  step measures the profiler as much as the step);
* ``moved`` — the categories that changed most between the windows before and after it, each
  window's categories scaled to the chain's step time of its configuration (the profile explains
  the figure, it does not make it); ``peak_memory_delta_bytes`` from the same windows;
* ``line`` — one sentence: ``sdpa: 1.41×, −17.4 ms per step, attention 19.1 → 1.9 ms, peak memory −13.6 GB``.

The kept rungs' gains multiply to ``product`` (the chain's product, a link "together" left out); the final check's measured speedup over the
baseline is ``measured``. Where they differ by more than :data:`AGREEMENT` the gains are not
independent and ``interaction`` names the group whose decision differs most from what it gives in
the final order's windows (the ratio of its windows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: the marginal gains multiply to the measured total within this (else the interaction is named)
AGREEMENT = 0.03
#: a category "moved" where its time per step changed by at least this share of the step before, and
MOVED_SHARE = 0.03
#: ... by at least this many milliseconds
MOVED_MS = 0.05
#: categories named per rung, largest change first
MOVED_MAX = 3


def attribute(
    rungs: Sequence[Mapping[str, Any]],
    windows: Sequence[Mapping[str, Any]],
    product: float | None,
    measured: float | None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The attribution (module docstring). ``rungs``: in the final order, each ``name``, ``group`` (the
    names decided together, or None), ``speedup`` (its link's, on the link's first rung; else None),
    ``figure`` (its one figure's text), ``step_before`` and ``step_after`` (ms: the chain before and
    after its link). ``windows`` has ``len(rungs) + 1`` entries (baseline, then one per prefix), each
    with ``step_ms``, ``breakdown_ms`` and ``peak_memory_bytes``."""
    if len(windows) != len(rungs) + 1:
        raise ValueError(f"expected {len(rungs) + 1} profile windows (baseline and one per kept rung), found {len(windows)}")
    labels = labels or {}
    out: list[dict[str, Any]] = []
    for k, rung in enumerate(rungs, 1):
        before, after = windows[k - 1], windows[k]
        step_before, step_after = rung.get("step_before"), rung.get("step_after")
        first = rung.get("speedup") is not None
        memory = _delta(after.get("peak_memory_bytes"), before.get("peak_memory_bytes"))
        # a group's later rungs: the chain does not move at them (the group's figure is on its first)
        at_after = step_after if first else step_before
        moved = moved_categories(_scaled(before, step_before), _scaled(after, at_after), step_before or before.get("step_ms"))
        entry = {
            "name": rung["name"],
            "group": list(rung["group"]) if rung.get("group") else None,
            "speedup": rung.get("speedup"),
            "figure": rung.get("figure"),
            "window_ratio": _ratio(before.get("step_ms"), after.get("step_ms")),
            "step_ms": at_after,
            "ms_per_step": at_after - step_before if first and at_after and step_before else None,
            "share": None,
            "moved": moved,
            "peak_memory_delta_bytes": int(memory) if memory is not None else None,
        }
        entry["line"] = rung_line(entry, labels)
        out.append(entry)
    decided = [r["speedup"] for r in out if r["speedup"]]
    total_log = sum(math.log(s) for s in decided) if decided else 0.0
    for r in out:
        if r["speedup"] and total_log:
            r["share"] = math.log(r["speedup"]) / total_log
    agrees = None
    if product and measured:
        agrees = abs(math.log(product / measured)) <= math.log1p(AGREEMENT)
    return {
        "rungs": out,
        "product": product,
        "measured": measured,
        "agrees": agrees,
        "interaction": None if agrees in (True, None) else interaction(out, product, measured),
        "agreement": AGREEMENT,
    }


def moved_categories(before: Mapping[str, float], after: Mapping[str, float], step_ms: float | None) -> list[dict[str, Any]]:
    """The categories whose time per step changed most (at least :data:`MOVED_SHARE` of the step
    before and :data:`MOVED_MS`), largest change first, at most :data:`MOVED_MAX`."""
    floor = max(MOVED_MS, MOVED_SHARE * step_ms) if step_ms else MOVED_MS
    changes = [
        (cat, float(before.get(cat, 0.0) or 0.0), float(after.get(cat, 0.0) or 0.0)) for cat in dict.fromkeys([*before, *after])
    ]
    big = [c for c in changes if abs(c[2] - c[1]) >= floor]
    big.sort(key=lambda c: -abs(c[2] - c[1]))
    return [{"category": cat, "before_ms": b, "after_ms": a} for cat, b, a in big[:MOVED_MAX]]


def rung_line(entry: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """``sdpa: 1.41×, −17.4 ms per step, attention 19.1 → 1.9 ms, peak memory −13.6 GB``: the rung's one
    figure (its own, or its group's, naming the group), then what the profile shows it moved."""
    parts = []
    if entry.get("figure") and entry["figure"] != "—":
        parts.append(str(entry["figure"]))
    if entry.get("ms_per_step") is not None:
        parts.append(f"{_signed(entry['ms_per_step'])} ms per step")
    for m in entry.get("moved") or []:
        parts.append(f"{labels.get(m['category'], m['category'])} {_ms(m['before_ms'])} → {_ms(m['after_ms'])} ms")
    memory = entry.get("peak_memory_delta_bytes")
    if memory and abs(memory) >= 5e6:  # under 0.01 GB: not a change worth a word
        parts.append(f"peak memory {_signed(memory / 1e9)} GB")
    return f"{entry['name']}: {', '.join(parts)}" if parts else f"{entry['name']}: not profiled"


def interaction(rungs: Sequence[Mapping[str, Any]], product: float, measured: float) -> str:
    """One sentence naming the interaction: the decision whose speedup differs most from what its
    group gives in the final order's windows."""
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in rungs:
        key = tuple(r["group"] or [r["name"]])
        g = groups.setdefault(key, {"speedup": None, "ratio": 1.0, "known": True})
        if r["speedup"]:
            g["speedup"] = r["speedup"]
        if r["window_ratio"]:
            g["ratio"] *= r["window_ratio"]
        else:
            g["known"] = False
    scored = [
        (abs(math.log(g["speedup"] / g["ratio"])), key, g)
        for key, g in groups.items()
        if g["speedup"] and g["known"] and g["ratio"] > 0
    ]
    head = (
        f"the kept rungs' gains, each measured when it was kept, multiply to {product:.2f}× against "
        f"{measured:.2f}× in the final check: they are not independent"
    )
    if not scored:
        return head
    _, key, g = max(scored, key=lambda t: t[0])
    name = " + ".join(key)
    how = (
        "rungs kept after it cut part of the same time"
        if g["speedup"] > g["ratio"]
        else "it pays more with the rungs kept after it"
    )
    return (
        f"{head}; most in {name}: {g['speedup']:.2f}× when it was kept, {g['ratio']:.2f}× in the final "
        f"order's profile windows ({how})"
    )


def _scaled(window: Mapping[str, Any], step_ms: float | None) -> dict[str, float]:
    """The window's categories (ms per step) scaled so that they add up as its step time does to
    ``step_ms``, the paired step time of its configuration; as measured where either is unknown."""
    breakdown = {k: float(v or 0.0) for k, v in (window.get("breakdown_ms") or {}).items()}
    measured = window.get("step_ms")
    if not step_ms or not measured:
        return breakdown
    return {k: v * step_ms / float(measured) for k, v in breakdown.items()}


def _delta(after: Any, before: Any) -> float | None:
    if after is None or before is None:
        return None
    return float(after) - float(before)


def _ratio(before: Any, after: Any) -> float | None:
    if not before or not after:
        return None
    return float(before) / float(after)


def _signed(x: float) -> str:
    return f"{'−' if x < 0 else '+'}{abs(x):.1f}" if abs(x) >= 0.1 else f"{'−' if x < 0 else '+'}{abs(x):.2f}"


def _ms(x: float) -> str:
    return f"{x:.1f}" if abs(x) >= 0.1 else f"{x:.2f}"
