"""report.html: one self-contained page, every section, escaped strings, embedded plots; write_report
writes it; report.md's schema-3 sections. Rendered from tests/fixtures/report_v3.json (a rendering
fixture: a real schema-2 report with the schema-3 keys filled in) and from real schema-2 reports."""

from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path

import pytest

from speedkit.report import FORMATS, html_sections, load_report, plots, write_report
from speedkit.report import html as html_report
from speedkit.report.html import NO_MATPLOTLIB, SECTIONS, render_html
from speedkit.report.html_sections import NOT_MEASURED
from speedkit.report.markdown import figures_of, format_step, render_markdown, table_rows

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "report_v3.json"
LLAMA = REPO / "bench" / "results" / "2026-11-27_h200_zoo_hf-llama_accumulate4_83219d4_report.json"
RESNET = REPO / "bench" / "results" / "2026-11-27_h200_zoo_tv-resnet50_9b43302_report.json"

HAS_MPL = plots.load_matplotlib() is not None


def _v3() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def v3_page(tmp_path_factory) -> str:
    return render_html(_v3(), tmp_path_factory.mktemp("v3"))


@pytest.fixture(scope="module")
def llama_page(tmp_path_factory) -> str:
    return render_html(json.loads(LLAMA.read_text(encoding="utf-8")), tmp_path_factory.mktemp("llama"))


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setattr(html_report, "load_matplotlib", lambda: None)


def _assert_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # nothing is fetched: no external script, style sheet, image, font or frame
    assert not re.search(r"<(script|link|iframe|object|embed)\b", page, re.I), "no scripts, style sheets or frames"
    tags = re.findall(r"<[a-z][^>]*>", page, re.I)
    srcs = [v for t in tags for v in re.findall(r"""\bsrc\s*=\s*["']?([^"'\s>]*)""", t, re.I)]
    hrefs = [v for t in tags for v in re.findall(r"""\bhref\s*=\s*["']?([^"'\s>]*)""", t, re.I)]
    assert all(v.startswith("data:") for v in srcs), "every src is a data: URI"
    assert not [v for v in hrefs if re.match(r"(https?:)?//", v, re.I)], "no link to a network resource"
    assert not re.search(r"url\(\s*['\"]?(https?:|//)", page, re.I), "no CSS url() fetch"
    assert "@import" not in page


def test_the_fixture_is_labelled_and_loads_as_schema_3():
    d = load_report(FIXTURE)
    assert d["schema_version"] == 3 and "rendering fixture" in d["_fixture"].lower()
    for key in ("profile", "attribution", "telemetry_timeline", "fit_monitor"):
        assert d[key], key


def test_v3_page_is_one_file_with_every_section(v3_page):
    _assert_self_contained(v3_page)
    for sid, heading in SECTIONS:
        assert f'<section id="{sid}"><h2>{html.escape(heading)}</h2>' in v3_page, heading
    # every section has its content: nothing says "not measured" on a v3 report with every key
    assert NOT_MEASURED not in v3_page
    for text in (
        "10.11× [7.70–13.29]",  # the headline: the final check, the final configuration measured directly
        "together, as the final check measured them",  # the chain's last link: the check over the rungs' 8.58x
        "174.7 ms",
        "187.6k",
        "44.2%",  # headline
        "205.8 ms",  # the chain's step at its last rung
        "GEMM",
        "host-bound idle GPU",
        "1,290.0 ms",
        "−1,197.0 ms",  # breakdown table
        "8.58×",
        "do not agree",
        "Interaction:",  # attribution check
        "modeling_llama.py:612",
        "self._result.loss.item()",  # host syncs
        'href="traces/baseline.json.gz"',
        "https://ui.perfetto.dev",
        "chrome://tracing",  # traces, as text
        "sw_power_cap",
        "Confounders:",  # telemetry
        "allocator retries",
        "NVIDIA H200",
        "triton_layers",
        "not shown to pay",
    ):
        assert text in v3_page, text
    assert "https://ui.perfetto.dev" not in re.findall(r'href="([^"]*)"', v3_page)


def test_numbers_are_rounded_and_missing_values_are_dashes(v3_page, llama_page):
    for page in (v3_page, llama_page):
        text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
        assert not re.search(r"\d\.\d{5,}", text), re.search(r".{40}\d\.\d{5,}.{20}", text)
        assert not re.search(r">\s*(None|nan|NaN|inf)\s*<", text), "a missing value is a dash"


def test_a_real_schema_2_report_renders_and_says_what_was_not_measured(llama_page):
    _assert_self_contained(llama_page)
    assert "10.11×" in llama_page and "micro_batch" in llama_page
    for what in ("Time breakdown", "Attribution", "Host syncs", "Traces", "Telemetry timeline", "Fit monitor"):
        assert f"{what}: {NOT_MEASURED}" in llama_page, what


@pytest.mark.skipif(not HAS_MPL, reason="needs matplotlib")
def test_plots_are_embedded_as_png(v3_page, llama_page):
    # waterfall, throughput/MFU, memory, breakdown, every window's breakdown, telemetry timeline
    assert v3_page.count('src="data:image/png;base64,') == 6
    assert llama_page.count('src="data:image/png;base64,') == 3
    assert NO_MATPLOTLIB not in v3_page


def test_without_matplotlib_the_page_says_how_to_get_plots(no_matplotlib, tmp_path):
    page = render_html(_v3(), tmp_path)
    assert NO_MATPLOTLIB in page and "data:image" not in page
    _assert_self_contained(page)
    assert "1,290.0 ms" in page  # the tables are all there
    paths = write_report(_v3(), tmp_path / "out")  # and write_report does not fail for it
    assert NO_MATPLOTLIB in paths["html"].read_text(encoding="utf-8")


def test_a_plot_that_raises_becomes_a_note(monkeypatch, tmp_path):
    def broken(*args):
        raise ValueError("<bad>")

    monkeypatch.setattr(html_sections, "plot_waterfall", broken)
    monkeypatch.setattr(html_report, "load_matplotlib", lambda: ("mpl", None, None))
    monkeypatch.setattr(html_sections, "plot_throughput_mfu", broken)
    monkeypatch.setattr(html_sections, "plot_memory", broken)
    monkeypatch.setattr(html_sections, "plot_breakdown", broken)
    monkeypatch.setattr(html_sections, "plot_timeline", broken)
    page = render_html(_v3(), tmp_path)
    assert "the plot could not be drawn: ValueError: &lt;bad&gt;" in page and "<bad>" not in page


def test_every_string_from_the_report_is_escaped(no_matplotlib, tmp_path):
    d = _v3()
    evil = "<script>alert(1)</script>"
    d["title"] = f"run {evil}"
    d["rungs"][5]["reason"] = f"reason with {evil} & more"
    d["rungs"][5]["name"] = f"sdpa{evil}"
    d["environment"]["gpu_name"] = f"GPU {evil}"
    d["profile"]["host_syncs"]["final"][0]["code"] = f"x = {evil}"
    d["profile"]["windows"][0]["top_ops"][0]["name"] = f'op"{evil}'
    d["profile"]["windows"][0]["trace"] = 'traces/"><img src=x onerror=alert(1)>.json'
    d["attribution"]["interaction"] = evil
    d["telemetry_timeline"]["samples"][0]["reasons"] = [evil]
    page = render_html(d, tmp_path)
    assert "<script" not in page.lower() and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page
    assert page.count("&lt;script&gt;") >= 7


def test_trace_links_are_relative_and_marked_when_missing(no_matplotlib, tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "baseline.json.gz").write_bytes(b"")
    d = _v3()
    d["profile"]["windows"][-1]["trace"] = "/abs/final.json.gz"  # an absolute path is shown, not linked
    page = render_html(d, tmp_path)
    row = page[page.index('href="traces/baseline.json.gz"') :][:200]
    assert "not found" not in row.split("</tr>")[0]
    assert 'href="/abs' not in page and "<code>/abs/final.json.gz</code>" in page
    # the windows without a trace share one row per reason
    assert page.count("traces are kept for the baseline and the final configuration only") == 1


def test_partial_profile_and_missing_values_render(no_matplotlib, tmp_path):
    d = _v3()
    d["profile"] = {"steps": 3, "categories": [], "windows": [], "host_syncs": {}, "note": "profiling skipped: <cpu>"}
    d["attribution"] = None
    d["telemetry_timeline"] = None
    d["fit_monitor"] = {}
    d["final_check"] = None
    d["summary"]["speedup_ci"] = None
    page = render_html(d, tmp_path)
    assert "profiling skipped: &lt;cpu&gt;" in page and f"Attribution: {NOT_MEASURED}" in page
    minimal = render_html({"schema_version": 2, "rungs": [{"name": "baseline", "status": "baseline"}]}, tmp_path)
    _assert_self_contained(minimal)
    assert "—" in minimal


@pytest.mark.parametrize("path", [LLAMA, RESNET], ids=["llama", "resnet50"])
def test_write_report_writes_html_by_default(path, no_matplotlib, tmp_path):
    assert FORMATS["html"] == "report.html"
    paths = write_report(load_report(path), tmp_path)
    assert set(paths) == {"json", "md", "html"} and paths["html"] == tmp_path / "report.html"
    _assert_self_contained(paths["html"].read_text(encoding="utf-8"))
    assert load_report(paths["json"]) == json.loads(path.read_text(encoding="utf-8"))
    assert set(write_report(load_report(path), tmp_path / "md", formats=("md",))) == {"md"}


def test_markdown_has_the_schema_3_sections():
    md = render_markdown(_v3())
    for heading in ("## Where the time goes", "## Attribution", "## Host syncs"):
        assert heading in md
    assert md.index("## Ladder") < md.index("## Where the time goes") < md.index("## Details")
    assert "| GEMM | 1,290.0 | 93.0 | -1,197.0 |" in md
    for r in figures_of(_v3())["attribution"]["rungs"]:  # the account's, derived from the record
        assert f"- {r['line']}" in md
    assert "multiply to 8.58×; the final check measured 10.11×, the headline" in md and "do not agree" in md
    assert "`self._result.loss.item()`" in md and "https://ui.perfetto.dev" in md


def test_markdown_of_a_schema_2_report_says_the_sections_were_not_measured():
    md = render_markdown(json.loads(RESNET.read_text(encoding="utf-8")))
    assert f"Time breakdown, attribution and host syncs: {NOT_MEASURED}." in md
    assert "## Attribution" not in md
    d = copy.deepcopy(_v3())
    d["profile"]["host_syncs"] = {}
    d["profile"]["windows"] = [d["profile"]["windows"][0], d["profile"]["windows"][-1]]  # no prefix: no attribution
    md = render_markdown(d)
    assert "## Where the time goes" in md and f"Attribution: {NOT_MEASURED}." in md and f"Host syncs: {NOT_MEASURED}." in md


def test_load_report_reads_schema_2_3_and_4_only(tmp_path):
    d = _v3()
    for version, ok in ((2, True), (3, True), (4, True), (1, False), (5, False), ("3", False), (3.0, False), (True, False)):
        d["schema_version"] = version
        (tmp_path / "report.json").write_text(json.dumps(d))
        if ok:
            assert load_report(tmp_path)["schema_version"] == version
        else:
            with pytest.raises(Exception, match="schema_version"):
                load_report(tmp_path)


@pytest.mark.skipif(not HAS_MPL, reason="needs matplotlib")
def test_plots_survive_odd_names_groups_and_gaps(tmp_path):
    """A "$" in a rung's name is text (not mathtext), rungs kept together show their group, and NVML
    samples with a quantity not read (None) leave a gap, not a failed plot."""
    d = _v3()
    for r in d["rungs"]:
        if r["name"] == "compile":
            r["name"] = "compile$x_1"
    d["summary"]["kept"] = [k.replace("compile", "compile$x_1") for k in d["summary"]["kept"]]
    # compile and async_progress_bar kept together on a second look: one group, one figure
    d["rungs"].append(
        {
            "name": "second look: compile$x_1 + async_progress_bar beneath nothing",
            "status": "closing",
            "comparison": {"speedup": 1.3, "low": 1.2, "high": 1.4, "verdict": "faster", "blocks": 6},
        }
    )
    for s in d["telemetry_timeline"]["samples"][:10]:
        s["power_w"] = s["power_limit_w"] = s["sm_clock_mhz"] = None
    d["telemetry_timeline"]["marks"][6]["label"] = "$weird$ <mark>"
    page = render_html(d, tmp_path)
    assert "could not be drawn" not in page
    assert page.count('src="data:image/png;base64,') == 6
    assert "with its group (compile$x_1 + async_progress_bar)" in page and "&lt;mark&gt;" in page


@pytest.mark.skipif(not HAS_MPL, reason="the waterfall's rows are read where its plot is drawn (matplotlib)")
def test_the_waterfall_the_table_and_the_attribution_give_one_figure_per_rung(monkeypatch, tmp_path):
    # each kept link's bar is the baseline's step time divided by the figures kept up to it: the account's
    # chain, the table's step times and figures, the attribution's; never a rung's own windows' median
    d = _v3()
    figures = figures_of(d)
    seen = {}

    def capture(mpl, rows):
        seen["rows"] = rows
        return b""

    monkeypatch.setattr(html_sections, "plot_waterfall", capture)
    monkeypatch.setattr(html_sections, "_img", lambda png, alt: "")
    render_html(d, tmp_path)
    rows = seen["rows"]
    links = figures["links"]
    assert [label for label, _ in rows] == [
        "baseline",
        *(link.get("label") or " + ".join(link["names"]) for link in links),
        "final",
    ]
    base, ms, expected = figures["baseline"]["step_ms"], figures["baseline"]["step_ms"], []
    for link in links:
        ms /= link["speedup"]
        expected.append(ms)
    assert rows[0][1] == base and [ms for _, ms in rows[1:-1]] == pytest.approx(expected)
    assert rows[-1][1] == pytest.approx(expected[-1]) == pytest.approx(figures["headline"]["step_ms"])
    table = {r[0]["name"]: r[1] for r in table_rows(d)}
    for link in links:
        for name in link["names"]:
            assert table[name][2] == format_step(link["step_ms"]) and table[name][6] == figures["rungs"][name]["text"]
    for r in figures["attribution"]["rungs"]:
        assert r["figure"] == figures["rungs"][r["name"]]["text"] and r["line"].startswith(f"{r['name']}: {r['figure']}")
