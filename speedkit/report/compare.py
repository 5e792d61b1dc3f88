"""``speedkit compare A B``: two ladder runs side by side.

:func:`compare_reports` takes two report dicts (``report.json``'s content, schema 2 or 3) and returns
a :class:`CompareResult`: the headline figures with their B/A ratios, each rung's status and gain in
both runs (a rung kept in one run only called out), and, when both runs were profiled, the
breakdown categories' ms before → after. It renders as markdown (:meth:`CompareResult.to_markdown`)
and on the terminal with rich (:meth:`CompareResult.render_console`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from speedkit.report.html_sections import configurations
from speedkit.report.markdown import (
    MISSING,
    STATUS_LABELS,
    figures_of,
    format_bytes,
    format_gain,
    format_percent,
    format_throughput,
)

__all__ = ["BreakdownRow", "CompareResult", "MetricRow", "RungRow", "compare_reports"]

#: statuses that are not ladder rungs of their own (the rows compare rungs)
_NOT_RUNGS = ("baseline", "closing", "switches")
#: ratios within this of 1 read as "same"
SAME = 0.01


def _known(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class MetricRow:
    """One headline figure in both runs."""

    name: str
    a: float | None
    b: float | None
    a_text: str
    b_text: str
    higher_is_better: bool

    @property
    def ratio(self) -> float | None:
        """B / A, or None where either is missing or A is 0."""
        return self.b / self.a if _known(self.a) and _known(self.b) and self.a else None

    @property
    def ratio_text(self) -> str:
        return f"{self.ratio:.3f}×" if self.ratio is not None else MISSING

    @property
    def verdict(self) -> str:
        """ "B better", "A better" or "same" (within 1%); "—" where it cannot be told."""
        r = self.ratio
        if r is None:
            return MISSING
        if abs(r - 1) <= SAME:
            return "same"
        return "B better" if (r > 1) == self.higher_is_better else "A better"


@dataclass
class RungRow:
    """One rung's outcome in both runs (``None``: the run did not list it)."""

    name: str
    a_status: str | None
    b_status: str | None
    a_gain: float | None
    b_gain: float | None

    @property
    def change(self) -> str:
        """What differs, in a few words ("kept in A only", "reverted → kept", ""); "" when nothing."""
        a, b = self.a_status, self.b_status
        if a == b:
            return ""
        if a == "kept" and b != "kept":
            return "kept in A only"
        if b == "kept" and a != "kept":
            return "kept in B only"
        return f"{_status(a)} → {_status(b)}"


@dataclass
class BreakdownRow:
    """One profile category: ms per step before (baseline) and after (final) in both runs."""

    category: str
    label: str
    a_before: float | None
    a_after: float | None
    b_before: float | None
    b_after: float | None

    @property
    def after_delta(self) -> float | None:
        """B's final minus A's final (ms per step)."""
        return self.b_after - self.a_after if _known(self.a_after) and _known(self.b_after) else None


@dataclass
class CompareResult:
    """Two runs side by side; see :func:`compare_reports`."""

    a_label: str
    b_label: str
    metrics: list[MetricRow]
    rungs: list[RungRow]
    breakdown: list[BreakdownRow] | None
    notes: list[str] = field(default_factory=list)
    #: why ``breakdown`` is None ("no profile in A")
    breakdown_note: str | None = None

    @property
    def kept_in_one_only(self) -> list[RungRow]:
        return [r for r in self.rungs if r.change in ("kept in A only", "kept in B only")]

    def to_markdown(self) -> str:
        lines = [
            "# speedkit compare",
            "",
            f"- **A:** {_md(self.a_label)}",
            f"- **B:** {_md(self.b_label)}",
            "",
            "## Headline",
            "",
            "| figure | A | B | B/A | |",
            "|---|---:|---:|---:|---|",
        ]
        lines += [f"| {m.name} | {m.a_text} | {m.b_text} | {m.ratio_text} | {m.verdict} |" for m in self.metrics]
        lines += ["", "## Rungs", "", "| rung | A | B | gain A | gain B | change |", "|---|---|---|---:|---:|---|"]
        for r in self.rungs:
            change = f"**{r.change}**" if r in self.kept_in_one_only else r.change
            lines.append(
                f"| {_md(r.name)} | {_status(r.a_status)} | {_status(r.b_status)} | {format_gain(r.a_gain)} | "
                f"{format_gain(r.b_gain)} | {change} |"
            )
        for r in self.kept_in_one_only:
            lines.append(f"\n**{_md(r.name)}** was {r.change} (A: {_status(r.a_status)}, B: {_status(r.b_status)}).")
        lines += ["", "## Where the time goes", ""]
        if self.breakdown:
            lines += [
                "ms per optimizer step, baseline → final.",
                "",
                "| category | A | B | final B − A |",
                "|---|---:|---:|---:|",
            ]
            for row in self.breakdown:
                lines.append(
                    f"| {_md(row.label)} | {_arrow(row.a_before, row.a_after)} | {_arrow(row.b_before, row.b_after)} | "
                    f"{_signed(row.after_delta)} |"
                )
        else:
            lines.append(f"Not compared: {self.breakdown_note or 'no profiles'}.")
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {_md(n)}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def render_console(self, console: Any = None) -> None:
        """Print the comparison with rich (tables; a rung kept in one run only in bold yellow)."""
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        console = console or Console()
        console.print(Text(f"A: {self.a_label}"))
        console.print(Text(f"B: {self.b_label}"))
        t = Table(title="headline", title_justify="left")
        for i, col in enumerate(("figure", "A", "B", "B/A", "")):
            t.add_column(col, justify="right" if 0 < i < 4 else "left")
        for m in self.metrics:
            style = "green" if m.verdict == "B better" else "red" if m.verdict == "A better" else ""
            t.add_row(Text(m.name), Text(m.a_text), Text(m.b_text), Text(m.ratio_text), Text(m.verdict, style=style))
        console.print(t)
        t = Table(title="rungs", title_justify="left")
        for i, col in enumerate(("rung", "A", "B", "gain A", "gain B", "change")):
            t.add_column(col, justify="right" if i in (3, 4) else "left")
        for r in self.rungs:
            flagged = r in self.kept_in_one_only
            t.add_row(
                Text(r.name),
                Text(_status(r.a_status)),
                Text(_status(r.b_status)),
                Text(format_gain(r.a_gain)),
                Text(format_gain(r.b_gain)),
                Text(r.change),
                style="bold yellow" if flagged else "",
            )
        console.print(t)
        for r in self.kept_in_one_only:
            console.print(Text(f"{r.name}: {r.change} (A: {_status(r.a_status)}, B: {_status(r.b_status)})", style="bold yellow"))
        if self.breakdown:
            t = Table(title="where the time goes (ms per step, baseline → final)", title_justify="left")
            for i, col in enumerate(("category", "A", "B", "final B − A")):
                t.add_column(col, justify="left" if i == 0 else "right")
            for row in self.breakdown:
                t.add_row(
                    Text(row.label),
                    Text(_arrow(row.a_before, row.a_after)),
                    Text(_arrow(row.b_before, row.b_after)),
                    Text(_signed(row.after_delta)),
                )
            console.print(t)
        elif self.breakdown_note:
            console.print(Text(f"time breakdown not compared: {self.breakdown_note}", style="dim"))
        for n in self.notes:
            console.print(Text(f"note: {n}", style="dim"))


def _status(status: str | None) -> str:
    if status is None:
        return "not tried"
    return STATUS_LABELS.get(status, status)


def _md(text: Any) -> str:
    return str(text).replace("\n", " ").replace("|", "\\|")


def _arrow(before: float | None, after: float | None) -> str:
    b = f"{before:,.1f}" if _known(before) else MISSING
    a = f"{after:,.1f}" if _known(after) else MISSING
    return f"{b} → {a}"


def _signed(v: float | None) -> str:
    return f"{v:+,.1f}".replace("-", "−") if _known(v) else MISSING


def _label(d: dict[str, Any], fallback: str) -> str:
    env = d.get("environment") or {}
    what = d.get("title") or d.get("recipe") or "a ladder run"
    where = env.get("gpu_name") or d.get("device") or "?"
    return f"{what} on {where} (schema {d.get('schema_version')}){f', {fallback}' if fallback else ''}"


def _figures(d: dict[str, Any]) -> dict[str, Any]:
    figures = figures_of(d)
    confs = configurations(d)
    final = confs[-1]["measurement"] if confs else {}
    head, base = figures.get("headline") or {}, figures.get("baseline") or {}
    kept = bool(figures.get("links"))
    return {
        "speedup": head.get("speedup") if kept else 1.0,
        "baseline_step_ms": base.get("step_ms"),
        "final_step_ms": head.get("step_ms") if kept else base.get("step_ms"),
        "throughput": head.get("throughput") if kept else base.get("throughput"),
        "unit": figures.get("unit") or final.get("throughput_unit"),
        "mfu": final.get("mfu"),
        "peak": final.get("peak_memory_bytes"),
    }


def _profile_after(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], list[str]] | None:
    p = d.get("profile") or {}
    windows = [w for w in p.get("windows") or [] if isinstance(w, dict)]
    if not windows:
        return None
    before = next((w for w in windows if w.get("label") == "baseline"), windows[0])
    after = next((w for w in windows if w.get("label") == "final"), windows[-1])
    cats = list(p.get("categories") or [])
    for w in (before, after):
        cats += [c for c in (w.get("breakdown_ms") or {}) if c not in cats]
    labels = {c: str((p.get("labels") or {}).get(c) or c.replace("_", " ")) for c in cats}
    return before.get("breakdown_ms") or {}, after.get("breakdown_ms") or {}, labels, cats


def compare_reports(a: dict[str, Any], b: dict[str, Any], a_name: str = "", b_name: str = "") -> CompareResult:
    """Run B against run A (two report dicts); ``a_name``/``b_name`` (their paths, say) go into the labels."""
    fa, fb = _figures(a), _figures(b)
    notes: list[str] = []
    ua, ub = fa["unit"], fb["unit"]
    if ua and ub and ua != ub:
        notes.append(f"the runs count throughput in different units ({ua} in A, {ub} in B): its ratio compares unlike things")

    def ms(v: Any) -> str:
        return f"{v:,.1f} ms" if _known(v) else MISSING

    metrics = [
        MetricRow(
            "speedup vs own baseline", fa["speedup"], fb["speedup"], format_gain(fa["speedup"]), format_gain(fb["speedup"]), True
        ),
        MetricRow(
            "baseline step time",
            fa["baseline_step_ms"],
            fb["baseline_step_ms"],
            ms(fa["baseline_step_ms"]),
            ms(fb["baseline_step_ms"]),
            False,
        ),
        MetricRow(
            "final step time", fa["final_step_ms"], fb["final_step_ms"], ms(fa["final_step_ms"]), ms(fb["final_step_ms"]), False
        ),
        MetricRow(
            "final throughput",
            fa["throughput"],
            fb["throughput"],
            format_throughput(fa["throughput"], ua),
            format_throughput(fb["throughput"], ub),
            True,
        ),
        MetricRow("final MFU", fa["mfu"], fb["mfu"], format_percent(fa["mfu"]), format_percent(fb["mfu"]), True),
        MetricRow("final peak memory", fa["peak"], fb["peak"], format_bytes(fa["peak"]), format_bytes(fb["peak"]), False),
    ]

    def rungs(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {str(r.get("name")): r for r in d.get("rungs") or [] if r.get("status") not in _NOT_RUNGS}

    ra, rb = rungs(a), rungs(b)
    names = list(ra) + [n for n in rb if n not in ra]
    rows = [
        RungRow(
            n,
            (ra.get(n) or {}).get("status"),
            (rb.get(n) or {}).get("status"),
            ((figures_of(a).get("rungs") or {}).get(n) or {}).get("speedup"),
            ((figures_of(b).get("rungs") or {}).get(n) or {}).get("speedup"),
        )
        for n in names
    ]

    pa, pb = _profile_after(a), _profile_after(b)
    breakdown, breakdown_note = None, None
    if pa and pb:
        cats = pa[3] + [c for c in pb[3] if c not in pa[3]]
        labels = {**pb[2], **pa[2]}
        breakdown = [
            BreakdownRow(c, labels.get(c, c), pa[0].get(c), pa[1].get(c), pb[0].get(c), pb[1].get(c))
            for c in cats
            if any(_known(v) and v for v in (pa[0].get(c), pa[1].get(c), pb[0].get(c), pb[1].get(c)))
        ]
    else:
        missing = [n for n, p in (("A", pa), ("B", pb)) if not p]
        breakdown_note = f"no profile in {' and '.join(missing)}"
    ea, eb = a.get("environment") or {}, b.get("environment") or {}
    for key, what in (("gpu_name", "GPU"), ("torch", "torch")):
        if ea.get(key) != eb.get(key):
            notes.append(f"the runs differ in {what}: {ea.get(key) or MISSING} (A) vs {eb.get(key) or MISSING} (B)")
    return CompareResult(_label(a, a_name), _label(b, b_name), metrics, rows, breakdown, notes, breakdown_note)
