"""The building blocks of ``report.html`` and its plotted sections.

Escaping and table helpers, the baseline and final measurements, :func:`configurations`, the
:class:`_Plots` maker of the page's figures, and the sections that draw a plot: step time by rung,
throughput and MFU, peak memory, the time breakdown and the GPU telemetry. The page itself and its
other sections are :mod:`speedkit.report.html`'s.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from typing import Any

from speedkit.report.markdown import (
    MISSING,
    figures_of,
    format_bytes,
    format_percent,
    format_throughput,
)
from speedkit.report.plots import (
    NO_MATPLOTLIB,
    category_color,
    known,
    ms_text,
    plot_breakdown,
    plot_memory,
    plot_throughput_mfu,
    plot_timeline,
    plot_waterfall,
)

__all__ = ["NOT_MEASURED", "configurations"]

NOT_MEASURED = "not measured in this run"


# -- small helpers ----------------------------------------------------------------------------


def _e(value: Any) -> str:
    """Escaped text of anything from the report; "—" for a missing value."""
    if value is None or value == "":
        return MISSING
    return html.escape(str(value), quote=True)


def _signed_ms(value: Any) -> str:
    if not known(value):
        return MISSING
    return f"{value:+,.1f} ms".replace("-", "−")


def _signed_bytes(value: Any) -> str:
    if not known(value):
        return MISSING
    if abs(value) < 5e6:
        return "0.00 GB"
    return f"{value / 1e9:+.2f} GB".replace("-", "−")


def _num(value: Any, spec: str, unit: str = "") -> str:
    return f"{format(value, spec)}{unit}" if known(value) else MISSING


def _table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    numeric: Sequence[int] = (),
    row_classes: Sequence[str] | None = None,
    cls: str = "",
) -> str:
    """A table of already-escaped cells; columns in ``numeric`` right-aligned."""
    num = set(numeric)
    head = "".join(f"<th{' class=num' if i in num else ''}>{h}</th>" for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        klass = f' class="{row_classes[r]}"' if row_classes and row_classes[r] else ""
        body.append(
            f"<tr{klass}>" + "".join(f"<td{' class=num' if i in num else ''}>{c}</td>" for i, c in enumerate(row)) + "</tr>"
        )
    return (
        f'<div class="scroll"><table{f" class={cls}" if cls else ""}><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _note(text: str) -> str:
    return f'<p class="note">{text}</p>'


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{html.escape(title)}</h2>\n{body}\n</section>'


def _final_measurement(d: dict[str, Any]) -> dict[str, Any]:
    """The final configuration's figures: the account's step time, throughput and MFU, with its measured
    peak memory and spread (the final check's windows, else its last kept rung's)."""
    figures = figures_of(d)
    measured: dict[str, Any] = dict((d.get("final_check") or {}).get("b") or {})
    if not measured:
        kept = {r.get("name"): r for r in d.get("rungs") or [] if r.get("status") == "kept"}
        last = next((kept[n] for n in reversed(d.get("final_order") or list(kept)) if n in kept), None)
        measured = dict((last or {}).get("measurement") or {})
    if not figures.get("links"):
        return _baseline_measurement(d)
    head = figures.get("headline") or {}
    return {**measured, **{k: head.get(k) for k in ("step_ms", "throughput", "mfu")}}


def _baseline_measurement(d: dict[str, Any]) -> dict[str, Any]:
    """The baseline's figures: the account's (its own measurement, timed alone), the one baseline."""
    figures = figures_of(d)
    row = next((r for r in d.get("rungs") or [] if r.get("status") == "baseline"), {})
    return {**(row.get("measurement") or {}), **{k: v for k, v in (figures.get("baseline") or {}).items() if k != "source"}}


#: what a profile window's times are
PROFILED_CAVEAT = (
    "the windows are timed with the profiler on, whose cost per op inflates their step times (on a CPU "
    "most): their categories say where the time goes; the speedups are the paired measurements'"
)


def configurations(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The configurations of the chain: the baseline, each kept link (a rung, or a group decided together,
    with the rungs before it) and the final one, each with the account's figures.

    Each: ``label``, ``kind`` (``"baseline"``, ``"kept"``, ``"final"``) and ``measurement`` (a dict:
    ``step_ms``, ``throughput``, ``mfu``; peak memory from its measured windows)."""
    figures = figures_of(d)
    rows = {r.get("name"): r for r in d.get("rungs") or [] if isinstance(r, dict)}
    out = [{"label": "baseline", "kind": "baseline", "measurement": _baseline_measurement(d)}]
    for link in figures.get("links") or []:
        names = link.get("names") or []
        memory = ((rows.get(names[-1]) or {}).get("measurement") or {}).get("peak_memory_bytes") if names else None
        out.append(
            {
                "label": link.get("label") or " + ".join(names),
                "kind": "kept",
                "measurement": {
                    "step_ms": link.get("step_ms"),
                    "throughput": link.get("throughput"),
                    "mfu": link.get("mfu"),
                    "peak_memory_bytes": memory,
                },
            }
        )
    if len(out) > 1:
        out.append({"label": "final", "kind": "final", "measurement": _final_measurement(d)})
    return out


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


class _Plots:
    """Makes the page's figures; never fails the page: a missing matplotlib or a plot that raised
    becomes a one-line note in its place."""

    def __init__(self, mpl: Any) -> None:
        self.mpl = mpl  # what load_matplotlib() returned: None without matplotlib

    def __call__(self, alt: str, fn: Callable[..., bytes], *args: Any) -> str:
        if self.mpl is None:
            return _note(html.escape(NO_MATPLOTLIB))
        try:
            return _img(fn(self.mpl, *args), alt)
        except Exception as exc:  # a plot is never worth failing the report for
            return _note(f"(the plot could not be drawn: {_e(type(exc).__name__)}: {_e(exc)})")


# -- the plotted sections --------------------------------------------------------------------------


def _waterfall(d: dict[str, Any], plots: _Plots) -> str:
    rows = [(c["label"], c["measurement"].get("step_ms")) for c in configurations(d)]
    rows = [(label, ms) for label, ms in rows if known(ms) and ms > 0]
    if len(rows) < 2:
        return _note(f"Step time per configuration: {NOT_MEASURED} (no rung was kept).")
    base = rows[0][1]
    table = _table(
        ["configuration", "step time", "change vs previous", "× baseline"],
        [
            [_e(label), ms_text(ms), MISSING if i == 0 else _signed_ms(ms - rows[i - 1][1]), f"{base / ms:.2f}×"]
            for i, (label, ms) in enumerate(rows)
        ],
        numeric=(1, 2, 3),
    )
    return (
        plots("step time per configuration", plot_waterfall, rows)
        + _note(
            "Each kept bar is the step time with it and the links before it: the baseline's step time divided "
            "by the kept rungs' decided gains in the chain's order (a group decided together is one bar), the "
            "figures of the table and the attribution; the final bar is the chain's end, the headline. The light "
            "segment is what it removed (green) or added (red, hatched). × is the baseline's step time over this one."
        )
        + "<details><summary>as a table</summary>"
        + table
        + "</details>"
    )


def _throughput(d: dict[str, Any], plots: _Plots) -> str:
    confs = configurations(d)
    unit = (d.get("summary") or {}).get("throughput_unit") or next(
        (c["measurement"].get("throughput_unit") for c in confs if c["measurement"].get("throughput_unit")), "items/s"
    )
    rows = [(c["label"], c["measurement"].get("throughput"), c["measurement"].get("mfu")) for c in confs]
    if not any(known(r[1]) for r in rows):
        return _note(f"Throughput: {NOT_MEASURED}.")
    flops = d.get("flops") or {}
    peak = flops.get("peak_tflops")
    table = _table(
        ["configuration", "throughput", "MFU", "achieved"],
        [
            [
                _e(c["label"]),
                _e(format_throughput(c["measurement"].get("throughput"), unit)),
                format_percent(c["measurement"].get("mfu")),
                _num(c["measurement"].get("tflops"), ".1f", " TFLOP/s"),
            ]
            for c in confs
        ],
        numeric=(1, 2, 3),
    )
    peak_text = (
        f"MFU against a peak of {peak:g} TFLOP/s ({_e(flops.get('peak_source'))})"
        if known(peak)
        else "no MFU: no peak is known for this device"
    )
    return (
        plots("throughput and MFU per configuration", plot_throughput_mfu, rows, unit)
        + _note(peak_text + ".")
        + "<details><summary>as a table (with achieved TFLOP/s)</summary>"
        + table
        + "</details>"
    )


def _memory(d: dict[str, Any], plots: _Plots) -> str:
    confs = configurations(d)
    rows = [(c["label"], c["measurement"].get("peak_memory_bytes")) for c in confs]
    if not any(known(r[1]) for r in rows):
        return _note(f"Peak memory: {NOT_MEASURED} (measured on CUDA only).")
    base = rows[0][1]
    table = _table(
        ["configuration", "peak memory", "vs baseline"],
        [
            [_e(label), format_bytes(b), _signed_bytes(b - base) if known(b) and known(base) and i else MISSING]
            for i, (label, b) in enumerate(rows)
        ],
        numeric=(1, 2),
    )
    return (
        plots("peak memory per configuration", plot_memory, rows)
        + "<details><summary>as a table</summary>"
        + table
        + "</details>"
    )


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
        if not (known(b) and b) and not (known(a) and a):
            continue
        swatch = f'<span class="swatch" style="background:{category_color(c, cats)}"></span>'

        def share(v: Any, w: dict[str, Any]) -> str:
            return format_percent(v / w["step_ms"]) if known(v) and known(w.get("step_ms")) and w["step_ms"] else MISSING

        rows.append(
            [
                swatch + _e(labels[c]),
                ms_text(b),
                ms_text(a),
                _signed_ms(a - b) if known(a) and known(b) else MISSING,
                share(b, before),
                share(a, after),
            ]
        )
    rows.append(
        [
            "<b>step</b>",
            f"<b>{ms_text(before.get('step_ms'))}</b>",
            f"<b>{ms_text(after.get('step_ms'))}</b>",
            _signed_ms(after["step_ms"] - before["step_ms"])
            if known(after.get("step_ms")) and known(before.get("step_ms"))
            else MISSING,
            "",
            "",
        ]
    )
    rows.append(
        [
            "device busy",
            format_percent(before.get("device_busy_fraction")),
            format_percent(after.get("device_busy_fraction")),
            "",
            "",
            "",
        ]
    )
    out.append(
        _table(
            [
                "category",
                f"before ({_e(before.get('label'))})",
                f"after ({_e(after.get('label'))})",
                "Δ",
                "share before",
                "share after",
            ],
            rows,
            numeric=(1, 2, 3, 4, 5),
        )
    )
    steps = p.get("steps") or before.get("steps")
    out.append(
        _note(
            f"ms per optimizer step, averaged over {_e(steps)} profiled steps per window; "
            "“host-bound idle GPU” is time the GPU waited for the host to issue work; " + PROFILED_CAVEAT + "."
        )
    )
    if len(windows) > 2:
        out.append(
            "<details><summary>every profiled window (one per kept rung)</summary>"
            + plots("time breakdown of every profiled window", plot_breakdown, windows, cats, labels)
            + "</details>"
        )
    for w in shown:
        ops = [o for o in w.get("top_ops") or [] if isinstance(o, dict)]
        if ops:
            out.append(
                f"<h3>Top kernels: {_e(w.get('label'))}</h3>"
                + _table(
                    ["kernel / op", "category", "ms per step"],
                    [
                        [
                            f'<code class="op" title="{_e(o.get("name"))}">{_e(_shorten(str(o.get("name") or ""), 90))}</code>',
                            _e(labels.get(o.get("category"), o.get("category"))),
                            ms_text(o.get("ms")),
                        ]
                        for o in ops
                    ],
                    numeric=(2,),
                )
            )
    return "\n".join(out)


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _telemetry(d: dict[str, Any], plots: _Plots) -> str:
    out = []
    tl = d.get("telemetry_timeline")
    if isinstance(tl, dict) and tl.get("samples"):
        samples = [s for s in tl["samples"] if isinstance(s, dict)]
        marks = [str(m.get("label")) for m in tl.get("marks") or [] if isinstance(m, dict)]
        what = (
            f"while timing <b>{_e(tl['label'])}</b>"
            if tl.get("label")
            else f"across the profiled windows ({_e(', '.join(marks))}; dotted lines mark where each began)"
            if marks
            else "while timing"
        )
        out.append(f"<p>Sampled every {_num(tl.get('interval_s'), '.2f', ' s')} {what}: {len(samples)} samples.</p>")
        out.append(plots("NVML timeline", plot_timeline, tl))
        counts: dict[str, int] = {}
        during: dict[str, list[str]] = {}
        starts = sorted(
            ((m["t_s"], str(m.get("label"))) for m in tl.get("marks") or [] if isinstance(m, dict) and known(m.get("t_s"))),
            key=lambda m: m[0],
        )
        for s in samples:
            for r in s.get("reasons") or []:
                counts[r] = counts.get(r, 0) + 1
                t = s.get("t_s")
                window = next((label for start, label in reversed(starts) if known(t) and start <= t), None)
                if window and window not in during.setdefault(r, []):
                    during[r].append(window)
        confounders = {r: n for r, n in counts.items() if r != "gpu_idle"}
        if confounders:
            out.append(
                '<p class="warn"><b>Confounders:</b> clock-event reasons in '
                + ", ".join(
                    f"<code>{_e(r)}</code> ({n} of {len(samples)} samples"
                    + (f", during {_e(', '.join(during[r]))}" if during.get(r) else "")
                    + ")"
                    for r, n in sorted(confounders.items())
                )
                + ": the clocks moved while timing, so step times from those samples carry that change.</p>"
            )
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
        rows.append(
            [
                _e(rung.get("name")),
                _num(t.get("util_mean"), ".0f", "%"),
                f"{_num(t.get('power_mean_w'), '.0f')} / {_num(t.get('power_max_w'), '.0f', ' W')}",
                f"{_num(t.get('sm_clock_mean_mhz'), '.0f')} / {_num(t.get('sm_clock_min_mhz'), '.0f', ' MHz')}",
                format_bytes(t.get("mem_used_max_bytes")),
                (_e(", ".join(slow)) + f" ({format_percent(t.get('slowdown_fraction'))})") if slow else "none",
            ]
        )
        flags.append("flag" if slow else "")
    if rows:
        out.append(
            "<details><summary>NVML summary per measured configuration</summary>"
            + _table(
                [
                    "configuration",
                    "util (mean)",
                    "power mean / max",
                    "SM clock mean / min",
                    "memory used (max)",
                    "slowdown reasons",
                ],
                rows,
                numeric=(1, 2, 3, 4),
                row_classes=flags,
            )
            + "</details>"
        )
    return "\n".join(out)
