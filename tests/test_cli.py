"""The speedkit command: one-line errors with exit code 2, and the whole optimize -> fit path on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_recipe import BAD_RECIPES

from speedkit.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("yaml_text", "field"), [c[1:] for c in BAD_RECIPES], ids=[c[0] for c in BAD_RECIPES])
@pytest.mark.parametrize("command", ["validate", "optimize", "fit"])
def test_malformed_recipe_one_line_exit_2(tmp_path, capsys, command, yaml_text, field):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml_text)
    code = main([command, str(path)] + (["--out", str(tmp_path / "out")] if command == "optimize" else []))
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("speedkit: error:") and field in lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists(), "no work may start before the recipe is valid"


def test_missing_file_one_line_exit_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "file not found" in err


def test_console_script_exit_code_and_no_traceback(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model: {class_path: speedkit.demos.NaiveGPT}\ndata: {synthetic: tokens}\nladder: [tf32]\nmeasure: {steps: -3}\n")
    proc = subprocess.run([sys.executable, "-m", "speedkit.cli", "optimize", str(path)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "measure.steps" in proc.stderr and "Traceback" not in proc.stderr


def test_optimize_refuses_an_empty_ladder_but_validate_accepts_it(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text("model: {class_path: speedkit.demos.NaiveGPT}\ndata: {synthetic: tokens}\nladder: []\n")
    assert main(["validate", str(path)]) == 0
    assert main(["optimize", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "ladder: is empty" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_all_shipped_recipes_validate(capsys):
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err


def test_optimize_tiny_cpu_then_fit_the_optimized_recipe(tmp_path, capsys):
    """The embedded default end to end: >= 4 rungs measured, reports written, optimized.yaml trains."""
    out = tmp_path / "run"
    assert main(["optimize", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["schema_version"] == 1
    rungs = report["rungs"]
    assert [r["name"] for r in rungs] == ["baseline", "tf32", "autocast", "fused_optimizer", "sdpa", "batched", "compile"]
    for r in rungs:
        assert r["status"] in ("baseline", "kept", "reverted", "not_applicable"), (r["name"], r["reason"])
    measured = [r["name"] for r in rungs[1:] if r["measurement"] is not None]
    # every rung that applies is measured; on a CPU with bf16 instructions (this project's machines) all four do
    applicable = [r["name"] for r in rungs[1:] if r["status"] != "not_applicable"]
    assert measured == applicable
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert len(measured) >= 4, rungs
    assert report["environment"]["torch"] and report["flops"]["per_step"] > 0
    md = (out / "report.md").read_text()
    for name in ("baseline", "tf32", "autocast", "fused_optimizer", "sdpa", "batched", "compile"):
        assert name in md

    optimized = yaml.safe_load((out / "optimized.yaml").read_text())
    kept = [r["name"] for r in rungs if r["status"] == "kept"]
    assert [x if isinstance(x, str) else x["name"] for x in optimized["ladder"]] == kept
    optimized["trainer"]["max_steps"] = 3
    optimized["trainer"]["enable_progress_bar"] = False
    fit_recipe = tmp_path / "fit.yaml"
    fit_recipe.write_text(yaml.safe_dump(optimized))
    capsys.readouterr()
    assert main(["fit", str(fit_recipe)]) == 0
    assert "speedkit fit: applied" in capsys.readouterr().out


def test_rungs_lists_every_rung(capsys):
    assert main(["rungs"]) == 0
    out = capsys.readouterr().out
    for name in ("tf32", "autocast", "fused_optimizer", "compile", "sdpa", "batched"):
        assert name in out
