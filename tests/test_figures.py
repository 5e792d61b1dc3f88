"""One figure per rung, derived in one place: a property test over random decision logs.

Each case is a random run's record (:class:`speedkit.results.Decision` ledger, rows, the final
configuration, sometimes a final check and profile windows), as the trials write it: the user's switches
kept as the floor (timed or not), rungs kept or reverted on their own comparisons, groups kept together,
members left out of them, rungs reverted by a closing check or by the fit. For every case, every figure
printed for a rung (the table of report.md, report.html and the console, the JSON rows, the attribution,
the waterfall) is that rung's one figure from :func:`speedkit.figures.account.account`, the kept chain's
product is the headline, every step time is the one baseline's over the chain so far, an interval is
printed only for what was measured, and a headline whose interval holds 1.0 says "not shown".
"""

from __future__ import annotations

import html
import io
import math
import random

import pytest
import torch
from rich.console import Console

from speedkit.report.console import render_console
from speedkit.report.environment import collect_environment
from speedkit.report.html import render_html
from speedkit.report.html_sections import configurations
from speedkit.report.markdown import figures_of, format_step, render_markdown, summary_line, table_rows
from speedkit.results import SCHEMA_VERSION, Decision, LadderResult, Measurement, PairedResult, RungResult, comparison_figure

CASES = 80


def _measurement(step_ms: float, rng: random.Random) -> Measurement:
    return Measurement(step_ms, rng.uniform(0.002, 0.05), [step_ms] * 3, 1, 3, 4096 / step_ms * 1e3, "tokens/s", 4096)


def _paired(rng: random.Random, speedup: float | None = None, one_block: bool = False) -> PairedResult:
    s = speedup if speedup is not None else math.exp(rng.gauss(0.05, 0.15))
    if one_block:
        return PairedResult(s, 0.0, math.inf, 0.95, 1, "undecided", 0.01)
    half = rng.uniform(0.002, 0.2)
    low, high = s * math.exp(-half), s * math.exp(half)
    verdict = "faster" if low > 1.01 else "not_faster" if high < 1.01 else "undecided"
    return PairedResult(s, low, high, 0.95, rng.randint(2, 12), verdict, 0.01)


def _random_run(seed: int) -> LadderResult:
    """A random run's record, written as the phases write it (the ledger appended in order)."""
    rng = random.Random(seed)
    names = [f"r{i}" for i in range(rng.randint(1, 9))]
    ledger: list[Decision] = []
    kept: list[str] = []
    floor = names[: rng.randint(0, min(3, len(names)))] if rng.random() < 0.6 else []
    floor_timed = rng.random() < 0.7

    def record(phase, group, keep, paired=None, extra=()):
        comparisons = ([comparison_figure(paired)] if paired is not None else []) + list(extra)
        ledger.append(Decision(phase, list(group), keep, comparisons, phase))

    if floor:
        record("the floor", floor, True, _paired(rng, rng.uniform(0.9, 3.0)) if floor_timed else None)
        kept += floor
    reverted: list[str] = []
    for name in names[len(floor) :]:
        roll = rng.random()
        if roll < 0.45:
            record("the climb", [name], True, _paired(rng, rng.uniform(1.02, 1.6), one_block=rng.random() < 0.05))
            kept.append(name)
        elif roll < 0.85:
            record("the climb", [name], False, _paired(rng))
            reverted.append(name)
    if len(reverted) >= 2 and rng.random() < 0.5:  # a group kept together on a second look
        group = rng.sample(reverted, rng.randint(2, len(reverted)))
        record("the second look", group, True, _paired(rng, rng.uniform(1.02, 1.3)))
        kept += group
        if rng.random() < 0.6:  # a member left out of it, not shown to earn its place
            gone = rng.choice(group)
            record("leave-one-out", [gone], False, _paired(rng, rng.uniform(0.95, 1.01)))
            kept.remove(gone)
            for other in group:
                if other != gone and rng.random() < 0.5:
                    record("leave-one-out", [other], True)  # shown to earn it: stands on the group's figure
    on_top = [n for n in kept if n not in floor]
    if on_top and rng.random() < 0.3:  # a closing check reverts one
        gone = rng.choice(on_top)
        record("the closing check", [gone], False, _paired(rng, rng.uniform(0.9, 1.0)))
        kept.remove(gone)
    on_top = [n for n in kept if n not in floor]
    if floor and on_top and rng.random() < 0.15:  # the fit went back to the floor
        record("the fit check", on_top, False)
        kept = [n for n in kept if n in floor]
    check = None
    if kept and rng.random() < 0.7:
        base_ms = rng.uniform(5, 500)
        check = _paired(rng, rng.uniform(0.9, 4.0))
        check.a, check.b = _measurement(base_ms, rng), _measurement(base_ms / check.speedup, rng)
        if floor and not floor_timed and set(floor) <= set(kept):  # the untimed floor's figure from the check
            record("the final check", floor, True, check)
    order = [n for n in names if n in kept]
    status = {n: "kept" if n in kept else "reverted" for n in names if any(n in d.names for d in ledger)}
    rows = [RungResult("baseline", "baseline", measurement=_measurement(rng.uniform(5, 500), rng))]
    for name in names:
        rows.append(RungResult(name, status.get(name, "not_applicable"), measurement=_measurement(10.0, rng)))
    profile = None
    if order and rng.random() < 0.5:
        windows = [
            {
                "rungs": order[:k],
                "step_ms": 10.0 + k,
                "label": str(k),
                "breakdown_ms": {"gemm": 5.0 - 0.3 * k},
                "peak_memory_bytes": 0,
            }
            for k in range(len(order) + 1)
        ]
        profile = {"windows": windows, "labels": {"gemm": "GEMM"}, "categories": ["gemm"], "steps": 3}
    return LadderResult(
        schema_version=SCHEMA_VERSION,
        recipe=None,
        environment=collect_environment(torch.device("cpu")),
        device="cpu",
        flops={"per_step": 1e9, "peak_tflops": 10.0, "convention": "x", "peak_source": "x"},
        measure={},
        rungs=rows,
        final_check=check,
        ledger=ledger,
        final_order=order,
        floor=floor,
        profile=profile,
    )


@pytest.mark.parametrize("seed", range(CASES))
def test_every_figure_printed_for_a_rung_is_its_one_figure_and_the_chain_multiplies_to_the_headline(seed, tmp_path):
    result = _random_run(seed)
    d = result.to_dict()
    want_base = result.final_check.a.step_ms if result.final_check is not None else result.baseline.measurement.step_ms
    assert d["figures"]["baseline"]["step_ms"] == want_base
    assert sorted(n for link in d["figures"]["links"] for n in link["names"]) == sorted(result.final_order)
    assert_one_figure_per_rung(d, tmp_path)


def assert_one_figure_per_rung(d: dict, out_dir) -> None:
    """The property, on any report dict (a random run's, or a real one's report.json: ``python
    tests/test_figures.py runs/tiny-cpu/report.json``)."""
    figures = d["figures"]
    assert figures == figures_of(d)  # the renderers' figures are the JSON's
    head, base = figures["headline"], figures["baseline"]
    links = figures["links"]

    # the chain: its product is the headline; each step time is the one baseline's over the chain so far
    product = 1.0
    for link in links:
        if link["speedup"] is None:
            product = None
            break
        product *= link["speedup"]
        assert link["vs_baseline"] == pytest.approx(product, rel=1e-9)
        assert link["step_ms"] == pytest.approx(base["step_ms"] / product, rel=1e-9)
    if links:
        assert head["speedup"] == (pytest.approx(product, rel=1e-9) if product is not None else None)
    else:
        assert head["speedup"] == 1.0 and head["text"].startswith("1.00×")
    kept = [n for link in links for n in link["names"]]
    assert sorted(kept) == sorted(d["summary"]["kept"])
    # one baseline: the final check's where there was one, else the baseline timed alone
    check = d.get("final_check") or {}
    want_base = (check.get("a") or {}).get("step_ms") or (d["rungs"][0].get("measurement") or {}).get("step_ms")
    assert base["step_ms"] == want_base and d["summary"]["baseline_step_ms"] == want_base

    # an interval only where comparisons with intervals were made; "not shown" where it holds 1.0
    for link in links:
        measured = link["comparisons"] and all(
            c.get("high") not in (None, math.inf) and c.get("blocks", 2) >= 2 for c in link["comparisons"]
        )
        assert (link["low"] is not None) == bool(measured), link
        assert ("[" in link["text"]) == bool(measured)
    line = summary_line(d)
    if links and head["speedup"] is not None:
        crosses = head["low"] is None or head["low"] <= 1.0
        assert head["shown"] == (not crosses)
        assert (f"not shown: {head['text']} the baseline" in line) == crosses
        assert f"{head['text']} the baseline" in line

    # one figure per rung, wherever it is printed
    rung_figures = figures["rungs"]
    table = {row["name"]: cells for row, cells in table_rows(d)}
    json_rows = {r["name"]: r for r in d["rungs"]}
    markdown = render_markdown(d)
    buffer = io.StringIO()
    render_console(d, Console(file=buffer, width=400, color_system=None))
    console = buffer.getvalue()
    page = render_html(d, out_dir)
    for name, figure in rung_figures.items():
        text = figure["text"]
        assert table[name][6] == text
        if json_rows[name]["status"] in ("kept", "reverted", "failed", "skipped"):
            assert json_rows[name]["figure"] == text
        md_row = next(line for line in markdown.splitlines() if line.startswith(f"| {name} |"))
        assert md_row.split(" | ")[6] == text
        console_row = next(line for line in console.splitlines() if line.lstrip("│ ").startswith(f"{name} "))
        assert text in console_row
        assert html.escape(text) in page
        if figure["kept"]:
            link = links[figure["link"]]
            group = link["names"]
            assert figure["speedup"] == link["speedup"]
            assert text == (link["text"] if len(group) == 1 else f"with its group ({' + '.join(group)}): {link['text']}")
            assert table[name][2] == format_step(link["step_ms"])
    # the attribution's and the waterfall's figures are the chain's
    attribution = figures["attribution"]
    if attribution is not None:
        rung_links = [link["speedup"] for link in links if not link.get("together")]
        want = None if None in rung_links else pytest.approx(math.prod(rung_links), rel=1e-12)
        assert attribution["product"] == want
        for r in attribution["rungs"]:
            assert r["figure"] == rung_figures[r["name"]]["text"] and r["line"].startswith(f"{r['name']}: ")
            if r["speedup"] is not None:
                assert r["speedup"] == links[rung_figures[r["name"]]["link"]]["speedup"]
    confs = configurations(d)
    if links:
        assert [c["label"] for c in confs] == [
            "baseline",
            *(link.get("label") or " + ".join(link["names"]) for link in links),
            "final",
        ]
        assert [c["measurement"]["step_ms"] for c in confs[1:-1]] == [link["step_ms"] for link in links]
        assert confs[-1]["measurement"]["step_ms"] == head["step_ms"] and confs[0]["measurement"]["step_ms"] == base["step_ms"]


if __name__ == "__main__":  # the property on real reports: python tests/test_figures.py REPORT_JSON...
    import sys
    import tempfile

    from speedkit.report import load_report

    for path in sys.argv[1:]:
        assert_one_figure_per_rung(load_report(path), tempfile.mkdtemp())
        print(f"{path}: every figure printed for a rung is its one figure; the chain multiplies to the headline")
