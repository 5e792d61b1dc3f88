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
from speedkit.report.plots import (
    NO_MATPLOTLIB,
    category_color,
    known,
    load_matplotlib,
    ms_text,
    plot_breakdown,
    plot_memory,
    plot_throughput_mfu,
    plot_timeline,
    plot_waterfall,
)

__all__ = ["NO_MATPLOTLIB", "SECTIONS", "configurations", "render_html"]

NOT_MEASURED = "not measured in this run"


#: statuses listed under "not applied and why"
_NOT_APPLIED = ("not_applicable", "reverted", "failed", "interrupted")


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
PROFILED_CAVEAT = (
    "the windows are timed with the profiler on, whose cost per op inflates their step times (on a CPU "
    "most): their categories say where the time goes; the speedups are the paired measurements'"
)


def configurations(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The configurations the ladder went through: the baseline, each kept rung (the configuration
    with it, from its comparison, in the order tried) and the final one (the final check's).

    Each: ``label``, ``kind`` (``"baseline"``, ``"kept"``, ``"final"``) and ``measurement`` (a dict,
    empty when not measured). The baseline and the final configuration are the final check's
    measurements when there is one, so their figures match the headline."""
    s = d.get("summary") or {}
    base = dict(_baseline_measurement(d))
    if known(s.get("baseline_step_ms")):
        base["step_ms"] = s["baseline_step_ms"]
    out = [{"label": "baseline", "kind": "baseline", "measurement": base}]
    for rung in d.get("rungs") or []:
        if rung.get("status") == "kept":
            out.append({"label": str(rung.get("name")), "kind": "kept", "measurement": rung.get("measurement") or {}})
    if len(out) > 1 or (d.get("final_check") or {}).get("b"):
        final = dict(_final_measurement(d))
        if known(s.get("final_step_ms")):
            final["step_ms"] = s["final_step_ms"]
        out.append({"label": "final", "kind": "final", "measurement": final})
    return out


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


class _Plots:
    """Makes the page's figures; never fails the page: a missing matplotlib or a plot that raised
    becomes a one-line note in its place."""

    def __init__(self) -> None:
        self.mpl = load_matplotlib()

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
    conf = fc.get("confidence") if known(fc.get("confidence")) else (d.get("measure") or {}).get("confidence")
    ci_text = (
        f"{_num(conf * 100 if known(conf) else None, '.0f', '%')} interval {ci[0]:.2f}–{ci[1]:.2f}×"
        if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(known(c) for c in ci)
        else "no interval"
    )
    base, final = _baseline_measurement(d), _final_measurement(d)
    speed = s.get("speedup")
    cards = [
        ("speedup vs baseline", format_gain(speed), f"{ci_text}; {_e(s.get('figures_from'))}"),
        ("step time", f"{ms_text(s.get('final_step_ms'))}", f"from {ms_text(s.get('baseline_step_ms'))}"),
        (
            "throughput" + (f" ({unit})" if unit else ""),
            format_throughput(s.get("final_throughput")),
            f"from {format_throughput(s.get('baseline_throughput'), unit)}",
        ),
        ("MFU", format_percent(final.get("mfu")), f"from {format_percent(base.get('mfu'))}"),
        ("peak memory", format_bytes(final.get("peak_memory_bytes")), f"from {format_bytes(base.get('peak_memory_bytes'))}"),
    ]
    out = ['<div class="cards">']
    for label, value, sub in cards:
        out.append(
            f'<div class="card"><div class="label">{_e(label)}</div><div class="value">{_e(value)}</div>'
            f'<div class="sub">{sub}</div></div>'
        )
    out.append("</div>")
    kept = s.get("kept") or []
    out.append(
        f"<p><b>Kept rungs</b> ({len(kept)}, in the order tried): "
        + (", ".join(f"<code>{_e(k)}</code>" for k in kept) or "none")
        + "</p>"
    )
    if s.get("interrupted") or d.get("interrupted"):
        out.append(
            f'<p class="warn"><b>Interrupted:</b> {_e(s.get("interrupted") or d.get("interrupted"))}; '
            "the rungs are those finished before it.</p>"
        )
    if s.get("note"):
        out.append(f'<p class="warn"><b>Note:</b> {_e(s["note"])}</p>')
    holds = holds_line(d)
    if holds:
        klass = "warn" if (d.get("holds") or {}).get("flagged") else "note"
        out.append(f'<p class="{klass}"><b>In training:</b> {_e(holds)}</p>')
    vs = s.get("vs_switches")
    if isinstance(vs, (list, tuple)) and len(vs) == 3 and all(known(v) for v in vs):
        out.append(
            f'<p class="note">Against the switches a user would flip by hand: {vs[0]:.2f}× '
            f"(interval {vs[1]:.2f}–{vs[2]:.2f}×).</p>"
        )
    return "\n".join(out)


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
    final, kept = rows[-1][1], [ms for label, ms in rows[1:-1]]
    spread = _final_measurement(d).get("spread")
    odd = ""
    if rows[-1][0] == "final" and kept and final > min(kept) * 1.03:
        odd = _note(
            f"<b>The final bar is slower than a kept rung's:</b> the rungs' bars come from their own paired "
            f"comparisons, the final one from the final check, in which the step time varied by "
            f"{format_percent(spread)} (window to window). The speedup uses paired blocks, not these bars."
        )
    return (
        plots("step time per configuration", plot_waterfall, rows)
        + odd
        + _note(
            "Each kept rung's bar is the step time with it (and the rungs kept before it), from its own "
            "paired comparison; the light segment is what it removed (green) or added (red, hatched). "
            "× is the baseline's step time over this one. Baseline and final are the final check's "
            "interleaved measurements."
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


def _attribution(d: dict[str, Any]) -> str:
    a = d.get("attribution")
    rows_in = [r for r in (a or {}).get("rungs") or [] if isinstance(r, dict)]
    if not rows_in:
        return _note(f"Attribution: {NOT_MEASURED}.")
    labels = _profile_parts(d)[3]
    rows = []
    for r in rows_in:
        moved = (
            "<br>".join(
                f"{_e(labels.get(m.get('category'), m.get('category')))} {_num(m.get('before_ms'), ',.1f')} → "
                f"{_num(m.get('after_ms'), ',.1f')} ms"
                for m in r.get("moved") or []
                if isinstance(m, dict)
            )
            or MISSING
        )
        group = [g for g in r.get("group") or [] if g != r.get("name")]
        together = f'<br><span class="note">kept with {_e(", ".join(map(str, group)))}</span>' if group else ""
        rows.append(
            [
                f"<code>{_e(r.get('name'))}</code>{together}",
                format_gain(r.get("speedup")),
                _signed_ms(r.get("ms_per_step")),
                format_percent(r.get("share")),
                moved,
                _signed_bytes(r.get("peak_memory_delta_bytes")),
            ]
        )
    out = [
        _table(
            ["rung", "speedup", "ms per step", "share of the gain", "categories moved", "peak memory"], rows, numeric=(1, 2, 3, 5)
        )
    ]
    product, measured = a.get("product"), a.get("measured")
    agrees = a.get("agrees")
    verdict = "agree" if agrees else ("do not agree" if agrees is False else "—")
    out.append(
        f'<p class="{"note" if agrees else "warn"}"><b>Check:</b> the kept rungs\' speedups multiply to '
        f"{format_gain(product)}; the final check measured {format_gain(measured)}: they {verdict}.</p>"
    )
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
        out.append(
            f"<h3>{_e(title)}</h3>"
            + _table(
                ["where", "code", "why it syncs", "found in one step"],
                [
                    [
                        f'<code class="path">{_e(s.get("where"))}</code>',
                        f"<code>{_e(s.get('code'))}</code>",
                        _e(s.get("reason")),
                        _e(s.get("count")),
                    ]
                    for s in items
                ],
                numeric=(3,),
            )
        )
    out.append(
        _note(
            "A host sync makes the CPU wait for the GPU to finish (<code>.item()</code>, printing a tensor, "
            "a branch on a CUDA value), so the GPU then waits for the next step's work."
        )
    )
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
        if (
            isinstance(trace, str)
            and trace
            and "://" not in trace
            and not trace.startswith(("/", "\\"))
            and ".." not in Path(trace).parts
        ):
            found = out_dir is None or (Path(out_dir) / trace).exists()
            cell = f'<a href="{_e(trace)}">{_e(trace)}</a>' + (
                "" if found else ' <span class="note">(not found next to this report)</span>'
            )
        elif isinstance(trace, str) and trace:
            cell = f"<code>{_e(trace)}</code>"
        else:
            cell = MISSING
        rows.append([_e(w.get("label")), cell, _e(w.get("trace_note")) if w.get("trace_note") else ""])
    for note, labels in without.items():
        rows.append([_e(", ".join(labels)), MISSING, _e(note)])
    return _table(["window", "trace (relative to this file)", "note"], rows) + _note(
        "Open a trace in https://ui.perfetto.dev or chrome://tracing (drag the file in; "
        "this page itself loads nothing from the network)."
    )


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


def _in_training(d: dict[str, Any]) -> str:
    fm = d.get("fit_monitor")
    out = []
    if isinstance(fm, dict) and fm:
        unit = fm.get("throughput_unit")
        rows = [
            ["steps monitored", _e(fm.get("steps"))],
            ["step time (median)", ms_text(fm.get("step_ms_median"))],
            ["throughput", _e(format_throughput(fm.get("throughput"), unit))],
            ["MFU", format_percent(fm.get("mfu"))],
            ["waiting for data", ms_text(fm.get("data_wait_ms"))],
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
        (
            "GPU",
            f"{env['gpu_name']} (compute capability {cc or MISSING}, {format_bytes(env.get('gpu_memory_bytes'))}), "
            f"{env.get('gpu_count') or MISSING} visible"
            if env.get("gpu_name")
            else None,
        ),
        ("GPU driver", env.get("gpu_driver")),
        (
            "CPU",
            f"{env.get('cpu_model') or MISSING}: {env.get('cpu_usable') or MISSING} of {env.get('cpu_count') or MISSING} "
            f"usable, {env.get('torch_threads') or MISSING} torch threads",
        ),
        ("python", env.get("python")),
        (
            "torch",
            f"{env.get('torch')}" + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else "")
            if env.get("torch")
            else None,
        ),
        ("triton", env.get("triton")),
        ("lightning", env.get("lightning")),
        ("cuDNN", _cudnn(env.get("cudnn"))),
        ("speedkit", env.get("speedkit")),
        ("platform", env.get("platform")),
        (
            "precision / accumulation",
            f"{run.get('precision') or MISSING}, {run.get('accumulate_grad_batches') or MISSING} batch(es) per optimizer step"
            if run
            else None,
        ),
        ("optimizer / strategy", f"{run.get('optimizer') or MISSING} / {run.get('strategy') or MISSING}" if run else None),
        ("FLOPs per step", f"{flops['per_step'] / 1e12:,.2f} TFLOP" if known(flops.get("per_step")) else None),
        (
            "MFU peak",
            f"{flops['peak_tflops']:g} TFLOP/s — {flops.get('peak_source') or MISSING}"
            if known(flops.get("peak_tflops"))
            else flops.get("peak_source"),
        ),
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
    return _table(
        ["rung", "status", "why"],
        [
            [f"<code>{_e(r.get('name'))}</code>", _e(STATUS_LABELS.get(r.get("status"), r.get("status"))), _e(r.get("reason"))]
            for r in rows
        ],
        row_classes=[f"st-{_e(r.get('status'))}" for r in rows],
    )


def _rungs(d: dict[str, Any]) -> str:
    rungs = d.get("rungs") or []
    if not rungs:
        return _note("No rungs.")
    cells = [[_e(c) for c in rung_cells(r)] for r in rungs]
    for row in cells:  # the parity cell breaks before its tolerance, not inside "3e-02"
        row[-1] = row[-1].replace(" (tol ", "<br>(tol ")
    table = _table(
        [_e(c) for c in TABLE_COLUMNS],
        cells,
        numeric=range(2, len(TABLE_COLUMNS) - 1),
        row_classes=[f"st-{_e(r.get('status'))}" for r in rungs],
        cls="rungs",
    )
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
            items.append(
                f"<li>Paired timing: {_e(c.get('blocks'))} A B B A blocks, speedup {_num(c.get('speedup'), '.3f', '×')} "
                f"[{_num(c.get('low'), '.3f')}–{_num(c.get('high'), '.3f')}]: {_e(str(c.get('verdict')).replace('_', ' '))}</li>"
            )
        if known(r.get("seconds")):
            items.append(f"<li>Time spent: {r['seconds']:.1f} s</li>")
        details.append(f"<details><summary>{i}. {_e(r.get('name'))} — {_e(status)}</summary><ul>{''.join(items)}</ul></details>")
    return table + _note("Step time: median ± noise; “vs previous”: paired speedup with its interval.") + "".join(details)


# -- the page -------------------------------------------------------------------------------------


def _css() -> str:
    """The page's style sheet (``report.css`` beside this module), inlined: the page fetches nothing."""
    return (Path(__file__).resolve().parent / "report.css").read_text()


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
        f"<style>{_css()}</style></head><body><main>",
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
