"""The speedkit command: one-line errors with exit code 2, and the whole optimize -> fit path on CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_recipe import BAD_RECIPES

from speedkit.frontend.cli import main

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
    path.write_text(
        "model: {class_path: speedkit.demos.NaiveGPT}\ndata: {synthetic: tokens}\nladder: [tf32]\nmeasure: {steps: -3}\n"
    )
    proc = subprocess.run([sys.executable, "-m", "speedkit", "optimize", str(path)], capture_output=True, text=True, cwd=tmp_path)
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


def test_a_recipe_without_a_ladder_climbs_the_default_one_and_fit_refuses_it(tmp_path, capsys):
    """A user's first recipe often lists no rungs: optimize climbs SpeedLadder()'s default ladder;
    fit, which applies rungs without trials, does not apply untried ones and says what to do."""
    from test_recipe import recipe_text

    from speedkit.config import default_ladder
    from speedkit.frontend.recipe import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_text(ladder=None))
    recipe = load_recipe(path)
    assert not recipe.ladder_given and [r.name for r in recipe.ladder] == [
        n if isinstance(n, str) else n["name"] for n in default_ladder()
    ]
    assert main(["validate", str(path)]) == 0
    assert "rungs of the default ladder, as the recipe lists none" in capsys.readouterr().out
    assert main(["fit", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("speedkit: error:") and "ladder: missing: `speedkit fit` applies" in err
    assert "run `speedkit optimize` on it" in err


def test_all_shipped_recipes_validate(capsys):
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err


def test_a_command_that_succeeded_ends_its_process_group(tmp_path, monkeypatch):
    """Under ``strategy: ddp`` each process runs the command line; it ends the process group its fit
    began, not the interpreter's teardown (where a gloo rank aborted now and then)."""
    import speedkit.distributed

    ended: list[bool] = []
    monkeypatch.setattr(speedkit.distributed, "end_process_group", lambda: ended.append(True))
    assert main(["validate", str(REPO / "recipes" / "tiny-cpu.yaml")]) == 0
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2  # a refusal: nothing began, nothing to end
    assert ended == [True]


def test_optimize_tiny_cpu_then_fit_the_optimized_recipe(tmp_path, capsys):
    """The embedded default end to end: every rung reported, reports written, optimized.yaml trains."""
    out = tmp_path / "run"
    # a budget no loaded CPU spends: every rung is tried and the profile taken (the budget has tests of its own)
    budget = ["--measure.trials_budget_s", "3000", "--measure.trials_min_s", "3000", "--measure.trials_budget_max_s", "3000"]
    assert main(["optimize", "--out", str(out), "--measure.max_blocks", "4", *budget]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["schema_version"] == 4 and report["interrupted"] is None
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-cpu.yaml").read_text())
    rungs = report["rungs"]
    # every rung reported once, after the baseline (in the order the plan tried them, the rungs it did not time first)
    names = [r["name"] for r in rungs if r["status"] not in ("closing", "switches")]
    assert names[0] == "baseline" and sorted(names[1:]) == sorted(
        x if isinstance(x, str) else x["name"] for x in recipe["ladder"]
    )
    for r in rungs:
        assert r["status"] in ("baseline", "kept", "reverted", "not_applicable", "skipped", "closing", "switches"), (
            r["name"],
            r["reason"],
        )
        if r["parity"] is None:  # kept with the switches without a trial of its own: its reason says so
            assert r["status"] in ("kept", "not_applicable", "skipped") and (r["status"] != "kept" or "switches" in r["reason"])
        elif r["status"] in ("kept", "reverted") and r["parity"]["passed"] and not r["reason"].startswith("no effect here"):
            assert r["comparison"]["blocks"] >= 2 and r["measurement"]["step_ms"] > 0
        elif r["status"] == "reverted" and r["parity"]["passed"]:  # inert: nothing it could change ran
            assert r["parity"]["max_rel_diff"] == 0.0 and r["comparison"] is None
    assert report["environment"]["torch"] and report["flops"]["per_step"] > 0
    assert report["run"]["precision"] == "32-true"
    assert report["holds"]["fit"] is not None  # the fit's own steps were timed after the trials
    md = (out / "report.md").read_text()
    assert "In training:" in md and "A B B A" in md
    # where the time goes: a profile window of the baseline, of each kept rung and of the final configuration
    kept_now = [r["name"] for r in rungs if r["status"] == "kept"]
    windows = report["profile"]["windows"]
    assert [w["label"] for w in windows][0] == "baseline" and len(windows) == len(kept_now) + 1
    assert report["profile"]["note"] is None and windows[0]["breakdown_ms"]["gemm"] > 0
    assert (out / windows[0]["trace"]).is_file() and (out / windows[-1]["trace"]).is_file()
    if kept_now:
        assert [a["name"] for a in report["attribution"]["rungs"]] == [w["rungs"][-1] for w in windows[1:]]
    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "Where the time goes" in html

    optimized = yaml.safe_load((out / "optimized.yaml").read_text())
    kept = [r["name"] for r in rungs if r["status"] == "kept"]
    assert [x if isinstance(x, str) else x["name"] for x in optimized["ladder"]] == kept
    capsys.readouterr()
    assert main(["fit", str(out / "optimized.yaml"), "--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false"]) == 0
    printed = capsys.readouterr().out
    assert "speedkit fit: applied" in printed and "speedkit fit: 3 optimizer steps" in printed


INTERRUPTING = """
import os
import signal

from speedkit.demos import NaiveGPT


#: calls of the training step, counted outside the module (the trials put a counter on ``self`` back)
CALLS = [0]


class InterruptingGPT(NaiveGPT):
    \"\"\"A tiny GPT whose training step is interrupted at its ``at``-th call (inside the trials).\"\"\"

    def __init__(self, at: int = 12, how: str = "sigint", **kwargs):
        super().__init__(**kwargs)
        self.at, self.how = at, how
        CALLS[0] = 0

    def training_step(self, batch, batch_idx):
        CALLS[0] += 1
        if CALLS[0] == self.at:
            if self.how == "sigint":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)
"""


@pytest.fixture
def interrupting_recipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("interrupting")
    (folder / "speedkit_test_interrupting.py").write_text(INTERRUPTING)

    def make(how: str) -> Path:
        path = folder / f"{how}.yaml"
        path.write_text(
            "model: {class_path: speedkit_test_interrupting.InterruptingGPT, init_args: {size: tiny, at: 30, how: %s}}\n"
            "data: {synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}\n"
            "trainer: {accelerator: cpu}\n"
            "ladder: [fused_optimizer, {name: compile, options: {backend: eager}}]\n"
            "measure: {warmup: 1, steps: 2, repeats: 2, parity_steps: 2, min_blocks: 2, max_blocks: 2, telemetry: false}\n" % how
        )
        return path

    return make


@pytest.mark.parametrize("how, code, signal_name", [("sigint", 130, "SIGINT"), ("sigterm", 143, "SIGTERM")])
def test_an_interrupted_optimize_writes_a_partial_report_and_exits(interrupting_recipe, tmp_path, capsys, how, code, signal_name):
    import signal as signals

    sigint, sigterm = signals.getsignal(signals.SIGINT), signals.getsignal(signals.SIGTERM)
    out = tmp_path / "out"
    assert main(["optimize", str(interrupting_recipe(how)), "--out", str(out)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0] and signal_name in err[0] and "Traceback" not in err[0]
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] and report["summary"]["interrupted"]
    statuses = [r["status"] for r in report["rungs"]]
    # the rungs finished, then the one cut short (or, where the signal came in the switches' phase, its row)
    assert statuses[0] == "baseline" and (statuses[-1] == "interrupted" or "during the switches" in report["interrupted"]), (
        statuses,
        report["interrupted"],
    )
    assert not (out / "optimized.yaml").exists()  # no recipe from an unfinished ladder
    assert "INTERRUPTED" in (out / "report.md").read_text()
    assert signals.getsignal(signals.SIGINT) == sigint and signals.getsignal(signals.SIGTERM) == sigterm


def test_output_folder_problems_are_one_line_errors_before_any_work(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    for out, words in ((afile, "is a file, not a folder"), (afile / "sub", "is a file, so")):
        assert main(["optimize", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "--out" in err[0]
    import tempfile

    locked = tmp_path / "locked"  # permissions do not stop root: a folder where nothing can be made
    locked.mkdir()
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if str(dir) == str(locked):
            raise PermissionError(13, "Permission denied")
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    assert main(["optimize", "--out", str(locked / "run")]) == 2
    assert "cannot write in" in capsys.readouterr().err
    assert not (locked / "run").exists()
    assert main(["optimize", "--out", ""]) == 2
    assert "--out: is empty" in capsys.readouterr().err


def test_optimize_never_replaces_the_recipe_it_reads_or_files_it_did_not_write(tmp_path, capsys):
    recipe = (REPO / "recipes" / "tiny-cpu.yaml").read_text()
    own = tmp_path / "own"
    own.mkdir()
    (own / "optimized.yaml").write_text(recipe)  # the user optimizes a file called optimized.yaml into its own folder
    assert main(["optimize", str(own / "optimized.yaml"), "--out", str(own)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is the recipe being optimized" in err[0], err
    assert (own / "optimized.yaml").read_text() == recipe and sorted(p.name for p in own.iterdir()) == ["optimized.yaml"]
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("MY NOTES\n")
    assert main(["optimize", "--out", str(notes)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speedkit did not write it" in err[0] and "report.md" in err[0], err
    assert (notes / "report.md").read_text() == "MY NOTES\n"


@pytest.mark.parametrize("command", ["validate", "optimize", "fit"])
@pytest.mark.parametrize(
    "args, words",
    [
        (["--trainer.max_steps=-5"], "`max_steps` must be"),
        (["--trainer.devices", "0"], "devices=0"),
        (["--trainer.gradient_clip_algorithm", "bogus"], "gradient_clip_algorithm"),
    ],
)
def test_trainer_values_lightning_refuses_are_one_line_before_any_work(tmp_path, capsys, command, args, words):
    out = tmp_path / "out"
    code = main(
        [command, str(REPO / "recipes" / "tiny-cpu.yaml"), *args, *(["--out", str(out)] if command == "optimize" else [])]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "trainer: Lightning refuses" in err[0] and words in err[0], err
    assert not out.exists()


def test_validate_notes_what_only_this_machine_lacks(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has the GPU the recipe asks for")
    assert main(["validate", str(REPO / "recipes" / "tiny-cpu.yaml"), "--trainer.accelerator", "gpu"]) == 0
    assert "note: this machine cannot run it" in capsys.readouterr().out
    assert main(["optimize", str(REPO / "recipes" / "tiny-cpu.yaml"), "--trainer.accelerator", "gpu"]) == 2
    assert "trainer: Lightning refuses" in capsys.readouterr().err


USER_CODE = """
import math

import torch
from speedkit.demos import NaiveGPT, SyntheticTokens


class BrokenGPT(NaiveGPT):
    def __init__(self, fail: str = "raise", **kwargs):
        super().__init__(**kwargs)
        self.fail = fail

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.fail == "raise" and batch_idx >= 2:
            raise RuntimeError("boom in the user's step")
        return loss * math.nan if self.fail == "nan" else loss


class NoBatches(SyntheticTokens):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(8)), batch_size=0)


class EmptyDataset(SyntheticTokens):
    def train_dataloader(self):
        return torch.utils.data.DataLoader([], batch_size=4, shuffle=True)


class SmallerThanABatch(SyntheticTokens):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(3)), batch_size=4, drop_last=True)
"""


@pytest.fixture
def user_recipe(tmp_path, monkeypatch):
    (tmp_path / "speedkit_test_user_code.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(fail: str = "raise", data: str = "{synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}") -> Path:
        path = tmp_path / f"{fail}.yaml"
        path.write_text(
            "model: {class_path: speedkit_test_user_code.BrokenGPT, init_args: {size: tiny, fail: %s}}\n"
            "data: %s\ntrainer: {accelerator: cpu, logger: false, enable_checkpointing: false}\nladder: [fused_optimizer]\n"
            "measure: {warmup: 1, steps: 2, repeats: 2, parity_steps: 2, min_blocks: 2, max_blocks: 2}\n" % (fail, data)
        )
        return path

    return make


def test_an_exception_in_the_users_step_shows_their_frames_and_one_line(user_recipe, tmp_path, capsys):
    for command in ("optimize", "fit"):
        assert (
            main([command, str(user_recipe("raise")), *(["--out", str(tmp_path / "out")] if command == "optimize" else [])]) == 1
        )
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"speedkit: error: speedkit {command}: your code raised RuntimeError: boom in the user's step")
        assert "speedkit_test_user_code.py" in last and "BrokenGPT.training_step" in last
        frames = err[err.index("Traceback of your code") :]
        assert "speedkit_test_user_code.py" in frames and "/speedkit/" not in frames and "lightning" not in frames
    assert not (tmp_path / "out").exists()


def test_a_data_module_that_cannot_build_its_loader_is_one_line(user_recipe, tmp_path, capsys):
    path = user_recipe("none", data="{class_path: speedkit_test_user_code.NoBatches}")
    assert main(["optimize", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("speedkit: error:") and "data: NoBatches.train_dataloader() raised ValueError" in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_an_empty_dataset_is_named_with_its_fix(user_recipe, tmp_path, capsys):
    path = user_recipe("none", data="{class_path: speedkit_test_user_code.EmptyDataset}")
    assert main(["optimize", str(path), "--out", str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "data: EmptyDataset.train_dataloader() raised ValueError" in last and "num_samples=0" in last
    assert last.endswith("its dataset is empty (0 samples): check the path, split or filter that builds it"), last


def test_a_loader_without_batches_is_named(user_recipe, tmp_path, capsys):
    path = user_recipe("none", data="{class_path: speedkit_test_user_code.SmallerThanABatch}")
    assert main(["optimize", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "could not run its trials: the train loader yields no batches" in err[-1], err


def test_a_baseline_whose_loss_is_not_finite_runs_no_trials(user_recipe, tmp_path, capsys):
    assert main(["optimize", str(user_recipe("nan")), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "could not run its trials: the training loss is nan at step 1 of the baseline" in err[-1], err


def test_each_message_is_printed_once_and_lightnings_notes_stay_out_of_the_way(user_recipe, tmp_path):
    """As a user sees it, in a terminal: optimize's NaN message once (not again as a Python warning),
    validate silent on stderr for a recipe that leaves Lightning's logger on (the Trainer built to check
    the recipe's arguments would make one; the run says it where it matters)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_recipe("nan").parent), str(REPO)])}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "speedkit", *argv], capture_output=True, text=True, cwd=tmp_path, env=env)

    nan = user_recipe("nan")
    nan.write_text(nan.read_text().replace("logger: false, ", ""))
    proc = run("optimize", str(nan), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.count("the training loss is nan") == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = run("validate", str(nan))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_top_level_keys_are_overrides_too(tmp_path, capsys):
    recipe = REPO / "recipes" / "tiny-cpu.yaml"
    assert main(["validate", str(recipe), "--seed", "3", "--ladder", "[sdpa, compile]"]) == 0
    assert "2 rungs: sdpa, compile" in capsys.readouterr().out


def test_optimize_on_a_model_the_trials_cannot_run_is_one_line(tmp_path, capsys):
    (tmp_path / "speedkit_test_nan.py").write_text(
        "from speedkit.demos import NaiveGPT\n\n\nclass NanGPT(NaiveGPT):\n"
        "    def training_step(self, batch, batch_idx):\n        return super().training_step(batch, batch_idx) * float('nan')\n"
    )
    recipe = tmp_path / "nan.yaml"
    recipe.write_text(
        "model: {class_path: speedkit_test_nan.NanGPT, init_args: {size: tiny}}\n"
        "data: {synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}\ntrainer: {accelerator: cpu}\n"
        "ladder: [fused_optimizer]\nmeasure: {warmup: 1, steps: 2, holds_windows: 1}\n"
    )
    assert main(["optimize", str(recipe), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not run its trials" in err[0] and "nan at step 1 of the baseline" in err[0], err


def test_optimize_runs_the_trials_of_a_manual_optimization_model(tmp_path, capsys):
    (tmp_path / "speedkit_test_manual.py").write_text(
        "from speedkit.demos import NaiveGPT\n\n\nclass ManualGPT(NaiveGPT):\n"
        "    def __init__(self, **kwargs):\n        super().__init__(**kwargs)\n        self.automatic_optimization = False\n\n"
        "    def training_step(self, batch, batch_idx):\n        opt = self.optimizers()\n"
        "        self.manual_backward(self(*batch))\n        opt.step()\n        opt.zero_grad()\n"
    )
    recipe = tmp_path / "manual.yaml"
    recipe.write_text(
        "model: {class_path: speedkit_test_manual.ManualGPT, init_args: {size: tiny}}\n"
        "data: {synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}\ntrainer: {accelerator: cpu}\n"
        "ladder: [fused_optimizer]\nmeasure: {warmup: 1, steps: 2, holds_windows: 1, profile: false}\n"
    )
    assert main(["optimize", str(recipe), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["run"]["optimization"] == "manual"
    assert [r["name"] for r in report["rungs"]][:1] == ["baseline"] and len(report["rungs"]) >= 2


def test_version_and_overrides(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("speedkit ")
    recipe = REPO / "recipes" / "tiny-cpu.yaml"
    assert main(["validate", str(recipe), "--trainer.max_steps", "7", "--measure.steps=3"]) == 0
    for args, words in (
        (["--trainer.max_stepz", "7"], "trainer.max_stepz"),
        (["--measure.steps", "0"], "measure.steps"),
        (["--trainer.max_steps"], "needs a value"),
        (["stray"], "unexpected argument"),
        (["--seed.x", "1"], "not a mapping"),
        (["--measure.steps", "[1"], "cannot read"),
    ):
        assert main(["validate", str(recipe), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


def test_rungs_lists_every_rung(capsys):
    assert main(["rungs"]) == 0
    out = capsys.readouterr().out
    for name in ("tf32", "autocast", "fused_optimizer", "compile", "sdpa", "batched"):
        assert name in out
    # plain text for a terminal: no reST markup, no name said twice
    assert "``" not in out and not re.search(r":[a-z]+:`", out), out
    assert "compile            torch.compile what the training step runs" in out
    assert not any(line.split()[1].rstrip(":") == line.split()[0] for line in out.splitlines() if len(line.split()) > 1)


@pytest.mark.parametrize(
    "model_args, data, words",
    [
        (
            "block_size: 8",
            "{synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}",
            "model: NaiveGPT.forward raised IndexError",
        ),
        (
            "vocab_size: 16",
            "{synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}",
            "model: NaiveGPT.forward raised IndexError",
        ),
        (
            "block_size: 16",
            "{synthetic: tokens, batch_size: 2, seq_len: 16, length: 64, num_workers: -1}",
            "data: SyntheticTokens.train_dataloader() raised ValueError: num_workers",
        ),
    ],
)
@pytest.mark.parametrize("command", ["optimize", "fit"])
def test_a_demo_model_and_data_that_do_not_fit_together_are_one_line(tmp_path, capsys, command, model_args, data, words):
    """speedkit's demo models stand in for the user's: failing on the recipe's arguments is bad input (exit 2), not a traceback."""
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model: {class_path: speedkit.demos.NaiveGPT, init_args: {size: tiny, %s}}\ndata: %s\n"
        "trainer: {accelerator: cpu, max_steps: 2, logger: false, enable_checkpointing: false}\nladder: [fused_optimizer]\n"
        "measure: {warmup: 1, steps: 2, repeats: 2, parity_steps: 2, min_blocks: 2, max_blocks: 2}\n" % (model_args, data)
    )
    out = tmp_path / "out"
    assert main([command, str(path), *(["--out", str(out)] if command == "optimize" else [])]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("speedkit: error:") and words in last, last
    assert not out.exists()


@pytest.mark.parametrize("command", ["validate", "optimize", "fit"])
def test_synthetic_data_a_model_cannot_take_is_one_line_before_any_work(tmp_path, capsys, command):
    """vectors for a language model passed validate and failed once optimize ran; now every command
    says so in one line, exit 2, before any work (one forward on one synthetic sample, on the CPU)."""
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model: {class_path: speedkit.demos.NaiveGPT, init_args: {size: tiny}}\ndata: {synthetic: vectors}\n"
        "trainer: {accelerator: cpu, max_steps: 2}\nladder: [fused_optimizer]\n"
    )
    out = tmp_path / "out"
    assert main([command, str(path), *(["--out", str(out)] if command == "optimize" else [])]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speedkit: error:") and "Traceback" not in captured.err, err
    assert "NaiveGPT.forward raised RuntimeError" in err[0] and "synthetic: tokens for a language model" in err[0]
    assert not out.exists() and not (tmp_path / "lightning_logs").exists()


@pytest.mark.parametrize("command", ["validate", "fit"])
def test_a_speedladder_callback_told_to_apply_nothing_unmeasured_is_one_line(tmp_path, capsys, command):
    """SpeedLadder(trials=False) without rungs would apply the whole default ladder unmeasured."""
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model: {class_path: speedkit.demos.NaiveGPT, init_args: {size: tiny}}\n"
        "data: {synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}\n"
        "trainer: {accelerator: cpu, max_steps: 2, logger: false,\n"
        "          callbacks: [{class_path: speedkit.lightning.SpeedLadder, init_args: {trials: false}}]}\nladder: []\n"
    )
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.callbacks[0].init_args" in err[0] and "trials: False applies the rungs given" in err[0], err
    assert "Lightning refuses" not in err[0]


USERS_TOKEN_MODELS = """
import torch
import lightning.pytorch as pl


class TokenModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(512, 16), torch.nn.Linear(16, 512)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, -2), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


class ReadsItsTrainer(TokenModel):
    def training_step(self, batch, batch_idx):
        self.log("progress", self.trainer.global_step / max(1, self.trainer.estimated_stepping_batches))
        return super().training_step(batch, batch_idx)
"""


def test_the_data_check_refuses_what_torch_refuses_and_leaves_other_failures_to_the_run(tmp_path, capsys, monkeypatch):
    """A user's token model given synthetic vectors: torch's embedding refuses them, one line. A step
    that reads its Trainer cannot run outside one: that is not the data's fault, validate passes."""
    (tmp_path / "speedkit_test_tokens.py").write_text(USERS_TOKEN_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "recipe.yaml"
    for model, data, code in (("TokenModel", "vectors", 2), ("TokenModel", "tokens", 0), ("ReadsItsTrainer", "tokens", 0)):
        path.write_text(
            f"model: {{class_path: speedkit_test_tokens.{model}}}\n"
            f"data: {{synthetic: {data}, batch_size: 2, seq_len: 8, vocab_size: 512}}\n"
            "trainer: {accelerator: cpu, logger: false}\nladder: [fused_optimizer]\n".replace(
                ", seq_len: 8, vocab_size: 512" if data == "vectors" else "@", ""
            )
        )
        assert main(["validate", str(path)]) == code, (model, data)
        err = capsys.readouterr().err.strip().splitlines()
        if code:
            assert len(err) == 1 and "data.synthetic: TokenModel.training_step cannot take vectors batches" in err[0], err
            assert "give the data your model takes: tokens or a data module of your own" in err[0]
        else:
            assert err == [], err


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "no command given; give one of optimize, fit, validate, rungs"),
        (["fit"], "fit: the following arguments are required: recipe"),
        (["optimize", "--out"], "optimize: argument --out: expected one argument"),
        (["optimise"], "invalid choice: 'optimise'"),
    ],
)
def test_argument_errors_are_one_line_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("speedkit: error: ") and words in err[0], err


def test_optimize_says_it_replaces_its_own_earlier_output(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{\n  "schema_version": 2}\n')  # speedkit's own earlier report
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "model: {class_path: speedkit.demos.NaiveGPT, init_args: {size: tiny}}\n"
        "data: {synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}\ntrainer: {accelerator: cpu}\n"
        "ladder: [fused_optimizer]\nreport: {formats: [json]}\n"
        "measure: {warmup: 1, steps: 2, repeats: 2, parity_steps: 2, min_blocks: 2, max_blocks: 2, holds_windows: 1}\n"
    )
    assert main(["optimize", str(path), "--out", str(out)]) == 0
    assert "(replacing the earlier report.json there)" in capsys.readouterr().out


def test_cache_list_and_clear_the_kept_decisions(tmp_path, capsys):
    from speedkit.engine.cache import CachedDecision, DecisionCache

    cache = DecisionCache(tmp_path)
    cache.store(CachedDecision(key="abc123", kept=["tf32", "compile"], speedup=1.5))
    assert main(["cache", "list", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 decision(s)" in out and "kept: tf32, compile (1.50x the baseline)" in out
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "forgot 1 decision(s)" in capsys.readouterr().out and cache.entries() == []
