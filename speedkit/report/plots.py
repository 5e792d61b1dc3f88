"""The figures of ``report.html``: one small function per plot, each returning PNG bytes.

matplotlib is used through its object-oriented API (a :class:`matplotlib.figure.Figure` on a
:class:`FigureCanvasAgg`), so neither pyplot's global figure registry nor the user's chosen backend is
touched; style settings are made inside :func:`matplotlib.rc_context` and undone after. Each plot takes
the pieces :func:`load_matplotlib` returns, or the page goes without it (:mod:`speedkit.report.html`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

from speedkit.report.markdown import MISSING, format_throughput

#: the page's note where matplotlib is missing
NO_MATPLOTLIB = "plots need matplotlib (pip install matplotlib)"


def known(value: Any) -> bool:
    """A finite number (not a bool): what a figure or a cell can show."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def ms_text(value: Any, digits: int | None = None) -> str:
    """Milliseconds as the report writes them ("12.3 ms"; MISSING where not known)."""
    if not known(value):
        return MISSING
    if digits is None:
        digits = 2 if abs(value) < 10 else 1
    return f"{value:,.{digits}f} ms"


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

#: the plots' own colours
_BLUE, _GREEN, _RED, _GREY = "#0072b2", "#009e73", "#d55e00", "#9aa4ae"


def category_color(category: str, order: Sequence[str]) -> str:
    if category in CATEGORY_COLORS:
        return CATEGORY_COLORS[category]
    extra = [c for c in order if c not in CATEGORY_COLORS]
    i = extra.index(category) if category in extra else len(extra)
    return _EXTRA_COLORS[i % len(_EXTRA_COLORS)]


# -- what the page plots ------------------------------------------------------------------------


# -- plots: one small function per figure; each returns PNG bytes -------------------------------


def load_matplotlib() -> Any | None:
    """matplotlib's pieces the plots use, or None where it is not installed."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return matplotlib, Figure, FigureCanvasAgg


_STYLE = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e5e8eb",
    "grid.linewidth": 0.8,
    "axes.axisbelow": True,
    "axes.edgecolor": "#8c959f",
    "font.family": "DejaVu Sans",
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
                ax.barh(
                    y,
                    hi - lo,
                    left=lo,
                    height=0.62,
                    color="#f7c6b5" if up else "#b8e5d6",
                    hatch="///" if up else None,
                    edgecolor=_RED if up else "none",
                    linewidth=0,
                )
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
        tp = [r[1] if known(r[1]) else 0 for r in rows]
        mfu = [r[2] * 100 if known(r[2]) else 0 for r in rows]
        colors = [_BLUE if i == 0 else (_GREEN if labels[i] == "final" else "#5b8fc7") for i in ys]
        ax1.barh(ys, tp, color=colors, height=0.62)
        ax2.barh(ys, mfu, color=colors, height=0.62)
        top_tp, top_mfu = max(tp) or 1, max(mfu) or 1
        for y, r in zip(ys, rows):
            ax1.text(
                tp[y] + top_tp * 0.01, y, format_throughput(r[1]) if known(r[1]) else "not measured", va="center", fontsize=9
            )
            ax2.text(mfu[y] + top_mfu * 0.01, y, f"{mfu[y]:.1f}%" if known(r[2]) else "not measured", va="center", fontsize=9)
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
        gb = [r[1] / 1e9 if known(r[1]) else 0 for r in rows]
        top = max(gb) or 1
        colors = [_BLUE if i == 0 else (_GREEN if rows[i][0] == "final" else "#5b8fc7") for i in ys]
        ax.barh(ys, gb, color=colors, height=0.62)
        for y, r in zip(ys, rows):
            ax.text(gb[y] + top * 0.01, y, f"{gb[y]:.2f} GB" if known(r[1]) else "not measured", va="center", fontsize=9)
        ax.set_yticks(ys, [r[0] for r in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.2)
        ax.set_xlabel("peak memory allocated (GB, torch.cuda.max_memory_allocated)")
        ax.grid(axis="y", visible=False)

    return _png(mpl, draw, (10, 0.36 * len(rows) + 1.0))


def plot_breakdown(
    mpl: Any, windows: Sequence[dict[str, Any]], categories: Sequence[str], labels: dict[str, str], shares: bool = False
) -> bytes:
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
            style = {
                "height": 0.6,
                "color": category_color(cat, categories),
                "edgecolor": "white",
                "linewidth": 0.5,
                "hatch": "//" if cat == "host_idle" else None,
            }
            ax.barh(ys, vals, left=left, label=labels.get(cat, cat), **style)
            left = [a + b for a, b in zip(left, vals)]
            if ax_share is not None:
                pct = [100 * v / t for v, t in zip(vals, totals)]
                ax_share.barh(ys, pct, left=left_share, **style)
                left_share = [a + b for a, b in zip(left_share, pct)]
        top = max(left) or 1
        for y, w in zip(ys, windows):
            ax.text(left[y] + top * 0.01, y, ms_text(w.get("step_ms")), va="center", fontsize=9)
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
        t = [s.get("t_s") if known(s.get("t_s")) else i * (timeline.get("interval_s") or 1) for i, s in enumerate(samples)]

        def series(key: str) -> list[float]:
            return [s.get(key) if known(s.get(key)) else math.nan for s in samples]

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
        dt = timeline.get("interval_s") if known(timeline.get("interval_s")) else (t[1] - t[0] if len(t) > 1 else 1)
        flagged = [
            (ti, s.get("reasons") or []) for ti, s in zip(t, samples) if [r for r in s.get("reasons") or [] if r != "gpu_idle"]
        ]
        for ti, _ in flagged:
            for ax in axes:
                ax.axvspan(ti - dt / 2, ti + dt / 2, color="#f0e442", alpha=0.35, linewidth=0)
        marks = [m for m in timeline.get("marks") or [] if isinstance(m, dict) and known(m.get("t_s"))]
        for m in marks:  # where each configuration's window began
            for ax in axes:
                ax.axvline(m["t_s"], color="#57606a", linewidth=0.8, linestyle=":")
            axes[0].text(
                m["t_s"],
                4,
                str(m.get("label")),
                rotation=90,
                va="bottom",
                ha="left",
                fontsize=8,
                color="#24292f",
                clip_on=True,
                bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1.0},
            )
        if flagged:
            reasons = sorted({r for _, rs in flagged for r in rs if r != "gpu_idle"})
            axes[0].set_title(
                "shaded: clock-event reason (" + ", ".join(reasons) + ") — a confounder", loc="left", fontsize=9, color="#6e5a00"
            )

    return _png(mpl, draw, (10, 5.2))
