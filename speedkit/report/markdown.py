"""``report.md``: the ladder as one table plus a details section per rung.

Renders the dict of :meth:`speedkit.results.LadderResult.to_dict` (or a loaded ``report.json``),
never the dataclasses, so an old report renders the same way as a fresh one. Every figure comes from
the report's ``figures`` (:func:`speedkit.figures.account.account`, derived once from the ledger): the
table's rows (:func:`table_rows`: the baseline, the kept rungs in the chain's order, then the others in
the order tried), the summary line, the attribution. The cell formatting (:data:`TABLE_COLUMNS`,
:func:`table_rows`) is shared with the console table and the HTML page. Missing values render as "—".
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from speedkit.figures.account import account
from speedkit.report.ranks import COMMUNICATION_KEYS, HEADERS, communication_lines, rank_rows, scaling_line

MISSING = "—"

#: how each status is shown
STATUS_LABELS = {
    "baseline": "baseline",
    "kept": "kept",
    "reverted": "reverted",
    "not_applicable": "n/a",
    "skipped": "not tried (budget)",
    "failed": "failed",
    "closing": "final (re-measured)",
    "interrupted": "interrupted",
    "switches": "switches (final vs them)",
}

TABLE_COLUMNS = (
    "rung",
    "status",
    "step time (ms)",
    "throughput",
    "MFU",
    "peak memory",
    "vs previous",
    "vs baseline",
    "parity (max rel diff)",
)


# -- cell formatting (shared with console.py) ---------------------------------------------------


def _known(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and not math.isfinite(value))


def format_step(ms: Any, spread: Any = None) -> str:
    """``12.34 ± 1.2%``: the median step time and its relative noise (``spread``)."""
    if not _known(ms):
        return MISSING
    text = f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"
    return f"{text} ± {spread * 100:.1f}%" if _known(spread) else text


def format_throughput(value: Any, unit: str | None = None) -> str:
    """``123.4k tokens/s``."""
    if not _known(value):
        return MISSING
    for scale, suffix, digits in ((1e9, "G", 2), (1e6, "M", 2), (1e3, "k", 1)):
        if abs(value) >= scale:
            text = f"{value / scale:.{digits}f}{suffix}"
            break
    else:
        text = f"{value:.1f}"
    return f"{text} {unit}" if unit else text


def format_percent(fraction: Any) -> str:
    return f"{fraction * 100:.1f}%" if _known(fraction) else MISSING


def format_bytes(n: Any) -> str:
    """Decimal gigabytes, as ``nvidia-smi``-style tables and ANCHORS.md quote them."""
    return f"{n / 1e9:.2f} GB" if _known(n) else MISSING


def format_gain(gain: Any) -> str:
    return f"{gain:.2f}×" if _known(gain) else MISSING


def figures_of(d: dict[str, Any]) -> dict[str, Any]:
    """The report's figures: its ``figures``, or derived now for a report written before they were
    (:func:`speedkit.figures.account.account` reads its rows' comparisons)."""
    figures = d.get("figures")
    return figures if isinstance(figures, dict) and "headline" in figures else account(d)


def format_parity(parity: dict[str, Any] | None) -> str:
    """``✓ 1.2e-03 (tol 1e-02)``; ✗ when the trajectory left the tolerance."""
    if not parity:
        return MISSING
    mark = "✓" if parity.get("passed") else "✗"
    diff = parity.get("max_rel_diff")
    diff_text = f"{diff:.1e}" if _known(diff) else MISSING
    tol = parity.get("tolerance")
    tol_text = f" (tol {tol:.0e})" if _known(tol) else ""
    return f"{mark} {diff_text}{tol_text}"


#: the rows of a rung of the ladder (not a closing phase's, the switches' or the baseline's)
RUNG_STATUSES = ("kept", "reverted", "not_applicable", "skipped", "failed", "interrupted")


def table_rows(d: dict[str, Any]) -> list[tuple[dict[str, Any], list[str]]]:
    """The ladder table: each row with its cells, in the order of :data:`TABLE_COLUMNS`: the baseline; the
    kept rungs in the chain's order (the user's switches first), each with its one figure, the step time,
    throughput and MFU of the configuration after its link, and the chain's product so far; then the
    rungs not kept, in the order tried, each with its last comparison's figure and no step time (its
    configuration was not kept)."""
    figures = figures_of(d)
    rows = [r for r in d.get("rungs") or [] if isinstance(r, dict)]
    unit = figures.get("unit")
    out: list[tuple[dict[str, Any], list[str]]] = []
    base_row = next((r for r in rows if r.get("status") == "baseline"), None)
    if base_row is not None:
        b = figures["baseline"]
        m = base_row.get("measurement") or {}
        out.append(
            (
                base_row,
                [
                    "baseline",
                    STATUS_LABELS["baseline"],
                    format_step(b.get("step_ms"), b.get("spread")),
                    format_throughput(b.get("throughput"), unit),
                    format_percent(b.get("mfu")),
                    format_bytes(m.get("peak_memory_bytes")),
                    MISSING,
                    format_gain(1.0) if _known(b.get("step_ms")) else MISSING,
                    format_parity(base_row.get("parity")),
                ],
            )
        )
    by_name = {r.get("name"): r for r in rows if r.get("status") in RUNG_STATUSES}
    links = figures.get("links") or []
    for link in links:
        if link.get("together"):  # no rung's: what the kept rungs do together, as the final check measured it
            out.append(
                (
                    {"name": link.get("label"), "status": "closing"},
                    [
                        str(link.get("label")),
                        STATUS_LABELS["closing"],
                        format_step(link.get("step_ms")),
                        format_throughput(link.get("throughput"), unit),
                        format_percent(link.get("mfu")),
                        MISSING,
                        str(link.get("text", MISSING)),
                        format_gain(link.get("vs_baseline")),
                        MISSING,
                    ],
                )
            )
        for name in link.get("names") or []:
            row = by_name.get(name) or {"name": name, "status": "kept"}
            m = row.get("measurement") or {}
            out.append(
                (
                    row,
                    [
                        str(name),
                        STATUS_LABELS["kept"],
                        format_step(link.get("step_ms")),
                        format_throughput(link.get("throughput"), unit),
                        format_percent(link.get("mfu")),
                        format_bytes(m.get("peak_memory_bytes")),
                        (figures.get("rungs") or {}).get(name, {}).get("text", MISSING),
                        format_gain(link.get("vs_baseline")),
                        format_parity(row.get("parity")),
                    ],
                )
            )
    chained = {n for link in links for n in link.get("names") or []}
    for row in rows:
        if row.get("status") not in RUNG_STATUSES or row.get("name") in chained:
            continue
        figure = (figures.get("rungs") or {}).get(row.get("name")) or {}
        out.append(
            (
                row,
                [
                    str(row.get("name", MISSING)),
                    STATUS_LABELS.get(row.get("status"), str(row.get("status", MISSING))),
                    MISSING,
                    MISSING,
                    MISSING,
                    MISSING,
                    figure.get("text", MISSING) if row.get("status") != "kept" else MISSING,
                    MISSING,
                    format_parity(row.get("parity")),
                ],
            )
        )
    return out


def headline_text(figures: dict[str, Any]) -> str:
    """``1.86× [1.62–2.14] the baseline``, ``not shown: 1.04× [0.97–1.11] the baseline`` where the
    interval holds 1.0, or what was kept where nothing was."""
    head = figures.get("headline") or {}
    if not figures.get("links"):
        return "nothing kept: the baseline"
    if head.get("speedup") is None:
        return "not measured (a kept rung has no figure)"
    return f"{'' if head.get('shown') else 'not shown: '}{head.get('text')} the baseline"


def switches_text(figures: dict[str, Any]) -> str | None:
    """``1.21× [1.10–1.33] the switches`` (the links on top of the user's switches), ``the user's
    switches alone`` where nothing went on top of them, None where they were not the floor."""
    if figures.get("switches_are_final"):
        return "the user's switches alone"
    v = figures.get("vs_switches")
    if not v or v.get("speedup") is None:
        return None
    crosses = v.get("low") is not None and v.get("high") is not None and v["low"] <= 1.0 <= v["high"]
    return f"{'not shown: ' if crosses or v.get('low') is None else ''}{v.get('text')} the switches"


def check_text(figures: dict[str, Any]) -> str | None:
    """The final check, a check of the chain: ``checked against the baseline in one interleaved
    comparison: 1.84× [1.80–1.88], faster``; None where none was made."""
    c = figures.get("check")
    if not c or c.get("is_the_chain"):  # the headline's own comparison: no second line for it
        return None
    where = f" (in {c['measured_in']})" if c.get("measured_in") else ""
    verdict = str(c.get("verdict") or MISSING).replace("_", " ")
    return f"checked against the baseline in one interleaved comparison{where}: {c.get('text')}, {verdict}"


def attribution_check_text(a: dict[str, Any]) -> str:
    """The attribution's check: what the kept rungs' figures multiply to against the final check's figure,
    the headline where there was one."""
    product, measured, agrees = format_gain(a.get("product")), a.get("measured"), a.get("agrees")
    if measured is None:
        return f"the kept rungs' figures multiply to {product}, the headline; no final check to compare"
    verdict = "they agree" if agrees else "they do not agree"
    return f"the kept rungs' figures multiply to {product}; the final check measured {format_gain(measured)}, the headline: {verdict}"


def summary_line(d: dict[str, Any]) -> str:
    """``44.8k → 580.0k tokens/s (12.95× [12.8–13.1] the baseline, 1.21× [1.1–1.3] the switches; step
    98.1 → 7.58 ms); kept: tf32, compile; checked against the baseline ...``: the account's figures."""
    figures = figures_of(d)
    unit = figures.get("unit")
    base, head = figures.get("baseline") or {}, figures.get("headline") or {}
    kept = ", ".join(n for link in figures.get("links") or [] for n in link.get("names") or []) or "none"
    before = format_throughput(base.get("throughput"))
    after = format_throughput(head.get("throughput") if figures.get("links") else base.get("throughput"), unit)
    final_ms = head.get("step_ms") if figures.get("links") else base.get("step_ms")
    steps = f"step {format_step(base.get('step_ms'))} → {format_step(final_ms)} ms"
    versus = switches_text(figures)
    line = f"{before} → {after} ({headline_text(figures)}{f', {versus}' if versus else ''}; {steps}); kept: {kept}"
    check = check_text(figures)
    if check:
        line += f"; {check}"
    s = d.get("summary") or {}
    if s.get("interrupted") or d.get("interrupted"):
        line = f"INTERRUPTED ({s.get('interrupted') or d.get('interrupted')}); rungs finished before it: " + line
    return line


def diagnosis_line(diagnosis: dict[str, Any]) -> str:
    """What set the pace of the step the rungs were judged on (the baseline's, or the user's switches'
    where they were the floor), in one line (its class and figures), and the note where the profile
    could not be taken."""
    line = str(diagnosis.get("summary") or diagnosis.get("kind") or MISSING)
    if diagnosis.get("of"):
        line = f"{line} (of {diagnosis['of']})"
    return f"{line} ({diagnosis['note']})" if diagnosis.get("note") else line


def holds_line(d: dict[str, Any]) -> str | None:
    """Whether the ladder's figure held in the fit's own steps, in one line (None: not measured)."""
    h = d.get("holds")
    if not h:
        return None
    ladder, fit = h.get("ladder") or {}, h.get("fit") or {}
    if not fit:
        return f"The fit's own steps: {h.get('note') or 'not measured'}."
    line = (
        f"The fit's own steps: {format_step(fit.get('step_ms'), fit.get('spread'))} ms against the ladder's "
        f"{format_step(ladder.get('step_ms'))} ms ({h['gap']:+.1%})"
    )
    note = f" ({h['note']})" if h.get("note") else ""
    if h.get("flagged"):
        return f"{line}, more than {h.get('threshold', 0):.0%} apart. Likely cause: {h.get('cause')}.{note}"
    return f"{line}: the figure holds (within {h.get('threshold', 0):.0%}).{note}"


# -- the document ---------------------------------------------------------------------------


def render_markdown(d: dict[str, Any]) -> str:
    """The whole ``report.md`` for a report dict."""
    recipe = d.get("recipe")
    title = d.get("title") or f"speedkit report{f': {recipe}' if recipe else ''}"
    lines = [f"# {title}", ""]
    lines += [f"**Summary:** {_escape(summary_line(d))}", ""]
    diagnosis = (d.get("run") or {}).get("diagnosis")
    if diagnosis:
        lines += [f"**Diagnosis:** {_escape(diagnosis_line(diagnosis))}", ""]
    holds = holds_line(d)
    if holds:
        lines += [f"**In training:** {_escape(holds)}", ""]
    lines += _run(d)
    lines += _environment(d)
    lines += _flops(d)
    lines += _measure(d)
    lines += ["## Ladder", ""]
    lines += _table(d)
    lines += [""]
    lines += _ranks(d)
    lines += _profile_sections(d)
    lines += ["## Details", ""]
    for i, rung in enumerate(d.get("rungs") or []):
        lines += _details(i, rung)
    return "\n".join(lines).rstrip() + "\n"


# -- schema 3: where the time goes, what each rung bought, host syncs --------------------------------

NOT_MEASURED = "not measured in this run"


def _ranks(d: dict[str, Any]) -> list[str]:
    """Across ranks (DDP): each rank's figures and the scaling efficiency."""
    rows = rank_rows(d)
    if rows is None:
        return []
    lines = ["## Across ranks", ""]
    line = scaling_line(d)
    if line:
        lines += [line, ""]
    for key in COMMUNICATION_KEYS:
        communication = communication_lines(d, key)
        if communication:
            lines += [communication[0], "", *(f"- {c}" for c in communication[1:]), ""]
    lines += [
        "Each window's figures are the slowest rank's (the ranks' collectives keep them in step: each step waits for the slowest); each rank's own medians:",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    for label, rank, step, wait, host, peak in rows:
        lines.append(f"| {label} | {rank} | {step:.2f} | {wait:.2f} | {host:.2f} | {format_bytes(peak) if peak else MISSING} |")
    return [*lines, ""]


def _ms(value: Any) -> str:
    return f"{value:,.1f}" if _known(value) else MISSING


def _profile_sections(d: dict[str, Any]) -> list[str]:
    """The breakdown before/after, the attribution and the host syncs, each when its key is there; a
    report without them (schema 2, or a run that did not profile) gets one line saying so."""
    p = d.get("profile") or {}
    windows = [w for w in p.get("windows") or [] if isinstance(w, dict)]
    attribution = figures_of(d).get("attribution") or {}
    syncs = p.get("host_syncs") if isinstance(p.get("host_syncs"), dict) else {}
    if not windows and not attribution.get("rungs") and not syncs:
        note = f" ({_escape(p['note'])})" if p.get("note") else ""
        return [f"Time breakdown, attribution and host syncs: {NOT_MEASURED}{note}.", ""]
    return _breakdown(p, windows) + _attribution(attribution, p) + _host_syncs(syncs, p.get("host_syncs_note"))


def _labels(p: dict[str, Any], windows: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    cats = list(p.get("categories") or [])
    for w in windows:
        cats += [c for c in (w.get("breakdown_ms") or {}) if c not in cats]
    return cats, {c: str((p.get("labels") or {}).get(c) or c.replace("_", " ")) for c in cats}


def _breakdown(p: dict[str, Any], windows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Where the time goes", ""]
    if not windows:
        return lines + [f"Time breakdown: {NOT_MEASURED}" + (f" ({_escape(p['note'])})" if p.get("note") else "") + ".", ""]
    before = next((w for w in windows if w.get("label") == "baseline"), windows[0])
    after = next((w for w in windows if w.get("label") == "final"), windows[-1])
    cats, labels = _labels(p, windows)
    bb, ab = before.get("breakdown_ms") or {}, after.get("breakdown_ms") or {}
    lines += [
        f"ms per optimizer step, over {p.get('steps') or before.get('steps') or MISSING} profiled steps per window; "
        "the windows are timed with the profiler on, whose cost per op inflates their step times (on a CPU most): "
        "their categories say where the time goes; the speedups are the paired measurements'."
        + (f" Note: {_escape(p['note'])}." if p.get("note") else ""),
        "",
        f"| category | before ({_escape(before.get('label'))}) | after ({_escape(after.get('label'))}) | Δ |",
        "|---|---:|---:|---:|",
    ]
    for c in cats:
        b, a = bb.get(c), ab.get(c)
        if not (_known(b) and b) and not (_known(a) and a):
            continue
        delta = f"{a - b:+,.1f}" if _known(a) and _known(b) else MISSING
        lines.append(f"| {_escape(labels[c])} | {_ms(b)} | {_ms(a)} | {delta} |")
    sb, sa = before.get("step_ms"), after.get("step_ms")
    lines.append(f"| **step** | **{_ms(sb)}** | **{_ms(sa)}** | {f'{sa - sb:+,.1f}' if _known(sa) and _known(sb) else MISSING} |")
    lines.append(
        f"| device busy | {format_percent(before.get('device_busy_fraction'))} | "
        f"{format_percent(after.get('device_busy_fraction'))} | |"
    )
    traces = [f"`{_escape(w['trace'])}` ({_escape(w.get('label'))})" for w in windows if w.get("trace")]
    if traces:
        lines += ["", "Traces (open in https://ui.perfetto.dev or chrome://tracing): " + ", ".join(traces) + "."]
    return lines + [""]


def _attribution(a: dict[str, Any], p: dict[str, Any]) -> list[str]:
    lines = ["## Attribution", ""]
    rows = [r for r in a.get("rungs") or [] if isinstance(r, dict)]
    if not rows:
        return lines + [f"Attribution: {NOT_MEASURED}.", ""]
    for r in rows:
        line = r.get("line") or f"{r.get('name')}: {r.get('figure') or MISSING}"
        lines.append(f"- {_escape(line)}")
    lines += ["", f"Check: {attribution_check_text(a)}."]
    if a.get("interaction"):
        lines += ["", f"Interaction: {_escape(a['interaction'])}"]
    return lines + [""]


def _host_syncs(syncs: dict[str, Any], why_none: str | None = None) -> list[str]:
    lines = ["## Host syncs", ""]
    if not syncs:
        return lines + [f"Host syncs: {_escape(why_none) if why_none else NOT_MEASURED}.", ""]
    for label in [k for k in ("baseline", "final") if k in syncs] + [k for k in syncs if k not in ("baseline", "final")]:
        items = [s for s in syncs.get(label) or [] if isinstance(s, dict)]
        title = {"baseline": "Before (baseline)", "final": "After (final)"}.get(label, label)
        if not items:
            lines += [f"{_escape(title)}: none found.", ""]
            continue
        lines += [f"{_escape(title)}:", "", "| where | code | why | found in one step |", "|---|---|---|---:|"]
        lines += [
            f"| `{_escape(s.get('where'))}` | `{_escape(s.get('code'))}` | {_escape(s.get('reason') or MISSING)} | "
            f"{_escape(s.get('count', MISSING))} |"
            for s in items
        ]
        lines.append("")
    return lines


def _environment(d: dict[str, Any]) -> list[str]:
    env = d.get("environment") or {}
    device = d.get("device") or env.get("device") or MISSING
    if env.get("gpu_name"):
        hw = (
            f"{env['gpu_name']} (compute capability {env.get('gpu_compute_capability') or MISSING}, "
            f"{format_bytes(env.get('gpu_memory_bytes'))}), driver {env.get('gpu_driver') or MISSING}, "
            f"{env.get('gpu_count') or MISSING} GPU(s) visible"
        )
    else:
        hw = (
            f"{env.get('cpu_model') or 'unknown CPU'}, {env.get('cpu_usable') or env.get('cpu_count') or MISSING} "
            f"CPUs usable, {env.get('torch_threads') or MISSING} torch threads"
        )
    cuda = f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else ""
    software = " · ".join(
        f"{name} {env.get(key) or MISSING}{cuda if key == 'torch' else ''}"
        for name, key in (
            ("python", "python"),
            ("torch", "torch"),
            ("triton", "triton"),
            ("lightning", "lightning"),
            ("speedkit", "speedkit"),
        )
    )
    return [
        "## Environment",
        "",
        f"- Device: `{device}` — {_escape(hw)}",
        f"- Software: {software}",
        f"- Platform: {env.get('platform') or MISSING}",
        "",
    ]


#: run entries with a sentence of their own
_RUN_SENTENCES = ("noise", "budget", "trials_s", "trial_order", "diagnosis", "first_tried")


def _run(d: dict[str, Any]) -> list[str]:
    run = d.get("run") or {}
    if not run:
        return []
    settings = {k: v for k, v in run.items() if k not in _RUN_SENTENCES}
    lines = [
        "## The run",
        "",
        "Trials ran the user's own step: " + ", ".join(f"`{k}={_value(v)}`" for k, v in settings.items()) + ".",
        "",
    ]
    noise = run.get("noise")
    if noise:
        lines += [
            f"- Noise: the baseline's windows vary by {format_percent(noise.get('baseline_spread'))} (likely source: "
            f"{_escape(noise.get('source'))}); the comparisons timed windows of {noise.get('window_steps', MISSING)} steps"
            + (
                ", sized again by time for the step in effect: "
                + ", ".join(
                    f"{r.get('window_steps', MISSING)} steps at {_num(r.get('step_ms'), '.2f')} ms (from {_escape(r.get('before'))})"
                    for r in noise["resized"]
                )
                if noise.get("resized")
                else ""
            )
            + "."
        ]
    budget = run.get("budget")
    if budget or run.get("trials_s") is not None:
        budget = budget or {}
        skipped = ", ".join(budget.get("skipped") or []) or "nothing"
        lines += [
            f"- Trials: {_num(run.get('trials_s'), '.0f')} s against a budget of {_num(budget.get('budget_s'), '.0f')} s "
            f"({_escape(budget.get('rule') or MISSING)}); skipped for it: {skipped}."
        ]
        phases = budget.get("phases") or {}
        if phases:
            lines += ["- Time per phase: " + ", ".join(f"{_escape(k)} {_num(v, '.1f')} s" for k, v in phases.items()) + "."]
    for pace in run.get("loader_pace") or []:
        under = pace.get("under_steps") or {}
        how = (
            f"read alone {_num(pace.get('alone_ms_per_batch'), '.2f')} ms, with the steps "
            f"{_num(statistics.fmean(under['rounds_ms']), '.2f')} ms, waiting {_num(under.get('wait_share'), '.0%')} of them"
            if under.get("loader_bound") and under.get("rounds_ms")
            else "read alone; the steps were slower than it"
            if "alone_ms_per_batch" in pace
            else "read alone"
        )
        lines += [
            f"- Loader pace: {_escape(pace.get('source'))} with {pace.get('workers', MISSING)} workers sustains "
            f"{_num(pace.get('ms_per_batch'), '.2f')} ms a batch ({how}; measured once, {pace.get('batches', MISSING)} "
            f"batches read alone, {_num(pace.get('seconds'), '.1f')} s); no window that reads it is timed faster than "
            "that per batch, as the fit's steps cannot be (its workers buffer batches while the other configuration's "
            "windows run)."
        ]
    if run.get("first_tried"):
        lines += [f"- Plan: {_escape(run['first_tried'])}."]
    if run.get("trial_order"):
        lines += [f"- Order: {_escape(run['trial_order'])}."]
    return lines + ([""] if len(lines) > 4 else [])


def _flops(d: dict[str, Any]) -> list[str]:
    f = d.get("flops") or {}
    per_step = f.get("per_step")
    peak = f.get("peak_tflops")
    return [
        "## FLOPs and MFU",
        "",
        f"- FLOPs per step: {f'{per_step / 1e12:.3f} TFLOP ({per_step:,})' if _known(per_step) else MISSING}",
        f"- Peak: {f'{peak:g} TFLOP/s' if _known(peak) else MISSING} — {f.get('peak_source') or MISSING}",
        f"- Convention: {f.get('convention') or MISSING}",
        "",
    ]


def _measure(d: dict[str, Any]) -> list[str]:
    settings = d.get("measure") or {}
    if not settings:
        return []
    text = ", ".join(f"`{k}={_value(v)}`" for k, v in settings.items())
    return [
        "## Measurement",
        "",
        f"Settings: {text}.",
        "Step time is the median over timed windows of the mean step time in a window; "
        "± is the measured noise of the window means (`spread`, relative to the median). "
        "Each rung was timed against the configuration before it in interleaved A B B A blocks of windows, "
        'in the same period; "vs previous" is its one figure: a kept rung\'s decided gain (its own, or its '
        "group's, naming the group), with its confidence interval, or a rung not kept's last comparison. A "
        "rung is kept only when the whole interval clears the minimum gain. The kept rungs are listed in the "
        "chain's order: their step times are the baseline's divided by the figures so far, and the chain's "
        "product is the headline; the final check against the baseline checks it.",
        "",
    ]


def _table(d: dict[str, Any]) -> list[str]:
    lines = [
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(TABLE_COLUMNS) - 3) + ["---"]) + "|",
    ]
    for _, cells in table_rows(d):
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return lines


def _details(i: int, rung: dict[str, Any]) -> list[str]:
    status = STATUS_LABELS.get(rung.get("status"), str(rung.get("status")))
    lines = [f"### {i}. {rung.get('name', MISSING)} — {status}", ""]
    if rung.get("reason"):
        lines.append(f"- Reason: {_escape(rung['reason'])}")
    options = rung.get("options") or {}
    lines.append(f"- Options: {', '.join(f'`{k}={_value(v)}`' for k, v in options.items()) or MISSING}")
    lines.append(f"- Precision: {rung.get('precision') or MISSING}")
    if rung.get("seconds") is not None:
        lines.append(f"- Time spent: {rung['seconds']:.1f} s")
    changes = rung.get("changes") or []
    if changes:
        lines.append("- Changes:")
        lines += [f"  - {_escape(c)}" for c in changes]
    lines += _measurement_details(rung.get("measurement"))
    lines += _comparison_details(rung.get("comparison"))
    lines += _parity_details(rung.get("parity"))
    return lines + [""]


def _measurement_details(m: dict[str, Any] | None) -> list[str]:
    if not m:
        return []
    windows = ", ".join(f"{w:.3f}" if _known(w) else MISSING for w in m.get("window_ms") or [])
    lines = [
        f"- Measurement: {m.get('warmup', MISSING)} warm-up steps, windows of {m.get('steps', MISSING)} "
        f"steps timed by {m.get('clock', MISSING)}; window means (ms): {windows or MISSING}; "
        f"{m.get('items_per_step', MISSING)} {(m.get('throughput_unit') or 'items').split('/')[0]} per step; "
        f"{_num(m.get('tflops'), '.2f')} TFLOP/s achieved; per step {_num(m.get('data_wait_ms'), '.2f')} ms "
        f"waiting for the batch and {_num(m.get('host_ms'), '.2f')} ms of host time",
    ]
    t = m.get("telemetry")
    if t:
        reasons = ", ".join(t.get("clock_event_reasons") or []) or "none"
        lines.append(
            f"- Telemetry (NVML, {t.get('samples', 0)} samples over {_num(t.get('duration_s'), '.1f')} s): "
            f"utilization {_num(t.get('util_mean'), '.1f')}% mean / {_num(t.get('util_max'), '.0f')}% max; "
            f"power {_num(t.get('power_mean_w'), '.0f')} W mean / {_num(t.get('power_max_w'), '.0f')} W max; "
            f"SM clock {_num(t.get('sm_clock_mean_mhz'), '.0f')} MHz mean / "
            f"{_num(t.get('sm_clock_min_mhz'), '.0f')} MHz min; "
            f"memory used {format_bytes(t.get('mem_used_max_bytes'))} max; clock events: {reasons}"
        )
        if t.get("slowdown_reasons"):
            lines.append(
                f"  - Slowed down by {', '.join(t['slowdown_reasons'])} in "
                f"{format_percent(t.get('slowdown_fraction'))} of samples"
            )
        if t.get("error"):
            lines.append(f"  - Telemetry stopped early: {_escape(t['error'])}")
    return lines


def _comparison_details(c: dict[str, Any] | None) -> list[str]:
    if not c:
        return []
    a, b = c.get("a") or {}, c.get("b") or {}
    return [
        f"- Paired timing: {c.get('blocks', MISSING)} A B B A blocks in {_num(c.get('seconds'), '.1f')} s; "
        f"with it {format_step(b.get('step_ms'), b.get('spread'))} ms, without {format_step(a.get('step_ms'), a.get('spread'))} "
        f"ms; speedup {_num(c.get('speedup'), '.3f')}×, {_num((c.get('confidence') or 0) * 100, '.0f')}% interval "
        f"[{_num(c.get('low'), '.3f')}, {_num(c.get('high'), '.3f')}] against a minimum of "
        f"{_num(1 + (c.get('min_gain') or 0), '.2f')}×: {str(c.get('verdict', MISSING)).replace('_', ' ')}"
    ]


def _parity_details(p: dict[str, Any] | None) -> list[str]:
    if not p:
        return []
    verdict = "passed" if p.get("passed") else "FAILED"
    lines = [
        f"- Parity: {verdict}: max relative difference {_num(p.get('max_rel_diff'), '.2e')} against "
        f"tolerance {_num(p.get('tolerance'), '.0e')} ({p.get('precision') or MISSING}) over "
        f"{p.get('steps', MISSING)} steps",
        "",
        "  | step | reference loss | loss | rel diff |",
        "  |---:|---:|---:|---:|",
    ]
    ref, got = p.get("reference_losses") or [], p.get("losses") or []
    for step in range(max(len(ref), len(got))):
        r = ref[step] if step < len(ref) else None
        g = got[step] if step < len(got) else None
        rel = abs(g - r) / abs(r) if _known(r) and _known(g) and r != 0 else None
        lines.append(f"  | {step} | {_num(r, '.6f')} | {_num(g, '.6f')} | {_num(rel, '.2e')} |")
    return lines


def _num(value: Any, spec: str) -> str:
    return format(value, spec) if _known(value) else MISSING


def _value(v: Any) -> str:
    try:
        return json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(v)


def _escape(text: Any) -> str:
    """Keep a cell on one line and its pipes from splitting the table."""
    return str(text).replace("\r", " ").replace("\n", " ").replace("|", "\\|")


def trials_time(run: dict[str, Any]) -> str:
    """`` in 43.3 s of a 120 s budget (the rungs 20.7 s, the second look 10.4 s, ...)``: the trials'
    time and its largest phases, from the report's ``run``; empty where it was not recorded."""
    seconds = run.get("trials_s")
    if seconds is None:
        return ""
    budget = (run.get("budget") or {}).get("budget_s")
    phases = sorted(((run.get("budget") or {}).get("phases") or {}).items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{name} {t:.1f} s" for name, t in phases[:4] if t >= 0.05)
    return (
        f" in {seconds:.1f} s"
        + (f" of a {budget:.0f} s budget" if budget else "")
        + (f" ({shown}{', ...' if len(phases) > 4 else ''})" if shown else "")
    )
