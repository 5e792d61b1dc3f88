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

The page's building blocks and its plotted sections are :mod:`speedkit.report.html_sections`'.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from speedkit.report.html_sections import (
    NOT_MEASURED,
    _baseline_measurement,
    _breakdown,
    _e,
    _final_measurement,
    _memory,
    _note,
    _num,
    _Plots,
    _profile_parts,
    _section,
    _signed_bytes,
    _signed_ms,
    _table,
    _telemetry,
    _throughput,
    _waterfall,
)
from speedkit.report.markdown import (
    MISSING,
    STATUS_LABELS,
    TABLE_COLUMNS,
    attribution_check_text,
    check_text,
    diagnosis_line,
    figures_of,
    format_bytes,
    format_percent,
    format_throughput,
    headline_text,
    holds_line,
    switches_text,
    table_rows,
)
from speedkit.report.plots import (
    NO_MATPLOTLIB,
    known,
    load_matplotlib,
    ms_text,
)
from speedkit.report.ranks import COMMUNICATION_KEYS, HEADERS, communication_lines, rank_rows, scaling_line

__all__ = ["NO_MATPLOTLIB", "SECTIONS", "render_html"]

#: statuses listed under "not applied and why"
_NOT_APPLIED = ("not_applicable", "skipped", "reverted", "failed", "interrupted")


# -- the sections without a plot (the plotted ones are speedkit.report.html_sections') -----------


def _headline(d: dict[str, Any]) -> str:
    s = d.get("summary") or {}
    figures = figures_of(d)
    head = figures.get("headline") or {}
    unit = figures.get("unit")
    base, final = _baseline_measurement(d), _final_measurement(d)
    versus, check = switches_text(figures), check_text(figures)
    cards = [
        (
            "speedup vs baseline",
            headline_text(figures).removesuffix(" the baseline"),
            _e(head.get("from")) + (f"; {_e(versus)}" if versus else ""),
        ),
        ("step time", f"{ms_text(final.get('step_ms'))}", f"from {ms_text(base.get('step_ms'))}"),
        (
            "throughput" + (f" ({unit})" if unit else ""),
            format_throughput(final.get("throughput")),
            f"from {format_throughput(base.get('throughput'), unit)}",
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
    kept = [n for link in figures.get("links") or [] for n in link.get("names") or []]
    out.append(
        f"<p><b>Kept rungs</b> ({len(kept)}, in the chain's order): "
        + (", ".join(f"<code>{_e(k)}</code>" for k in kept) or "none")
        + "</p>"
    )
    if check:
        out.append(f'<p class="note"><b>Final check:</b> {_e(check)}.</p>')
    if s.get("interrupted") or d.get("interrupted"):
        out.append(
            f'<p class="warn"><b>Interrupted:</b> {_e(s.get("interrupted") or d.get("interrupted"))}; '
            "the rungs are those finished before it.</p>"
        )
    diagnosis = (d.get("run") or {}).get("diagnosis")
    if diagnosis:
        out.append(f'<p class="note"><b>Diagnosis:</b> {_e(diagnosis_line(diagnosis))}</p>')
    holds = holds_line(d)
    if holds:
        klass = "warn" if (d.get("holds") or {}).get("flagged") else "note"
        out.append(f'<p class="{klass}"><b>In training:</b> {_e(holds)}</p>')
    return "\n".join(out)


def _attribution(d: dict[str, Any]) -> str:
    a = figures_of(d).get("attribution")
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
                _e(r.get("figure") or MISSING),
                _signed_ms(r.get("ms_per_step")),
                format_percent(r.get("share")),
                moved,
                _signed_bytes(r.get("peak_memory_delta_bytes")),
            ]
        )
    out = [
        _table(
            ["rung", "its figure", "ms per step", "share of the gain", "categories moved", "peak memory"], rows, numeric=(2, 3, 5)
        )
    ]
    agrees = a.get("agrees")
    out.append(f'<p class="{"note" if agrees is not False else "warn"}"><b>Check:</b> {_e(attribution_check_text(a))}.</p>')
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
        holds = d.get("holds") or {}
        aside = (
            " (SpeedProfiler watches a whole fit; the fit check above timed the fit's own steps after the trials)"
            if holds.get("fit")
            else ""
        )
        out.append(_note(f"Fit monitor: {NOT_MEASURED}{aside}."))
    return "\n".join(out)


def _ranks(d: dict[str, Any]) -> str:
    rows = rank_rows(d)
    if rows is None:
        return _note("one process: no ranks to compare")
    line = scaling_line(d)
    cells = [
        [_e(label), _e(rank), f"{step:.2f}", f"{wait:.2f}", f"{host:.2f}", _e(format_bytes(peak)) if peak else MISSING]
        for label, rank, step, wait, host, peak in rows
    ]
    comm_html = ""
    for key in COMMUNICATION_KEYS:
        communication = communication_lines(d, key)
        if communication:
            comm_html += f"<p>{_e(communication[0])}</p><ul>" + "".join(f"<li>{_e(c)}</li>" for c in communication[1:]) + "</ul>"
    return (f"<p>{_e(line)}</p>" if line else "") + comm_html + _table([_e(h) for h in HEADERS], cells, numeric=(2, 3, 4, 5))


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
    order = {s: i for i, s in enumerate(("failed", "interrupted", "reverted", "skipped", "not_applicable"))}
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
    ordered = table_rows(d)
    cells = [[_e(c) for c in row_cells] for _, row_cells in ordered]
    for row in cells:  # the parity cell breaks before its tolerance, not inside "3e-02"
        row[-1] = row[-1].replace(" (tol ", "<br>(tol ")
    table = _table(
        [_e(c) for c in TABLE_COLUMNS],
        cells,
        numeric=range(2, len(TABLE_COLUMNS) - 1),
        row_classes=[f"st-{_e(r.get('status'))}" for r, _ in ordered],
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
    ("ranks", "Across ranks"),
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
    plots = _Plots(load_matplotlib())
    recipe = d.get("recipe")
    title = d.get("title") or f"speedkit report{f': {recipe}' if recipe else ''}"
    env = d.get("environment") or {}
    sub = " · ".join(_e(x) for x in (d.get("device"), env.get("gpu_name"), f"schema {d.get('schema_version')}") if x)
    bodies = {
        "headline": _headline(d),
        "waterfall": _waterfall(d, plots),
        "throughput": _throughput(d, plots),
        "memory": _memory(d, plots),
        "ranks": _ranks(d),
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
