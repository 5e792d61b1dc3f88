"""`speedkit report DIR` renders report.md/.html again; `speedkit compare A B` puts two runs side by side;
bad paths or files that are not reports: one line, exit code 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from speedkit.frontend.cli import main
from speedkit.report import html as html_report
from speedkit.report import load_report
from speedkit.report.compare import compare_reports

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "report_v3.json"
LLAMA = REPO / "bench" / "results" / "2026-11-27_h200_zoo_hf-llama_accumulate4_83219d4_report.json"


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    """The CLI's plumbing is under test here, not the plots (test_report_html.py draws them)."""
    monkeypatch.setattr(html_report, "load_matplotlib", lambda: None)


def _run_dir(tmp_path: Path, name: str, source: Path = FIXTURE, edit=None) -> Path:
    d = json.loads(source.read_text(encoding="utf-8"))
    if edit:
        edit(d)
    out = tmp_path / name
    out.mkdir()
    (out / "report.json").write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    return out


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("speedkit: error:") and "Traceback" not in err
    return lines[0]


def test_report_renders_md_and_html_again(tmp_path, capsys):
    run = _run_dir(tmp_path, "run")
    before = (run / "report.json").read_text(encoding="utf-8")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"md: {run / 'report.md'}" in out and f"html: {run / 'report.html'}" in out
    assert (run / "report.md").read_text(encoding="utf-8").startswith("# speedkit report")
    assert "## Attribution" in (run / "report.md").read_text(encoding="utf-8")
    assert "<h2>Host syncs</h2>" in (run / "report.html").read_text(encoding="utf-8")
    assert (run / "report.json").read_text(encoding="utf-8") == before  # the source of truth is left alone
    # a report.json path works too, and a schema-2 report renders
    shutil.copy(LLAMA, tmp_path / "llama.json")
    assert main(["report", str(tmp_path / "llama.json")]) == 0
    assert (tmp_path / "report.html").is_file() and (tmp_path / "report.md").is_file()


def _b_edit(d: dict) -> None:
    """Run B: 10% slower at the end (tf32's figure and the final check's a tenth less), batched reverted, cuda_graph kept (at
    1.00x), GEMM slower."""
    for r in d["rungs"]:
        if r["name"] == "tf32":
            r["comparison"] = {**r["comparison"], **{k: r["comparison"][k] / 1.1 for k in ("speedup", "low", "high")}}
        if r["name"] == "batched":
            r["status"], r["reason"] = "reverted", "not shown to pay"
        if r["name"] == "cuda_graph":
            r["status"] = "kept"
            r["comparison"] = {"speedup": 1.0, "low": 0.99, "high": 1.01, "verdict": "faster", "blocks": 6}
    # the headline is the final check's: B's final configuration measured a tenth slower against the baseline
    d["final_check"] = {**d["final_check"], **{k: d["final_check"][k] / 1.1 for k in ("speedup", "low", "high")}}
    d["profile"]["windows"][-1]["breakdown_ms"]["gemm"] = 110.5


def test_compare_prints_ratios_and_flags_rungs_kept_in_one_run_only(tmp_path, capsys):
    a, b = _run_dir(tmp_path, "a"), _run_dir(tmp_path, "b", edit=_b_edit)
    out_md = tmp_path / "cmp" / "compare.md"
    assert main(["compare", str(a), str(b / "report.json"), "--out", str(out_md)]) == 0
    out = capsys.readouterr().out
    assert "1.100×" in out and "0.909×" in out  # final step time and throughput, B/A
    assert "batched: kept in A only" in out and "cuda_graph: kept in B only" in out
    assert "1,290.0 → 93.0" in out and "1,290.0 → 110.5" in out and "+17.5" in out  # GEMM before → after, A and B
    md = out_md.read_text(encoding="utf-8")
    assert "| final step time | 174.7 ms | 192.2 ms | 1.100× | A better |" in md
    # batched's figure: its group's in A (kept together on a second look), that group's comparison in B too
    assert "| batched | kept | reverted | 1.10× | 1.10× | **kept in A only** |" in md
    assert "| GEMM | 1,290.0 → 93.0 | 1,290.0 → 110.5 | +17.5 |" in md


def test_compare_result_api_on_a_schema_2_and_a_schema_3_report():
    result = compare_reports(load_report(LLAMA), load_report(FIXTURE))
    assert result.breakdown is None and result.breakdown_note == "no profile in A"
    by = {m.name: m for m in result.metrics}
    assert by["final step time"].ratio == pytest.approx(1.0) and by["final step time"].verdict == "same"
    assert not result.kept_in_one_only
    md = result.to_markdown()
    assert "Not compared: no profile in A." in md and md.startswith("# speedkit compare")


@pytest.mark.parametrize("case", ["missing", "folder without report", "not json", "json not a report", "old schema"])
@pytest.mark.parametrize("command", ["report", "compare"])
def test_bad_inputs_one_line_exit_2(tmp_path, capsys, command, case):
    good = _run_dir(tmp_path, "good")
    bad = {
        "missing": tmp_path / "nope",
        "folder without report": tmp_path,
        "not json": tmp_path / "x.txt",
        "json not a report": tmp_path / "x.json",
        "old schema": tmp_path / "old.json",
    }[case]
    (tmp_path / "x.txt").write_text("hello")
    (tmp_path / "x.json").write_text("[1, 2]")
    (tmp_path / "old.json").write_text(json.dumps({"schema_version": 1, "rungs": []}))
    argv = ["report", str(bad)] if command == "report" else ["compare", str(good), str(bad)]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert str(bad) in line or str(bad / "report.json") in line
    assert not (tmp_path / "report.html").exists()


def test_compare_usage_errors_exit_2(tmp_path, capsys):
    good = _run_dir(tmp_path, "good")
    with pytest.raises(SystemExit) as info:
        main(["compare", str(good)])
    assert info.value.code == 2
    assert "required: b" in _one_error_line(capsys)
    assert main(["compare", str(good), str(good), "--out", str(tmp_path)]) == 2
    assert "--out" in _one_error_line(capsys)
