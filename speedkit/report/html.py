"""``report.html``: the report as one self-contained page, with plots.

One file, nothing fetched: no scripts, fonts or style sheets from the network; the plots are PNGs made
with matplotlib's Agg renderer and embedded as ``data:`` URIs. matplotlib is used through its
object-oriented API (:class:`matplotlib.figure.Figure` on a :class:`FigureCanvasAgg`), so neither
pyplot's global figure registry nor the user's chosen backend is touched; style settings are made
inside :func:`matplotlib.rc_context` and undone after. Without matplotlib the page is written
without its plots and says how to get them.

Renders the dict of a ``report.json`` (schema 2 or 3): the sections fed by schema 3's keys
(``profile``, ``attribution``, ``telemetry_timeline``, ``fit_monitor``) say "not measured in this
run" when their key is absent or null. Every string from the report is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from speedkit.report.markdown import (
    MISSING,
    STATUS_LABELS,
    TABLE_COLUMNS,
    format_bytes,
    format_gain,
    format_percent,
    format_throughput,
    holds_line,
    rung_cells,
)

__all__ = ["CATEGORY_COLORS", "NO_MATPLOTLIB", "SECTIONS", "configurations", "plot_breakdown", "plot_memory",
           "plot_throughput_mfu", "plot_timeline", "plot_waterfall", "render_html"]

#: the page's note where matplotlib is missing
NO_MATPLOTLIB = "plots need matplotlib (pip install matplotlib)"
NOT_MEASURED = "not measured in this run"

#: the breakdown categories' colours, in their fixed order (Okabe-Ito first: tells apart for most
#: colour vision); a category not listed takes one of :data:`_EXTRA_COLORS` in order of appearance
CATEGORY_COLORS = {
    "data_wait": "#8c564b",
    "host_idle": "#c7c7c7",
    "gemm": "#0072b2",
    "attention": "#56b4e9",
    "normalization": "#009e73",
    "elementwise": "#e69f00",
    "loss": "#cc79a7",
    "optimizer": "#d55e00",
    "memcpy": "#f0e442",
    "communication": "#6a3d9a",
    "other": "#7f7f7f",
}
_EXTRA_COLORS = ("#17becf", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39")

#: statuses listed under "not applied and why"
_NOT_APPLIED = ("not_applicable", "reverted", "failed", "interrupted")

_BLUE, _GREEN, _RED, _GREY = "#0072b2", "#009e73", "#d55e00", "#9aa4ae"


# -- small helpers ----------------------------------------------------------------------------

def _known(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _e(value: Any) -> str:
    """Escaped text of anything from the report; "—" for a missing value."""
    if value is None or value == "":
        return MISSING
    return html.escape(str(value), quote=True)


def _ms(value: Any, digits: int | None = None) -> str:
    if not _known(value):
        return MISSING
    if digits is None:
        digits = 2 if abs(value) < 10 else 1
    return f"{value:,.{digits}f} ms"


def _signed_ms(value: Any) -> str:
    if not _known(value):
        return MISSING
    return f"{value:+,.1f} ms".replace("-", "−")


def _signed_bytes(value: Any) -> str:
    if not _known(value):
        return MISSING
    if abs(value) < 5e6:
        return "0.00 GB"
    return f"{value / 1e9:+.2f} GB".replace("-", "−")


def _num(value: Any, spec: str, unit: str = "") -> str:
    return f"{format(value, spec)}{unit}" if _known(value) else MISSING


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = (),
           row_classes: Sequence[str] | None = None, cls: str = "") -> str:
    """A table of already-escaped cells; columns in ``numeric`` right-aligned."""
    num = set(numeric)
    head = "".join(f'<th{" class=num" if i in num else ""}>{h}</th>' for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        klass = f' class="{row_classes[r]}"' if row_classes and row_classes[r] else ""
        body.append(f"<tr{klass}>" + "".join(
            f'<td{" class=num" if i in num else ""}>{c}</td>' for i, c in enumerate(row)) + "</tr>")
    return (f'<div class="scroll"><table{f" class={cls}" if cls else ""}><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def _note(text: str) -> str:
    return f'<p class="note">{text}</p>'


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{html.escape(title)}</h2>\n{body}\n</section>'


def _category_color(category: str, order: Sequence[str]) -> str:
    if category in CATEGORY_COLORS:
        return CATEGORY_COLORS[category]
    extra = [c for c in order if c not in CATEGORY_COLORS]
    i = extra.index(category) if category in extra else len(extra)
    return _EXTRA_COLORS[i % len(_EXTRA_COLORS)]


# -- what the page plots ------------------------------------------------------------------------

def _final_measurement(d: dict[str, Any]) -> dict[str, Any]:
    fc = d.get("final_check") or {}
    if fc.get("b"):
        return fc["b"]
    for rung in reversed(d.get("rungs") or []):
        if rung.get("status") in ("kept", "closing") and rung.get("measurement"):
            return rung["measurement"]
    return {}


def _baseline_measurement(d: dict[str, Any]) -> dict[str, Any]:
    fc = d.get("final_check") or {}
    if fc.get("a"):
        return fc["a"]
    for rung in d.get("rungs") or []:
        if rung.get("status") == "baseline":
            return rung.get("measurement") or {}
    return {}


#: what a profile window's times are
PROFILED_CAVEAT = ("the windows are timed with the profiler on, whose cost per op inflates their step times (on a CPU "
                   "most): their categories say where the time goes; the speedups are the paired measurements'")


def configurations(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The configurations the ladder went through: the baseline, each kept rung (the configuration
    with it, from its comparison, in the order tried) and the final one (the final check's).

    Each: ``label``, ``kind`` (``"baseline"``, ``"kept"``, ``"final"``) and ``measurement`` (a dict,
    empty when not measured). The baseline and the final configuration are the final check's
    measurements when there is one, so their figures match the headline."""
    s = d.get("summary") or {}
    base = dict(_baseline_measurement(d))
    if _known(s.get("baseline_step_ms")):
        base["step_ms"] = s["baseline_step_ms"]
    out = [{"label": "baseline", "kind": "baseline", "measurement": base}]
    for rung in d.get("rungs") or []:
        if rung.get("status") == "kept":
            out.append({"label": str(rung.get("name")), "kind": "kept", "measurement": rung.get("measurement") or {}})
    if len(out) > 1 or (d.get("final_check") or {}).get("b"):
        final = dict(_final_measurement(d))
        if _known(s.get("final_step_ms")):
            final["step_ms"] = s["final_step_ms"]
        out.append({"label": "final", "kind": "final", "measurement": final})
    return out


# -- plots: one small function per figure; each returns PNG bytes -------------------------------

def _load_matplotlib() -> Any | None:
    """matplotlib's pieces the plots use, or None where it is not installed."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return matplotlib, Figure, FigureCanvasAgg


_STYLE = {
    "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": 9,
    "ytick.labelsize": 9, "legend.fontsize": 9, "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.color": "#e5e8eb", "grid.linewidth": 0.8, "axes.axisbelow": True,
    "axes.edgecolor": "#8c959f", "font.family": "DejaVu Sans",
    "text.parse_math": False,  # a "$" in a rung's name is text, not mathtext
}


def _png(mpl: Any, draw: Callable[[Any], None], size: tuple[float, float]) -> bytes:
    matplotlib, Figure, FigureCanvasAgg = mpl
    with matplotlib.rc_context(_STYLE):
        fig = Figure(figsize=size, dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=150, facecolor="white")
    return buf.getvalue()


def plot_waterfall(mpl: Any, rows: Sequence[tuple[str, float]]) -> bytes:
    """Step time per configuration, baseline at the top: each bar the step time with it, the part a
    rung removed (or added) drawn as a lighter segment, labelled with ms and × the baseline."""
    base = rows[0][1]

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        ys = list(range(len(rows)))
        prev = None
        for y, (label, ms) in zip(ys, rows):
            last = y == len(rows) - 1 and label == "final"
            color = _BLUE if y == 0 else (_GREEN if last else "#5b8fc7")
            ax.barh(y, ms, color=color, height=0.62)
            if prev is not None and not last:
                lo, hi = sorted((prev, ms))
                up = ms > prev
                ax.barh(y, hi - lo, left=lo, height=0.62, color="#f7c6b5" if up else "#b8e5d6",
                        hatch="///" if up else None, edgecolor=_RED if up else "none", linewidth=0)
            text = f"{ms:,.1f} ms · {base / ms:.2f}×" if ms > 0 else f"{ms:,.1f} ms"
            ax.text(max(ms, prev or 0) + base * 0.01, y, text, va="center", fontsize=9)
            prev = ms
        ax.set_yticks(ys, [r[0] for r in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, base * 1.32)
        ax.set_xlabel("step time (ms per optimizer step) — shorter is faster")
        ax.grid(axis="y", visible=False)

    return _png(mpl, draw, (10, 0.42 * len(rows) + 1.0))


def _si_tick(v: float, _pos: Any = None) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:g}{suffix}"
    return f"{v:g}"


def plot_throughput_mfu(mpl: Any, rows: Sequence[tuple[str, float | None, float | None]], unit: str) -> bytes:
    """Throughput and MFU per configuration, side by side."""

    def draw(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2, sharey=True)
        ys = list(range(len(rows)))
        labels = [r[0] for r in rows]
        tp = [r[1] if _known(r[1]) else 0 for r in rows]
        mfu = [r[2] * 100 if _known(r[2]) else 0 for r in rows]
        colors = [_BLUE if i == 0 else (_GREEN if labels[i] == "final" else "#5b8fc7") for i in ys]
        ax1.barh(ys, tp, color=colors, height=0.62)
        ax2.barh(ys, mfu, color=colors, height=0.62)
        top_tp, top_mfu = max(tp) or 1, max(mfu) or 1
        for y, r in zip(ys, rows):
            ax1.text(tp[y] + top_tp * 0.01, y, format_throughput(r[1]) if _known(r[1]) else "not measured", va="center", fontsize=9)
            ax2.text(mfu[y] + top_mfu * 0.01, y, f"{mfu[y]:.1f}%" if _known(r[2]) else "not measured", va="center", fontsize=9)
        ax1.set_yticks(ys, labels)
        ax1.invert_yaxis()
        ax1.set_xlim(0, top_tp * 1.25)
        ax2.set_xlim(0, top_mfu * 1.25)
        ax1.xaxis.set_major_formatter(_si_tick)
        ax1.set_xlabel(f"throughput ({unit})")
        ax2.set_xlabel("MFU (% of peak)")
        for ax in (ax1, ax2):
            ax.grid(axis="y", visible=False)

    return _png(mpl, draw, (10, 0.36 * len(rows) + 1.0))


def plot_memory(mpl: Any, rows: Sequence[tuple[str, float | None]]) -> bytes:
    """Peak memory allocated per configuration, in GB."""

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        ys = list(range(len(rows)))
        gb = [r[1] / 1e9 if _known(r[1]) else 0 for r in rows]
        top = max(gb) or 1
        colors = [_BLUE if i == 0 else (_GREEN if rows[i][0] == "final" else "#5b8fc7") for i in ys]
        ax.barh(ys, gb, color=colors, height=0.62)
        for y, r in zip(ys, rows):
            ax.text(gb[y] + top * 0.01, y, f"{gb[y]:.2f} GB" if _known(r[1]) else "not measured", va="center", fontsize=9)
        ax.set_yticks(ys, [r[0] for r in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.2)
        ax.set_xlabel("peak memory allocated (GB, torch.cuda.max_memory_allocated)")
        ax.grid(axis="y", visible=False)

    return _png(mpl, draw, (10, 0.36 * len(rows) + 1.0))


def plot_breakdown(mpl: Any, windows: Sequence[dict[str, Any]], categories: Sequence[str],
                   labels: dict[str, str], shares: bool = False) -> bytes:
    """Stacked horizontal bars: each profiled window's step split into categories, in ms per step;
    with ``shares``, a second panel of the same split as a share of each window's step (so a small
    step's make-up stays readable next to a large one)."""

    def draw(fig: Any) -> None:
        if shares:
            ax, ax_share = fig.subplots(1, 2, sharey=True, width_ratios=[3, 2])
        else:
            ax, ax_share = fig.add_subplot(), None
        ys = list(range(len(windows)))
        totals = [sum(float(v or 0) for v in (w.get("breakdown_ms") or {}).values()) or 1.0 for w in windows]
        left = [0.0] * len(windows)
        left_share = [0.0] * len(windows)
        for cat in categories:
            vals = [float((w.get("breakdown_ms") or {}).get(cat) or 0) for w in windows]
            if not any(vals):
                continue
            style = {"height": 0.6, "color": _category_color(cat, categories), "edgecolor": "white",
                     "linewidth": 0.5, "hatch": "//" if cat == "host_idle" else None}
            ax.barh(ys, vals, left=left, label=labels.get(cat, cat), **style)
            left = [a + b for a, b in zip(left, vals)]
            if ax_share is not None:
                pct = [100 * v / t for v, t in zip(vals, totals)]
                ax_share.barh(ys, pct, left=left_share, **style)
                left_share = [a + b for a, b in zip(left_share, pct)]
        top = max(left) or 1
        for y, w in zip(ys, windows):
            ax.text(left[y] + top * 0.01, y, _ms(w.get("step_ms")), va="center", fontsize=9)
        ax.set_yticks(ys, [str(w.get("label")) for w in windows])
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.18)
        ax.set_xlabel("ms per optimizer step")
        ax.grid(axis="y", visible=False)
        if ax_share is not None:
            ax_share.set_xlim(0, 100)
            ax_share.set_xlabel("share of the step (%)")
            ax_share.grid(axis="y", visible=False)
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=6, frameon=False)

    return _png(mpl, draw, (10, 0.42 * len(windows) + 1.9))


def plot_timeline(mpl: Any, timeline: dict[str, Any]) -> bytes:
    """NVML over time: utilization, power against its limit, SM clock; samples with a clock-event
    reason shaded (they confound the timing)."""
    samples = [s for s in timeline.get("samples") or [] if isinstance(s, dict)]

    def draw(fig: Any) -> None:
        axes = fig.subplots(3, 1, sharex=True)
        t = [s.get("t_s") if _known(s.get("t_s")) else i * (timeline.get("interval_s") or 1) for i, s in enumerate(samples)]

        def series(key: str) -> list[float]:
            return [s.get(key) if _known(s.get(key)) else math.nan for s in samples]

        axes[0].plot(t, series("util"), color=_BLUE, linewidth=1.4)
        axes[0].set_ylabel("GPU util (%)")
        axes[0].set_ylim(0, 105)
        axes[1].plot(t, series("power_w"), color=_RED, linewidth=1.4, label="power draw")
        limit = series("power_limit_w")
        if any(not math.isnan(v) for v in limit):
            axes[1].plot(t, limit, color="#444c56", linewidth=1.2, linestyle="--", label="power limit")
        axes[1].set_ylabel("power (W)")
        axes[1].set_ylim(bottom=0)
        axes[1].legend(loc="lower right", frameon=False, ncol=2)
        axes[2].plot(t, series("sm_clock_mhz"), color=_GREEN, linewidth=1.4)
        axes[2].set_ylabel("SM clock (MHz)")
        axes[2].set_ylim(bottom=0)
        axes[2].set_xlabel("time (s)")
        dt = timeline.get("interval_s") if _known(timeline.get("interval_s")) else (t[1] - t[0] if len(t) > 1 else 1)
        flagged = [(ti, s.get("reasons") or []) for ti, s in zip(t, samples)
                   if [r for r in s.get("reasons") or [] if r != "gpu_idle"]]
        for ti, _ in flagged:
            for ax in axes:
                ax.axvspan(ti - dt / 2, ti + dt / 2, color="#f0e442", alpha=0.35, linewidth=0)
        marks = [m for m in timeline.get("marks") or [] if isinstance(m, dict) and _known(m.get("t_s"))]
        for m in marks:  # where each configuration's window began
            for ax in axes:
                ax.axvline(m["t_s"], color="#57606a", linewidth=0.8, linestyle=":")
            axes[0].text(m["t_s"], 4, str(m.get("label")), rotation=90, va="bottom", ha="left", fontsize=8,
                         color="#24292f", clip_on=True,
                         bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1.0})
        if flagged:
            reasons = sorted({r for _, rs in flagged for r in rs if r != "gpu_idle"})
            axes[0].set_title("shaded: clock-event reason (" + ", ".join(reasons) + ") — a confounder", loc="left",
                              fontsize=9, color="#6e5a00")

    return _png(mpl, draw, (10, 5.2))


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


class _Plots:
    """Makes the page's figures; never fails the page: a missing matplotlib or a plot that raised
    becomes a one-line note in its place."""

    def __init__(self) -> None:
        self.mpl = _load_matplotlib()

    def __call__(self, alt: str, fn: Callable[..., bytes], *args: Any) -> str:
        if self.mpl is None:
            return _note(html.escape(NO_MATPLOTLIB))
        try:
            return _img(fn(self.mpl, *args), alt)
        except Exception as exc:  # a plot is never worth failing the report for
            return _note(f"(the plot could not be drawn: {_e(type(exc).__name__)}: {_e(exc)})")


# -- the sections ---------------------------------------------------------------------------------

def _headline(d: dict[str, Any]) -> str:
    s = d.get("summary") or {}
    fc = d.get("final_check") or {}
    unit = s.get("throughput_unit")
    ci = s.get("speedup_ci")
    conf = fc.get("confidence") if _known(fc.get("confidence")) else (d.get("measure") or {}).get("confidence")
    ci_text = (f"{_num(conf * 100 if _known(conf) else None, '.0f', '%')} interval {ci[0]:.2f}–{ci[1]:.2f}×"
               if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_known(c) for c in ci) else "no interval")
    base, final = _baseline_measurement(d), _final_measurement(d)
    speed = s.get("speedup")
    cards = [
        ("speedup vs baseline", format_gain(speed), f"{ci_text}; {_e(s.get('figures_from'))}"),
        ("step time", f"{_ms(s.get('final_step_ms'))}", f"from {_ms(s.get('baseline_step_ms'))}"),
        ("throughput" + (f" ({unit})" if unit else ""), format_throughput(s.get("final_throughput")),
         f"from {format_throughput(s.get('baseline_throughput'), unit)}"),
        ("MFU", format_percent(final.get("mfu")), f"from {format_percent(base.get('mfu'))}"),
        ("peak memory", format_bytes(final.get("peak_memory_bytes")), f"from {format_bytes(base.get('peak_memory_bytes'))}"),
    ]
    out = ['<div class="cards">']
    for label, value, sub in cards:
        out.append(f'<div class="card"><div class="label">{_e(label)}</div><div class="value">{_e(value)}</div>'
                   f'<div class="sub">{sub}</div></div>')
    out.append("</div>")
    kept = s.get("kept") or []
    out.append(f"<p><b>Kept rungs</b> ({len(kept)}, in the order tried): "
               + (", ".join(f"<code>{_e(k)}</code>" for k in kept) or "none") + "</p>")
    if s.get("interrupted") or d.get("interrupted"):
        out.append(f'<p class="warn"><b>Interrupted:</b> {_e(s.get("interrupted") or d.get("interrupted"))}; '
                   "the rungs are those finished before it.</p>")
    if s.get("note"):
        out.append(f'<p class="warn"><b>Note:</b> {_e(s["note"])}</p>')
    holds = holds_line(d)
    if holds:
        klass = "warn" if (d.get("holds") or {}).get("flagged") else "note"
        out.append(f'<p class="{klass}"><b>In training:</b> {_e(holds)}</p>')
    vs = s.get("vs_switches")
    if isinstance(vs, (list, tuple)) and len(vs) == 3 and all(_known(v) for v in vs):
        out.append(f'<p class="note">Against the switches a user would flip by hand: {vs[0]:.2f}× '
                   f"(interval {vs[1]:.2f}–{vs[2]:.2f}×).</p>")
    return "\n".join(out)


def _waterfall(d: dict[str, Any], plots: _Plots) -> str:
    rows = [(c["label"], c["measurement"].get("step_ms")) for c in configurations(d)]
    rows = [(label, ms) for label, ms in rows if _known(ms) and ms > 0]
    if len(rows) < 2:
        return _note(f"Step time per configuration: {NOT_MEASURED} (no rung was kept).")
    base = rows[0][1]
    table = _table(["configuration", "step time", "change vs previous", "× baseline"],
                   [[_e(label), _ms(ms), MISSING if i == 0 else _signed_ms(ms - rows[i - 1][1]), f"{base / ms:.2f}×"]
                    for i, (label, ms) in enumerate(rows)], numeric=(1, 2, 3))
    final, kept = rows[-1][1], [ms for label, ms in rows[1:-1]]
    spread = _final_measurement(d).get("spread")
    odd = ""
    if rows[-1][0] == "final" and kept and final > min(kept) * 1.03:
        odd = _note(f"<b>The final bar is slower than a kept rung's:</b> the rungs' bars come from their own paired "
                    f"comparisons, the final one from the final check, in which the step time varied by "
                    f"{format_percent(spread)} (window to window). The speedup uses paired blocks, not these bars.")
    return (plots("step time per configuration", plot_waterfall, rows) + odd
            + _note("Each kept rung's bar is the step time with it (and the rungs kept before it), from its own "
                    "paired comparison; the light segment is what it removed (green) or added (red, hatched). "
                    "× is the baseline's step time over this one. Baseline and final are the final check's "
                    "interleaved measurements.")
            + "<details><summary>as a table</summary>" + table + "</details>")


def _throughput(d: dict[str, Any], plots: _Plots) -> str:
    confs = configurations(d)
    unit = (d.get("summary") or {}).get("throughput_unit") or next(
        (c["measurement"].get("throughput_unit") for c in confs if c["measurement"].get("throughput_unit")), "items/s")
    rows = [(c["label"], c["measurement"].get("throughput"), c["measurement"].get("mfu")) for c in confs]
    if not any(_known(r[1]) for r in rows):
        return _note(f"Throughput: {NOT_MEASURED}.")
    flops = d.get("flops") or {}
    peak = flops.get("peak_tflops")
    table = _table(["configuration", "throughput", "MFU", "achieved"],
                   [[_e(c["label"]), _e(format_throughput(c["measurement"].get("throughput"), unit)),
                     format_percent(c["measurement"].get("mfu")), _num(c["measurement"].get("tflops"), ".1f", " TFLOP/s")]
                    for c in confs], numeric=(1, 2, 3))
    peak_text = (f"MFU against a peak of {peak:g} TFLOP/s ({_e(flops.get('peak_source'))})" if _known(peak)
                 else "no MFU: no peak is known for this device")
    return (plots("throughput and MFU per configuration", plot_throughput_mfu, rows, unit) + _note(peak_text + ".")
            + "<details><summary>as a table (with achieved TFLOP/s)</summary>" + table + "</details>")


def _memory(d: dict[str, Any], plots: _Plots) -> str:
    confs = configurations(d)
    rows = [(c["label"], c["measurement"].get("peak_memory_bytes")) for c in confs]
    if not any(_known(r[1]) for r in rows):
        return _note(f"Peak memory: {NOT_MEASURED} (measured on CUDA only).")
    base = rows[0][1]
    table = _table(["configuration", "peak memory", "vs baseline"],
                   [[_e(label), format_bytes(b), _signed_bytes(b - base) if _known(b) and _known(base) and i else MISSING]
                    for i, (label, b) in enumerate(rows)], numeric=(1, 2))
    return plots("peak memory per configuration", plot_memory, rows) + "<details><summary>as a table</summary>" + table + "</details>"


def _profile_parts(d: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], list[str], dict[str, str]]:
    p = d.get("profile") or {}
    windows = [w for w in p.get("windows") or [] if isinstance(w, dict)]
    cats = list(p.get("categories") or [])
    for w in windows:  # categories a window has that the list lacks, in their order
        cats += [c for c in (w.get("breakdown_ms") or {}) if c not in cats]
    labels = {c: str((p.get("labels") or {}).get(c) or c.replace("_", " ")) for c in cats}
    return p, windows, cats, labels


def _breakdown(d: dict[str, Any], plots: _Plots) -> str:
    p, windows, cats, labels = _profile_parts(d)
    if not windows:
        note = p.get("note") if p else None
        return _note(f"Time breakdown: {NOT_MEASURED}" + (f" ({_e(note)})" if note else "") + ".")
    before = next((w for w in windows if w.get("label") == "baseline"), windows[0])
    after = next((w for w in windows if w.get("label") == "final"), windows[-1])
    out = []
    if p.get("note"):
        out.append(_note(_e(p["note"])))
    shown = [before, after] if after is not before else [before]
    out.append(plots("time breakdown before and after", plot_breakdown, shown, cats, labels, True))
    rows = []
    bb, ab = before.get("breakdown_ms") or {}, after.get("breakdown_ms") or {}
    for c in cats:
        b, a = bb.get(c), ab.get(c)
        if not (_known(b) and b) and not (_known(a) and a):
            continue
        swatch = f'<span class="swatch" style="background:{_category_color(c, cats)}"></span>'
        share = lambda v, w: format_percent(v / w["step_ms"]) if _known(v) and _known(w.get("step_ms")) and w["step_ms"] else MISSING  # noqa: E731
        rows.append([swatch + _e(labels[c]), _ms(b), _ms(a), _signed_ms(a - b) if _known(a) and _known(b) else MISSING,
                     share(b, before), share(a, after)])
    rows.append(["<b>step</b>", f"<b>{_ms(before.get('step_ms'))}</b>", f"<b>{_ms(after.get('step_ms'))}</b>",
                 _signed_ms(after["step_ms"] - before["step_ms"]) if _known(after.get("step_ms")) and _known(before.get("step_ms")) else MISSING,
                 "", ""])
    rows.append(["device busy", format_percent(before.get("device_busy_fraction")),
                 format_percent(after.get("device_busy_fraction")), "", "", ""])
    out.append(_table(["category", f"before ({_e(before.get('label'))})", f"after ({_e(after.get('label'))})", "Δ",
                       "share before", "share after"], rows, numeric=(1, 2, 3, 4, 5)))
    steps = p.get("steps") or before.get("steps")
    out.append(_note(f"ms per optimizer step, averaged over {_e(steps)} profiled steps per window; "
                     "“host-bound idle GPU” is time the GPU waited for the host to issue work; " + PROFILED_CAVEAT + "."))
    if len(windows) > 2:
        out.append("<details><summary>every profiled window (one per kept rung)</summary>"
                   + plots("time breakdown of every profiled window", plot_breakdown, windows, cats, labels) + "</details>")
    for w in shown:
        ops = [o for o in w.get("top_ops") or [] if isinstance(o, dict)]
        if ops:
            out.append(f"<h3>Top kernels: {_e(w.get('label'))}</h3>" + _table(
                ["kernel / op", "category", "ms per step"],
                [[f'<code class="op" title="{_e(o.get("name"))}">{_e(_shorten(str(o.get("name") or ""), 90))}</code>',
                  _e(labels.get(o.get("category"), o.get("category"))), _ms(o.get("ms"))] for o in ops], numeric=(2,)))
    return "\n".join(out)


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _attribution(d: dict[str, Any]) -> str:
    a = d.get("attribution")
    rows_in = [r for r in (a or {}).get("rungs") or [] if isinstance(r, dict)]
    if not rows_in:
        return _note(f"Attribution: {NOT_MEASURED}.")
    labels = _profile_parts(d)[3]
    rows = []
    for r in rows_in:
        moved = "<br>".join(
            f"{_e(labels.get(m.get('category'), m.get('category')))} {_num(m.get('before_ms'), ',.1f')} → "
            f"{_num(m.get('after_ms'), ',.1f')} ms" for m in r.get("moved") or [] if isinstance(m, dict)) or MISSING
        group = [g for g in r.get("group") or [] if g != r.get("name")]
        together = f'<br><span class="note">kept with {_e(", ".join(map(str, group)))}</span>' if group else ""
        rows.append([f"<code>{_e(r.get('name'))}</code>{together}", format_gain(r.get("speedup")), _signed_ms(r.get("ms_per_step")),
                     format_percent(r.get("share")), moved, _signed_bytes(r.get("peak_memory_delta_bytes"))])
    out = [_table(["rung", "speedup", "ms per step", "share of the gain", "categories moved", "peak memory"],
                  rows, numeric=(1, 2, 3, 5))]
    product, measured = a.get("product"), a.get("measured")
    agrees = a.get("agrees")
    verdict = "agree" if agrees else ("do not agree" if agrees is False else "—")
    out.append(f'<p class="{"note" if agrees else "warn"}"><b>Check:</b> the kept rungs\' speedups multiply to '
               f"{format_gain(product)}; the final check measured {format_gain(measured)}: they {verdict}.</p>")
    if a.get("interaction"):
        out.append(f'<p class="warn"><b>Interaction:</b> {_e(a["interaction"])}</p>')
    return "\n".join(out)


def _host_syncs(d: dict[str, Any]) -> str:
    syncs = (d.get("profile") or {}).get("host_syncs")
    if not isinstance(syncs, dict) or not syncs:
        why = (d.get("profile") or {}).get("host_syncs_note")
        return _note(f"Host syncs: {why or NOT_MEASURED}.")
    out = []
    for label in [k for k in ("baseline", "final") if k in syncs] + [k for k in syncs if k not in ("baseline", "final")]:
        items = [s for s in syncs.get(label) or [] if isinstance(s, dict)]
        title = {"baseline": "Before (baseline)", "final": "After (final)"}.get(label, str(label))
        if not items:
            out.append(f"<h3>{_e(title)}</h3>" + _note("none found"))
            continue
        out.append(f"<h3>{_e(title)}</h3>" + _table(
            ["where", "code", "why it syncs", "found in one step"],
            [[f'<code class="path">{_e(s.get("where"))}</code>', f"<code>{_e(s.get('code'))}</code>", _e(s.get("reason")),
              _e(s.get("count"))] for s in items], numeric=(3,)))
    out.append(_note("A host sync makes the CPU wait for the GPU to finish (<code>.item()</code>, printing a tensor, "
                     "a branch on a CUDA value), so the GPU then waits for the next step's work."))
    return "\n".join(out)


def _traces(d: dict[str, Any], out_dir: Path | None) -> str:
    windows = _profile_parts(d)[1]
    if not windows:
        return _note(f"Traces: {NOT_MEASURED}.")
    rows, without = [], {}
    for w in windows:
        trace = w.get("trace")
        if not trace:  # one line per reason, not one per window
            without.setdefault(str(w.get("trace_note") or "no trace written"), []).append(str(w.get("label")))
            continue
        if isinstance(trace, str) and trace and "://" not in trace and not trace.startswith(("/", "\\")) and ".." not in Path(trace).parts:
            found = out_dir is None or (Path(out_dir) / trace).exists()
            cell = f'<a href="{_e(trace)}">{_e(trace)}</a>' + ("" if found else ' <span class="note">(not found next to this report)</span>')
        elif isinstance(trace, str) and trace:
            cell = f"<code>{_e(trace)}</code>"
        else:
            cell = MISSING
        rows.append([_e(w.get("label")), cell, _e(w.get("trace_note")) if w.get("trace_note") else ""])
    for note, labels in without.items():
        rows.append([_e(", ".join(labels)), MISSING, _e(note)])
    return (_table(["window", "trace (relative to this file)", "note"], rows)
            + _note("Open a trace in https://ui.perfetto.dev or chrome://tracing (drag the file in; "
                    "this page itself loads nothing from the network)."))


def _telemetry(d: dict[str, Any], plots: _Plots) -> str:
    out = []
    tl = d.get("telemetry_timeline")
    if isinstance(tl, dict) and tl.get("samples"):
        samples = [s for s in tl["samples"] if isinstance(s, dict)]
        marks = [str(m.get("label")) for m in tl.get("marks") or [] if isinstance(m, dict)]
        what = (f"while timing <b>{_e(tl['label'])}</b>" if tl.get("label") else
                f"across the profiled windows ({_e(', '.join(marks))}; dotted lines mark where each began)" if marks
                else "while timing")
        out.append(f"<p>Sampled every {_num(tl.get('interval_s'), '.2f', ' s')} {what}: {len(samples)} samples.</p>")
        out.append(plots("NVML timeline", plot_timeline, tl))
        counts: dict[str, int] = {}
        during: dict[str, list[str]] = {}
        starts = sorted(((m["t_s"], str(m.get("label"))) for m in tl.get("marks") or []
                         if isinstance(m, dict) and _known(m.get("t_s"))), key=lambda m: m[0])
        for s in samples:
            for r in s.get("reasons") or []:
                counts[r] = counts.get(r, 0) + 1
                t = s.get("t_s")
                window = next((label for start, label in reversed(starts) if _known(t) and start <= t), None)
                if window and window not in during.setdefault(r, []):
                    during[r].append(window)
        confounders = {r: n for r, n in counts.items() if r != "gpu_idle"}
        if confounders:
            out.append('<p class="warn"><b>Confounders:</b> clock-event reasons in '
                       + ", ".join(f"<code>{_e(r)}</code> ({n} of {len(samples)} samples"
                                   + (f", during {_e(', '.join(during[r]))}" if during.get(r) else "") + ")"
                                   for r, n in sorted(confounders.items()))
                       + ": the clocks moved while timing, so step times from those samples carry that change.</p>")
        else:
            out.append(_note("No clock-event reasons besides idle: the clocks did not confound the timing."))
    else:
        out.append(_note(f"Telemetry timeline: {NOT_MEASURED}."))
    rows, flags = [], []
    for rung in d.get("rungs") or []:
        t = (rung.get("measurement") or {}).get("telemetry")
        if not t:
            continue
        slow = t.get("slowdown_reasons") or []
        rows.append([_e(rung.get("name")), _num(t.get("util_mean"), ".0f", "%"),
                     f"{_num(t.get('power_mean_w'), '.0f')} / {_num(t.get('power_max_w'), '.0f', ' W')}",
                     f"{_num(t.get('sm_clock_mean_mhz'), '.0f')} / {_num(t.get('sm_clock_min_mhz'), '.0f', ' MHz')}",
                     format_bytes(t.get("mem_used_max_bytes")),
                     (_e(", ".join(slow)) + f" ({format_percent(t.get('slowdown_fraction'))})") if slow else "none"])
        flags.append("flag" if slow else "")
    if rows:
        out.append("<details><summary>NVML summary per measured configuration</summary>" + _table(
            ["configuration", "util (mean)", "power mean / max", "SM clock mean / min", "memory used (max)", "slowdown reasons"],
            rows, numeric=(1, 2, 3, 4), row_classes=flags) + "</details>")
    return "\n".join(out)


def _in_training(d: dict[str, Any]) -> str:
    fm = d.get("fit_monitor")
    out = []
    if isinstance(fm, dict) and fm:
        unit = fm.get("throughput_unit")
        rows = [
            ["steps monitored", _e(fm.get("steps"))],
            ["step time (median)", _ms(fm.get("step_ms_median"))],
            ["throughput", _e(format_throughput(fm.get("throughput"), unit))],
            ["MFU", format_percent(fm.get("mfu"))],
            ["waiting for data", _ms(fm.get("data_wait_ms"))],
            ["peak memory allocated", format_bytes(fm.get("peak_memory_bytes"))],
            ["memory reserved", format_bytes(fm.get("reserved_bytes"))],
            ["allocator retries", _e(fm.get("alloc_retries"))],
        ]
        out.append(_table(["the fit's own steps", "value"], rows, numeric=(1,), cls="narrow"))
        if fm.get("overhead_note"):
            out.append(_note(_e(fm["overhead_note"])))
    else:
        out.append(_note(f"Fit monitor: {NOT_MEASURED}."))
    return "\n".join(out)


def _environment(d: dict[str, Any]) -> str:
    env = d.get("environment") or {}
    flops = d.get("flops") or {}
    run = d.get("run") or {}
    cc = env.get("gpu_compute_capability")
    rows = [
        ("device", d.get("device") or env.get("device")),
        ("GPU", f"{env['gpu_name']} (compute capability {cc or MISSING}, {format_bytes(env.get('gpu_memory_bytes'))}), "
                f"{env.get('gpu_count') or MISSING} visible" if env.get("gpu_name") else None),
        ("GPU driver", env.get("gpu_driver")),
        ("CPU", f"{env.get('cpu_model') or MISSING}: {env.get('cpu_usable') or MISSING} of {env.get('cpu_count') or MISSING} "
                f"usable, {env.get('torch_threads') or MISSING} torch threads"),
        ("python", env.get("python")),
        ("torch", f"{env.get('torch')}" + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else "") if env.get("torch") else None),
        ("triton", env.get("triton")), ("lightning", env.get("lightning")), ("cuDNN", _cudnn(env.get("cudnn"))),
        ("speedkit", env.get("speedkit")), ("platform", env.get("platform")),
        ("precision / accumulation", f"{run.get('precision') or MISSING}, {run.get('accumulate_grad_batches') or MISSING} "
                                     "batch(es) per optimizer step" if run else None),
        ("optimizer / strategy", f"{run.get('optimizer') or MISSING} / {run.get('strategy') or MISSING}" if run else None),
        ("FLOPs per step", f"{flops['per_step'] / 1e12:,.2f} TFLOP" if _known(flops.get("per_step")) else None),
        ("MFU peak", f"{flops['peak_tflops']:g} TFLOP/s — {flops.get('peak_source') or MISSING}" if _known(flops.get("peak_tflops")) else flops.get("peak_source")),
    ]
    table = _table(["", ""], [[_e(k), _e(v)] for k, v in rows], cls="kv")
    conv = flops.get("convention")
    return table + (_note("FLOPs convention: " + _e(conv)) if conv else "")


def _cudnn(v: Any) -> Any:
    """torch's cuDNN version number as people write it: 91900 → 9.19.0, 8906 → 8.9.6."""
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        return v
    if v >= 10000:  # cuDNN 9+: major * 10000 + minor * 100 + patch
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def _not_applied(d: dict[str, Any]) -> str:
    rows = [r for r in d.get("rungs") or [] if r.get("status") in _NOT_APPLIED]
    if not rows:
        return _note("Every rung tried was kept.")
    order = {s: i for i, s in enumerate(("failed", "interrupted", "reverted", "not_applicable"))}
    rows.sort(key=lambda r: order.get(r.get("status"), 9))
    return _table(["rung", "status", "why"],
                  [[f"<code>{_e(r.get('name'))}</code>", _e(STATUS_LABELS.get(r.get("status"), r.get("status"))),
                    _e(r.get("reason"))] for r in rows],
                  row_classes=[f"st-{_e(r.get('status'))}" for r in rows])


def _rungs(d: dict[str, Any]) -> str:
    rungs = d.get("rungs") or []
    if not rungs:
        return _note("No rungs.")
    cells = [[_e(c) for c in rung_cells(r)] for r in rungs]
    for row in cells:  # the parity cell breaks before its tolerance, not inside "3e-02"
        row[-1] = row[-1].replace(" (tol ", "<br>(tol ")
    table = _table([_e(c) for c in TABLE_COLUMNS], cells,
                   numeric=range(2, len(TABLE_COLUMNS) - 1),
                   row_classes=[f"st-{_e(r.get('status'))}" for r in rungs], cls="rungs")
    details = []
    for i, r in enumerate(rungs):
        status = STATUS_LABELS.get(r.get("status"), str(r.get("status")))
        items = []
        if r.get("reason"):
            items.append(f"<li>Reason: {_e(r['reason'])}</li>")
        opts = r.get("options") or {}
        if opts:
            items.append("<li>Options: " + ", ".join(f"<code>{_e(k)}={_e(v)}</code>" for k, v in opts.items()) + "</li>")
        for c in r.get("changes") or []:
            items.append(f"<li>Change: {_e(c)}</li>")
        c = r.get("comparison") or {}
        if c:
            items.append(f"<li>Paired timing: {_e(c.get('blocks'))} A B B A blocks, speedup {_num(c.get('speedup'), '.3f', '×')} "
                         f"[{_num(c.get('low'), '.3f')}–{_num(c.get('high'), '.3f')}]: {_e(str(c.get('verdict')).replace('_', ' '))}</li>")
        if _known(r.get("seconds")):
            items.append(f"<li>Time spent: {r['seconds']:.1f} s</li>")
        details.append(f"<details><summary>{i}. {_e(r.get('name'))} — {_e(status)}</summary><ul>{''.join(items)}</ul></details>")
    return table + _note("Step time: median ± noise; “vs previous”: paired speedup with its interval.") + "".join(details)


# -- the page -------------------------------------------------------------------------------------

_CSS = """
:root{color-scheme:light}
body{margin:0;background:#fff;color:#1f2328;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1080px;margin:0 auto;padding:24px 28px 64px}
h1{font-size:26px;margin:0 0 4px}
h2{font-size:20px;margin:36px 0 10px;padding-bottom:4px;border-bottom:1px solid #d0d7de}
h3{font-size:15px;margin:18px 0 6px}
nav{font-size:13px;margin:6px 0 10px;color:#59636e}
nav a{color:#0969da;margin-right:12px;text-decoration:none;white-space:nowrap}
a{color:#0969da}
.scroll{overflow-x:auto;margin:8px 0 14px}
table{border-collapse:collapse;width:100%;font-size:13.5px}
table.narrow,table.kv{width:auto;min-width:50%}
th,td{padding:5px 9px;border-bottom:1px solid #e1e4e8;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600;border-bottom:1px solid #d0d7de}
.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.rungs{font-size:12.5px}
table.rungs th,table.rungs td{padding:4px 6px}
table.rungs td{white-space:nowrap}
table.rungs td:last-child{white-space:normal;min-width:110px}
table.rungs td:first-child{white-space:normal;width:15%;min-width:120px}
table.kv td:first-child{color:#59636e;white-space:nowrap}
table.kv thead{display:none}
tr.st-kept td,tr.st-closing td{background:#f0fff4}
tr.st-failed td,tr.st-interrupted td,tr.flag td{background:#fff5f5}
tr.st-reverted td{background:#fffbea}
tr.st-not_applicable td{color:#59636e}
code{font:12.5px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;background:#f6f8fa;padding:0 3px;border-radius:3px}
code.path,code.op{word-break:break-all}
img.plot{display:block;width:100%;height:auto;margin:6px 0}
.note{color:#59636e;font-size:13.5px}
.warn{background:#fff8c5;border-left:3px solid #d4a72c;padding:6px 10px;font-size:14px}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(180px,1fr));gap:10px;margin:14px 0}
.card{border:1px solid #d0d7de;border-radius:8px;padding:10px 12px}
.card .label{font-size:12px;color:#59636e;letter-spacing:.02em}
.card .value{font-size:23px;white-space:nowrap;font-weight:650;font-variant-numeric:tabular-nums}
.card .sub{font-size:12.5px;color:#59636e}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:6px;vertical-align:-1px}
details{margin:6px 0}
summary{cursor:pointer;color:#0969da;font-size:14px}
details ul{margin:4px 0 10px;font-size:13.5px}
"""

#: (id, heading) of every section, in page order
SECTIONS = (
    ("headline", "Headline"),
    ("waterfall", "Step time by rung"),
    ("throughput", "Throughput and MFU"),
    ("memory", "Peak memory"),
    ("breakdown", "Where the time goes: before and after"),
    ("attribution", "Attribution: what each rung bought"),
    ("syncs", "Host syncs"),
    ("traces", "Traces"),
    ("telemetry", "GPU telemetry (NVML)"),
    ("training", "In training"),
    ("environment", "Environment"),
    ("not-applied", "Not applied, and why"),
    ("rungs", "Every rung"),
)


def render_html(report: dict[str, Any], out_dir: Path | str | None = None) -> str:
    """The whole ``report.html`` for a report dict (``report.json``'s content, schema 2 or 3).

    ``out_dir`` is where the page will be written: trace links are relative to it, and a trace not
    found there is marked so. Never raises for a plot: without matplotlib the page says
    :data:`NO_MATPLOTLIB` where each plot would be."""
    d = report
    out_dir = Path(out_dir) if out_dir is not None else None
    plots = _Plots()
    recipe = d.get("recipe")
    title = d.get("title") or f"speedkit report{f': {recipe}' if recipe else ''}"
    env = d.get("environment") or {}
    sub = " · ".join(_e(x) for x in (d.get("device"), env.get("gpu_name"), f"schema {d.get('schema_version')}") if x)
    bodies = {
        "headline": _headline(d),
        "waterfall": _waterfall(d, plots),
        "throughput": _throughput(d, plots),
        "memory": _memory(d, plots),
        "breakdown": _breakdown(d, plots),
        "attribution": _attribution(d),
        "syncs": _host_syncs(d),
        "traces": _traces(d, out_dir),
        "telemetry": _telemetry(d, plots),
        "training": _in_training(d),
        "environment": _environment(d),
        "not-applied": _not_applied(d),
        "rungs": _rungs(d),
    }
    nav = "\n".join(f'<a href="#{sid}">{html.escape(t.split(":")[0])}</a>' for sid, t in SECTIONS)
    parts = [
        "<!DOCTYPE html>",
        "<!-- Written by speedkit: report.html, rendered from report.json -->",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style></head><body><main>",
        f"<h1>{_e(title)}</h1>",
        f'<div class="note">{sub}</div>',
        f"<nav>{nav}</nav>",
    ]
    if plots.mpl is None:
        parts.append(f'<p class="warn">{html.escape(NO_MATPLOTLIB)}.</p>')
    for sid, heading in SECTIONS:
        parts.append(_section(sid, heading, bodies[sid]))
    parts.append("</main></body></html>")
    return "\n".join(parts) + "\n"
