"""Attribution: each kept rung's share of the run's speedup and the step-time categories it moved.

Inputs are plain data: the kept rungs in the final configuration's order, the paired decision that
kept each (its speedup over the configuration without it, measured when it was kept: alone, or
with partners on a second look), the baseline's step time, and the profile windows
(:mod:`speedkit.profile`) of the baseline and of each prefix of that order (the last one the final
configuration). Per rung:

* ``speedup`` — the decision's paired speedup (a group kept together carries it once, on its first
  rung; its partners name the group); ``share`` — its log-share of the product of all decisions;
* ``step_ms`` and ``ms_per_step`` — the step time with it and its change, from the paired decisions
  alone: the baseline's step time divided by the speedups in the final order, so a kept gain is never
  shown as a loss and the waterfall, the table and this line give one figure per rung (a profile
  window of a host-bound step measures the profiler as much as the step);
* ``moved`` — the categories that changed most between the windows before and after it, each
  window's categories scaled to the paired step time of its configuration (the profile explains
  the figure, it does not make it); ``peak_memory_delta_bytes`` from the same windows;
* ``line`` — one sentence: ``sdpa: 1.41x, −17.4 ms per step, attention 19.1 → 1.9 ms, peak memory −13.6 GB``.

The decisions' speedups multiply to ``product``; the final configuration's measured speedup over the
baseline is ``measured``. Where they differ by more than :data:`AGREEMENT` the gains are not
independent and ``interaction`` names the rung whose decision differs most from what it gives in the
final order (the ratio of its windows).
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
    order: Sequence[str],
    decisions: Mapping[str, tuple[Sequence[str], float | None]],
    windows: Sequence[Mapping[str, Any]],
    measured: float | None,
    labels: Mapping[str, str] | None = None,
    baseline_ms: float | None = None,
) -> dict[str, Any]:
    """The attribution (module docstring). ``windows`` has ``len(order) + 1`` entries (baseline,
    then one per prefix of ``order``), each with ``step_ms``, ``breakdown_ms`` and
    ``peak_memory_bytes``; ``decisions[name]`` is (the names kept together, their paired speedup);
    ``baseline_ms``: the baseline's paired step time (the final check's), else the baseline window's."""
    if len(windows) != len(order) + 1:
        raise ValueError(f"expected {len(order) + 1} profile windows (baseline and one per kept rung), found {len(windows)}")
    labels = labels or {}
    rungs: list[dict[str, Any]] = []
    counted: set[tuple[str, ...]] = set()
    paired = baseline_ms if baseline_ms else windows[0].get("step_ms")  # the step time before the next rung
    for k, name in enumerate(order, 1):
        before, after = windows[k - 1], windows[k]
        group, speedup = decisions.get(name, ((name,), None))
        group = tuple(group)
        first_of_group = group not in counted
        counted.add(group)
        gain = speedup if first_of_group and speedup else None
        with_it = paired / gain if paired and gain else None
        memory = _delta(after.get("peak_memory_bytes"), before.get("peak_memory_bytes"))
        moved = moved_categories(
            _scaled(before, paired), _scaled(after, with_it if with_it else paired), paired or before.get("step_ms")
        )
        entry = {
            "name": name,
            "group": list(group) if len(group) > 1 else None,
            "speedup": speedup if first_of_group else None,
            "window_ratio": _ratio(before.get("step_ms"), after.get("step_ms")),
            "step_ms": with_it if with_it else paired,
            "ms_per_step": with_it - paired if with_it and paired else None,
            "share": None,
            "moved": moved,
            "peak_memory_delta_bytes": int(memory) if memory is not None else None,
        }
        entry["line"] = rung_line(entry, labels)
        rungs.append(entry)
        paired = entry["step_ms"]
    decided = [r["speedup"] for r in rungs if r["speedup"]]
    product = math.prod(decided) if decided else None
    total_log = sum(math.log(s) for s in decided) if decided else 0.0
    for r in rungs:
        if r["speedup"] and total_log:
            r["share"] = math.log(r["speedup"]) / total_log
    agrees = None
    if product and measured:
        agrees = abs(math.log(product / measured)) <= math.log1p(AGREEMENT)
    return {
        "rungs": rungs,
        "product": product,
        "measured": measured,
        "agrees": agrees,
        "interaction": None if agrees in (True, None) else interaction(rungs, product, measured),
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
    """``sdpa: −17.4 ms per step, attention 19.1 → 1.9 ms, peak memory −13.6 GB``."""
    parts = []
    if entry.get("speedup"):
        parts.append(f"{entry['speedup']:.2f}x")
    if entry.get("ms_per_step") is not None:
        parts.append(f"{_signed(entry['ms_per_step'])} ms per step")
    for m in entry.get("moved") or []:
        parts.append(f"{labels.get(m['category'], m['category'])} {_ms(m['before_ms'])} → {_ms(m['after_ms'])} ms")
    memory = entry.get("peak_memory_delta_bytes")
    if memory and abs(memory) >= 5e6:  # under 0.01 GB: not a change worth a word
        parts.append(f"peak memory {_signed(memory / 1e9)} GB")
    group = entry.get("group")
    if group and not entry.get("speedup"):
        parts.insert(0, f"in {group[0]}'s figure")
    name = entry["name"] + (f" (kept with {', '.join(g for g in group if g != entry['name'])})" if group else "")
    return f"{name}: {', '.join(parts)}" if parts else f"{name}: not profiled"


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
        f"the kept rungs' gains, each measured when it was kept, multiply to {product:.2f}x against "
        f"{measured:.2f}x measured for the final configuration: they are not independent"
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
        f"{head}; most in {name}: {g['speedup']:.2f}x when it was kept, {g['ratio']:.2f}x in the final "
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
