"""The account: one pure function from a run's record to every figure printed about it.

The trials record, and never edit, a ledger of decisions (:class:`speedkit.results.Decision`): which
rungs one decision kept or dropped together, and the paired comparisons whose product is their figure
(B over A; a comparison taken with power -1 where a later one measured the opposite direction: a
group's figure less a member left out of it). :func:`account` reads that ledger once the decisions
are final and derives:

* **one baseline**: the final check's baseline windows (timed beside the final configuration, the latest)
  where there was a final check, else the baseline's own measurement (timed alone, at the start);
* **the chain**: the kept rungs grouped by the decision that stands for each (the last decision with
  comparisons that kept it), the user's switches (the floor) first, then the others in the final
  configuration's order; each link's figure is its decision's, with its interval (the comparisons'
  log half-widths added in quadrature);
* **one figure per rung**: a kept rung's own decided gain, or ``with its group (a + b): G×`` where it
  was decided together with others; a rung not kept, its last comparison's; none where it was never
  timed;
* **the headline**: the final check's figure where one timed the final configuration against the
  baseline (the chain then ends on a link of no rung, "together, as the final check measured them": the
  check over the rungs' product, since gains decided one at a time need not compose), else the chain's
  product; the final configuration's step time the baseline's divided by it; "not shown" where its
  interval holds 1.0;
* **against the switches**: the product of the links on top of the floor;
* **the final check**: the final configuration against the baseline in one interleaved comparison, a
  check of the chain (and the decision that kept it), printed as such, never as a second headline.

Every output (``report.json``'s ``figures`` and ``summary``, ``report.md``, ``report.html``, the
console, ``speedkit cache list``) prints these and nothing else, so a report cannot give two baselines
or two figures for one rung. Plain dicts in (a report's ``to_dict``), plain dicts out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from speedkit.figures.attribution import attribute

#: the figures' own schema, inside the report's
FIGURES_VERSION = 1


def figure_text(speedup: float | None, low: float | None = None, high: float | None = None) -> str:
    """``1.12× [1.05–1.19]``; without an interval where none was measured; ``—`` where there is no figure."""
    if speedup is None or not _finite(speedup):
        return "—"
    text = f"{speedup:.2f}×"
    if low is not None and high is not None and _finite(low) and _finite(high):
        text += f" [{low:.2f}–{high:.2f}]"
    return text


def combine(comparisons: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The product of ``comparisons`` (each ``speedup``, ``low``, ``high``, optional ``power`` ±1), with
    the interval whose log half-width is the comparisons' added in quadrature (their noises are
    independent: each was timed in blocks of its own). Without an interval where any has none (fewer
    than two blocks). A single comparison keeps its own interval and verdict."""
    if not comparisons:
        return {"speedup": None, "low": None, "high": None, "verdict": None}
    if len(comparisons) == 1 and comparisons[0].get("power", 1) == 1:
        c = comparisons[0]
        low, high = c.get("low"), c.get("high")
        has = _finite(low) and _finite(high) and low > 0
        return {
            "speedup": c.get("speedup"),
            "low": low if has else None,
            "high": high if has else None,
            "verdict": c.get("verdict"),
        }
    log, half2, known = 0.0, 0.0, True
    min_gain = max((float(c.get("min_gain") or 0.0) for c in comparisons), default=0.0)
    for c in comparisons:
        power = c.get("power", 1)
        s = c.get("speedup")
        if s is None or not _finite(s) or s <= 0:
            return {"speedup": None, "low": None, "high": None, "verdict": None}
        log += power * math.log(s)
        low, high = c.get("low"), c.get("high")
        if _finite(low) and _finite(high) and low > 0 and high > 0:
            half2 += ((math.log(high) - math.log(low)) / 2) ** 2
        else:
            known = False
    speedup = math.exp(log)
    if not known:
        return {"speedup": speedup, "low": None, "high": None, "verdict": "undecided"}
    half = math.sqrt(half2)
    low, high = math.exp(log - half), math.exp(log + half)
    threshold = 1.0 + min_gain
    verdict = "faster" if low > threshold else "not_faster" if high < threshold else "undecided"
    return {"speedup": speedup, "low": low, "high": high, "verdict": verdict}


def chain_links(ledger: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The kept configuration's links, walking the ledger in order: each decision that keeps rungs with a
    figure (their comparisons) adds a link, or restates the figure of a whole link (an untimed floor timed
    in the final check); one that keeps with no comparisons stands on the link it has (a member judged
    within its group, a rung re-checked under later ones). A decision that removes kept rungs takes them
    out of their links, and the configuration change it measured (with them over without: its
    comparisons, taken with power -1) goes, with the figures of any link it emptied, to the link the
    change belongs to: the rest of the same group where it survives, else the earliest link kept after
    the removed one (decided while it was in effect), else the first; a removal measured by no such
    comparison (the final check's, the fit's) leaves the others' figures as they are. So the links'
    product telescopes through every change of the kept set. Where one link is left, whole as it was kept,
    and it was the first kept (measured against the baseline itself), its own figure stands. Each link: ``names``, ``order``
    (when kept), ``comparisons`` (its figure's factors), ``phase``."""
    links: list[dict[str, Any]] = []
    member: dict[str, dict[str, Any]] = {}
    for i, decision in enumerate(ledger):
        names = [n for n in decision.get("names") or [] if isinstance(n, str)]
        comparisons = [dict(c) for c in decision.get("comparisons") or [] if isinstance(c, Mapping)]
        kept = [n for n in names if n in member]
        if decision.get("kept"):
            if not comparisons:
                continue  # stands on the figure it has
            held = {id(member[n]) for n in kept}
            if kept and len(kept) == len(names) and len(held) == 1 and set(member[kept[0]]["names"]) == set(names):
                member[kept[0]].update(comparisons=comparisons, own=comparisons, phase=decision.get("phase"), as_kept=list(names))
                continue  # a whole link's figure, restated
            for n in kept:  # regrouped: they leave their links
                _leave(links, member, n)
            link = {"names": list(names), "order": i, "comparisons": comparisons, "own": comparisons, "as_kept": list(names)}
            link["phase"] = decision.get("phase")
            links.append(link)
            for n in names:
                member[n] = link
            continue
        if not kept:
            continue  # tried and not kept: no change of the kept set
        touched = [member[n] for n in kept]
        first_order = min(link["order"] for link in touched)
        residual: list[dict[str, Any]] = []
        survivors: list[dict[str, Any]] = []
        for n in kept:
            link = _leave(links, member, n)
            if link is not None and link not in survivors and link in links:
                survivors.append(link)
        for link in {id(t): t for t in touched}.values():
            if link not in links:  # emptied: its figure goes with the change
                residual += link["comparisons"]
        if not comparisons:
            continue  # not measured as this change: the others' figures stand
        residual += [{**c, "power": -c.get("power", 1)} for c in comparisons]
        target = survivors[0] if survivors else next((x for x in links if x["order"] > first_order), links[0] if links else None)
        if target is not None:
            target["comparisons"] = target["comparisons"] + residual
    if len(links) == 1 and links[0].get("own") and set(links[0]["names"]) == set(links[0]["as_kept"]):
        first_kept = next((i for i, d in enumerate(ledger) if d.get("kept") and d.get("comparisons")), None)
        if first_kept == links[0]["order"]:  # the whole link, as kept, measured against the baseline itself
            links[0]["comparisons"] = links[0]["own"]
    return links


def _leave(links: list[dict[str, Any]], member: dict[str, dict[str, Any]], name: str) -> dict[str, Any] | None:
    """Take ``name`` out of its link (the link dropped where it empties); returns that link."""
    link = member.pop(name, None)
    if link is None:
        return None
    link["names"] = [n for n in link["names"] if n != name]
    if not link["names"] and link in links:
        links.remove(link)
    return link


def last_judged(ledger: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Per rung, the index of the ledger's last decision with comparisons that named it, kept or not."""
    last: dict[str, int] = {}
    for i, decision in enumerate(ledger):
        if decision.get("comparisons"):
            for name in decision.get("names") or []:
                last[name] = i
    return last


def account(d: Mapping[str, Any]) -> dict[str, Any]:
    """Every figure of the run ``d`` (a report dict with ``rungs``, ``ledger``, ``final_order``,
    ``floor``, ``final_check``, ``flops`` and ``profile``), in one dict (the module's docstring)."""
    rows = [r for r in d.get("rungs") or [] if isinstance(r, Mapping)]
    ledger = [x for x in d.get("ledger") or [] if isinstance(x, Mapping)] if "ledger" in d else _rows_ledger(rows)
    base_row = rows[0] if rows and rows[0].get("status") == "baseline" else None
    check_in = d.get("final_check") if isinstance(d.get("final_check"), Mapping) else None
    # the one baseline: the final check's, timed beside the final configuration (the latest, in the period the
    # fit follows), else the baseline timed alone at the start
    from_check = bool(check_in and isinstance(check_in.get("a"), Mapping) and _finite(check_in["a"].get("step_ms")))
    base = dict(check_in["a"] if from_check else (base_row or {}).get("measurement") or {})
    base_ms = base.get("step_ms") if _finite(base.get("step_ms")) else None
    items, unit = base.get("items_per_step"), base.get("throughput_unit")
    flops = d.get("flops") or {}
    order = list(d.get("final_order") or [r.get("name") for r in rows if r.get("status") == "kept"])
    floor = [n for n in order if n in set(d.get("floor") or [])]

    walked = chain_links(ledger)
    in_order = set(order)
    # the links of the final configuration, the floor's first; a kept rung no decision gave a figure is a link
    # of its own without one (untimed)
    walked = [dict(link, names=[n for n in link["names"] if n in in_order]) for link in walked]
    walked = [link for link in walked if link["names"]]
    placed = {n for link in walked for n in link["names"]}
    walked += [{"names": [n], "order": len(ledger), "comparisons": [], "phase": None} for n in order if n not in placed]
    walked.sort(key=lambda link: (not (set(link["names"]) & set(floor)), min(order.index(n) for n in link["names"])))
    links: list[dict[str, Any]] = []
    cumulative: float | None = 1.0
    log_half2, interval_known = 0.0, True
    for link_in in walked:
        names = sorted(link_in["names"], key=order.index)
        fig = combine(link_in["comparisons"])
        if fig["speedup"] is None:
            cumulative = None
        elif cumulative is not None:
            cumulative *= fig["speedup"]
        if fig["low"] is not None and fig["high"] is not None:
            log_half2 += ((math.log(fig["high"]) - math.log(fig["low"])) / 2) ** 2
        else:
            interval_known = False
        links.append(
            {
                "names": names,
                "phase": link_in.get("phase"),
                "floor": bool(set(names) & set(floor)),
                **fig,
                "comparisons": list(link_in["comparisons"]),
                "text": figure_text(fig["speedup"], fig["low"], fig["high"]),
                "vs_baseline": cumulative,
                **_at(base_ms / cumulative if base_ms and cumulative else None, items, unit, flops),
            }
        )

    rung_figures: dict[str, dict[str, Any]] = {}
    for i, link in enumerate(links):
        for name in link["names"]:
            own = len(link["names"]) == 1
            text = link["text"] if own else f"with its group ({' + '.join(link['names'])}): {link['text']}"
            rung_figures[name] = {
                "kept": True,
                "link": i,
                "group": None if own else list(link["names"]),
                "speedup": link["speedup"],
                "low": link["low"],
                "high": link["high"],
                "verdict": link["verdict"],
                "text": text,
            }
    judged = last_judged(ledger)
    for row in rows[1:] if base_row is not None else rows:
        name = row.get("name")
        if not isinstance(name, str) or name in rung_figures or row.get("status") not in _RUNG_STATUSES:
            continue
        decision = ledger[judged[name]] if name in judged else None
        if decision is None:
            rung_figures[name] = {"kept": False, "link": None, "group": None, "speedup": None, "low": None, "high": None}
            rung_figures[name].update(verdict=None, text="—")
            continue
        fig = combine(decision.get("comparisons") or [])
        names = list(decision.get("names") or [])
        text = figure_text(fig["speedup"], fig["low"], fig["high"])
        rung_figures[name] = {
            "kept": False,
            "link": None,
            "group": names if len(names) > 1 else None,
            **fig,
            "text": text if len(names) <= 1 else f"with {' + '.join(names)} together: {text}",
        }

    headline: float | None = cumulative if links else 1.0
    low = high = None
    if links and headline is not None and interval_known:
        half = math.sqrt(log_half2)
        low, high = headline * math.exp(-half), headline * math.exp(half)
    check = d.get("final_check") if isinstance(d.get("final_check"), Mapping) else None
    made_by = "the product of the kept rungs' decided gains" if links else "nothing kept: the baseline"
    together = _measured_together(links, check, cumulative, base_ms, items, unit, flops)
    if together is not None:  # the final configuration measured directly: the headline is that measurement
        links.append(together)
        headline, low, high = check["speedup"], check.get("low"), check.get("high")  # type: ignore[index,union-attr]
        if not (_finite(low) and _finite(high) and low > 0):
            low = high = None
        made_by = "the final check: the final configuration against the baseline, paired"
    shown = bool(links) and headline is not None and low is not None and low > 1.0
    on_top = [link for link in links if not link["floor"]]
    vs_switches = None
    if floor and links and links[0]["floor"] and on_top:
        vs_switches = combine([c for link in on_top for c in link["comparisons"]] or [{"speedup": None}])
        vs_switches["text"] = figure_text(vs_switches["speedup"], vs_switches["low"], vs_switches["high"])
    final_ms = base_ms / headline if base_ms and headline else None
    out = {
        "version": FIGURES_VERSION,
        "baseline": {
            **_at(base_ms, items, unit, flops),
            "spread": base.get("spread"),
            "source": "the final check's baseline windows" if from_check else "the baseline timed alone",
        },
        "links": links,
        "rungs": rung_figures,
        "headline": {
            "speedup": headline,
            "low": low,
            "high": high,
            "shown": shown,
            "text": figure_text(headline, low, high) if links else "1.00× (nothing kept)",
            "from": made_by,
            **_at(final_ms, items, unit, flops),
        },
        "vs_switches": vs_switches,
        "switches_are_final": bool(floor) and bool(links) and not on_top,
        "check": (
            {
                "speedup": check.get("speedup"),
                "low": check.get("low"),
                "high": check.get("high"),
                "verdict": check.get("verdict"),
                "blocks": check.get("blocks"),
                "text": figure_text(check.get("speedup"), check.get("low"), check.get("high")),
                "measured_in": check.get("measured_in"),
            }
            if check is not None and check.get("speedup") is not None
            else None
        ),
        "unit": unit,
    }
    if out["check"] is not None and together is not None:
        out["check"]["is_the_chain"] = True  # the headline is the check: no second line for it
    elif out["check"] is not None and len(links) == 1 and len(links[0]["comparisons"]) == 1:
        only = links[0]["comparisons"][0]  # the chain is the check itself (the final configuration is the floor)
        same = all(only.get(k) == out["check"][k] for k in ("speedup", "low", "high"))
        out["check"]["is_the_chain"] = same
    out["attribution"] = _attribution(d, links, order, base_ms, out)
    return out


#: the statuses of a rung's own row (not the baseline's, a closing phase's or the switches' summary row)
_RUNG_STATUSES = ("kept", "reverted", "not_applicable", "skipped", "failed", "interrupted")


def _rows_ledger(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A report written before the ledger (schema 3 and older), its decisions read back from its rows: each
    rung row with a comparison decided on it; a remedy's or a second look's row (``remedy: a + b``,
    ``second look: a + b beneath c``) keeping its rungs together on its comparison."""
    ledger: list[dict[str, Any]] = []
    for r in rows:
        c, name, status = r.get("comparison"), str(r.get("name") or ""), r.get("status")
        if not isinstance(c, Mapping):
            continue
        if status in ("kept", "reverted"):
            ledger.append({"phase": "the climb", "names": [name], "kept": status == "kept", "comparisons": [c]})
        elif status == "closing" and name.startswith(("second look: ", "remedy: ")):
            label = name.split(": ", 1)[1]
            for where in (" beneath ", " on top of ", " on the baseline"):
                label = label.split(where, 1)[0]
            ledger.append({"phase": name.split(":")[0], "names": label.split(" + "), "kept": True, "comparisons": [c]})
    return ledger


#: the label of the chain's last link where the final check measured the final configuration directly
TOGETHER = "together, as the final check measured them"


def _measured_together(
    links: list[dict[str, Any]],
    check: Mapping[str, Any] | None,
    cumulative: float | None,
    base_ms: float | None,
    items: Any,
    unit: Any,
    flops: Mapping[str, Any],
) -> dict[str, Any] | None:
    """Where the final check timed the final configuration against the baseline and the kept rungs'
    decided gains multiply to something else, the chain's last link: the check over that product (the
    check's comparison, the links' comparisons with power -1), so that the chain multiplies to the check.

    Gains decided one at a time need not compose: each was timed against the configuration of its
    moment, and a configuration without a CUDA graph timed slower when its windows alternated with a
    graphed one's (on an H100 a ViT's floor ran 42.1 ms there, 29.5 against the baseline; the chain
    multiplied to 10.1x, the final check measured 7.5x and the fit ran at the check's figure). The
    rungs keep their own decided gains; what they do together is the check's."""
    if not links or check is None or cumulative is None or not _finite(check.get("speedup")) or check["speedup"] <= 0:
        return None
    residual = check["speedup"] / cumulative
    if abs(math.log(residual)) < 1e-12:
        return None  # the chain multiplies to the check (or is it: the final configuration is the floor)
    measured = {k: check.get(k) for k in ("speedup", "low", "high", "verdict", "blocks", "min_gain")}
    comparisons = [{**measured, "power": 1, "label": "the final check"}] + [
        {**c, "power": -c.get("power", 1)} for link in links for c in link["comparisons"]
    ]
    fig = combine(comparisons)
    fig["speedup"] = residual  # exactly: the check over the product (combine's log-sum, rounded, is near it)
    return {
        "names": [],
        "label": TOGETHER,
        "phase": "the final check",
        "floor": False,
        "together": True,
        **fig,
        "verdict": None,
        "comparisons": comparisons,
        "text": figure_text(residual, fig["low"], fig["high"]),
        "vs_baseline": check["speedup"],
        **_at(base_ms / check["speedup"] if base_ms else None, items, unit, flops),
    }


def _at(step_ms: float | None, items: Any, unit: Any, flops: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration's figures at ``step_ms``: its throughput, MFU and achieved TFLOP/s."""
    if not step_ms or not _finite(step_ms):
        return {"step_ms": None, "throughput": None, "mfu": None}
    throughput = items / (step_ms / 1e3) if isinstance(items, (int, float)) and items else None
    per_step, peak = flops.get("per_step"), flops.get("peak_tflops")
    mfu = per_step / (step_ms / 1e3) / (peak * 1e12) if per_step and peak else None
    return {"step_ms": step_ms, "throughput": throughput, "mfu": mfu}


def _attribution(
    d: Mapping[str, Any], links: list[dict[str, Any]], order: list[str], base_ms: float | None, out: Mapping[str, Any]
) -> dict[str, Any] | None:
    """What each kept rung bought, from the profile windows of the prefixes of the final configuration's
    order (:func:`speedkit.figures.attribution.attribute`), at the chain's figures; None where the
    profile has no window for some prefix (not profiled, stopped, or the configuration changed after it)."""
    profile = d.get("profile") or {}
    windows = {tuple(w.get("rungs") or []): w for w in profile.get("windows") or [] if isinstance(w, Mapping)}
    if not order or not windows:
        return None
    prefixes = [tuple(order[:k]) for k in range(len(order) + 1)]
    if any(p not in windows for p in prefixes):
        return None
    link_of = {name: i for i, link in enumerate(links) for name in link["names"]}
    before_of = [base_ms] + [link["step_ms"] for link in links]
    seen: set[int] = set()
    rungs = []
    for name in order:
        i = link_of[name]
        first = i not in seen
        seen.add(i)
        link = links[i]
        rungs.append(
            {
                "name": name,
                "group": list(link["names"]) if len(link["names"]) > 1 else None,
                "speedup": link["speedup"] if first else None,
                "figure": out["rungs"][name]["text"],
                "step_before": before_of[i],
                "step_after": link["step_ms"],
            }
        )
    check = out.get("check") or {}
    labels = profile.get("labels") or {}
    # the rungs' gains (a link "together" is no rung's: where there is one they do not multiply to the check)
    gains = [link["speedup"] for link in links if not link.get("together")]
    product = math.prod(gains) if gains and None not in gains else None
    return attribute(rungs, [windows[p] for p in prefixes], product, check.get("speedup"), labels)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
