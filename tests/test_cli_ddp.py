"""``speedkit optimize`` and ``speedkit fit`` on a recipe whose Trainer runs two processes (CPU, gloo,
``strategy: ddp``): Lightning's launcher starts the command line again in the second process; global
rank 0 alone checks --out, prints and writes; every rank exits 0. Each run is a subprocess under a
timeout (a hang fails the test). A recipe speedkit cannot run under several processes is refused in
one line before any process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from speedkit.frontend.cli import main
from speedkit.frontend.runner import rank_label

REPO = Path(__file__).resolve().parents[1]

#: tiny-cpu.yaml's model at its smallest, on 2 CPU processes; one rung, the shortest measurement
TINY_DDP = {
    "model": {"class_path": "speedkit.demos.NaiveGPT", "init_args": {"size": "tiny", "block_size": 32}},
    "data": {"synthetic": "tokens", "batch_size": 2, "seq_len": 32, "vocab_size": 64, "length": 4096},
    "trainer": {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp",
        "max_steps": 30,
        "logger": False,
        "enable_checkpointing": False,
    },
    "ladder": ["fused_optimizer"],
    "measure": {
        "warmup": 1,
        "steps": 2,
        "repeats": 2,
        "parity_steps": 1,
        "min_blocks": 2,
        "max_blocks": 2,
        "final_check": False,
        "together_passes": 0,
        "switches_floor": False,
        "holds_windows": 1,
        "profile": False,
        "telemetry": False,
    },
    "seed": 0,
}


def _recipe(tmp_path: Path, **changes) -> Path:
    raw = json.loads(json.dumps(TINY_DDP))
    for key, value in changes.items():
        section, _, name = key.partition("__")
        raw[section][name] = value
    path = tmp_path / "tiny-ddp.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _speedkit(command: list[str], cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """A command run as a user runs it, from ``cwd``; no rank variables inherited (this is rank 0)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


def _console_script(tmp_path: Path) -> list[str]:
    """The ``speedkit`` console script as pip writes it: run as a file (no ``__spec__``), which is how
    Lightning's launcher starts it again in the other processes."""
    script = tmp_path / "speedkit"
    script.write_text("import sys\nfrom speedkit.frontend.cli import main\n\nif __name__ == '__main__':\n    sys.exit(main())\n")
    return [sys.executable, str(script)]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("speedkit: error")]


def test_rank_label_reads_the_launchers_environment():
    assert rank_label({}) is None
    assert rank_label({"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "2"}) is None  # Lightning's rank 0
    assert rank_label({"LOCAL_RANK": "1", "NODE_RANK": "0"}) == "local rank 1"
    assert rank_label({"LOCAL_RANK": "0", "NODE_RANK": "1"}) == "node 1, local rank 0"  # another node's first process
    assert rank_label({"RANK": "3", "LOCAL_RANK": "1"}) == "rank 3"  # torchrun
    assert rank_label({"SLURM_PROCID": "2"}) == "rank 2"
    assert rank_label({"LOCAL_RANK": "x"}) is None


@pytest.mark.parametrize(
    ("strategy", "devices", "expected"),
    [
        ("ddp_spawn", 2, "ddp_spawn starts its processes from this one"),
        ("ddp_fork", 1, "ddp_fork starts its processes from this one"),
        (
            {"class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {"start_method": "spawn"}},
            2,
            "DDPStrategy starts its processes from this one",
        ),
        ("fsdp", 2, "speedkit runs several processes under DDP only, and this Trainer asks for 2 under fsdp"),
        ("single_device", "0,1", "this Trainer asks for 2 under single_device"),
    ],
)
def test_a_strategy_speedkit_cannot_run_is_refused_in_one_line_before_any_process(tmp_path, capsys, strategy, devices, expected):
    # in this process: a recipe that passed would make Lightning start pytest's command line again
    recipe = _recipe(tmp_path, trainer__strategy=strategy, trainer__devices=devices)
    for command in (["validate"], ["optimize", "--out", str(tmp_path / "out")], ["fit"], ["sweep"]):
        assert main([command[0], str(recipe), *command[1:]]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("speedkit: error:") and "trainer.strategy: " in err and expected in err
        assert "use strategy: ddp" in err
    assert not (tmp_path / "out").exists()


def test_ddp_and_its_find_unused_parameters_variants_are_accepted(tmp_path, capsys):
    for strategy in ("ddp", "ddp_find_unused_parameters_true", "auto"):
        assert main(["validate", str(_recipe(tmp_path, trainer__strategy=strategy))]) == 0, capsys.readouterr().err
    assert main(["validate", str(_recipe(tmp_path, trainer__devices=3))]) == 0


def test_sweep_refuses_several_processes_in_one_line(tmp_path, capsys):
    assert main(["sweep", str(_recipe(tmp_path)), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "speedkit sweep times each size in one process, and this Trainer runs 2" in err


def test_optimize_refuses_a_bad_out_before_launching(tmp_path):
    # a subprocess: were the check late, Lightning would start this command line again, not pytest's
    (tmp_path / "taken").write_text("mine")
    run = _speedkit(
        [sys.executable, "-m", "speedkit", "optimize", str(_recipe(tmp_path)), "--out", "taken"], cwd=tmp_path, timeout_s=60
    )
    assert run.returncode == 2
    assert _errors(run.stderr) == [run.stderr.strip()] and "--out:" in run.stderr and "is a file, not a folder" in run.stderr
    assert "MEMBER" not in run.stderr and run.stdout == ""  # no process was started, nothing printed


def test_fit_under_ddp_through_the_console_script_prints_once(tmp_path):
    """``speedkit fit`` as the console script (a file Lightning runs again, not ``-m``): both ranks
    train, rank 0 alone prints, every rank exits 0 (a rank that failed would fail the launcher's)."""
    recipe = _recipe(tmp_path, trainer__max_steps=4)
    run = _speedkit([*_console_script(tmp_path), "fit", str(recipe)], cwd=tmp_path, timeout_s=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("speedkit fit: applied fused_optimizer") == 1, run.stdout
    assert run.stdout.count("speedkit fit: 4 optimizer steps") == 1, run.stdout
    assert "MEMBER: 2/2" in run.stderr  # two processes did run: Lightning's line from the second
    assert not _errors(run.stderr)


def test_optimize_under_ddp_then_fit_its_optimized_recipe(tmp_path):
    """``python -m speedkit optimize`` on the 2-process recipe, then ``fit`` on the optimized.yaml it
    wrote: one report and one optimized.yaml, the table and the file lines printed once, rc 0."""
    recipe = _recipe(tmp_path)
    out = tmp_path / "run"
    run = _speedkit([sys.executable, "-m", "speedkit", "optimize", str(recipe), "--out", str(out)], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not _errors(run.stderr)
    assert run.stdout.count("speedkit optimize ") == 1  # the header
    assert run.stdout.count("json: ") == 1 and run.stdout.count("optimized: ") == 1
    assert run.stdout.count("Summary:") == 1  # the table's summary line
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("report.json")) == ["run/report.json"]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("optimized.yaml")) == ["run/optimized.yaml"]
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] is None

    fit = _speedkit(
        [sys.executable, "-m", "speedkit", "fit", str(out / "optimized.yaml"), "--trainer.max_steps", "4"], cwd=tmp_path
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert fit.stdout.count("speedkit fit: applied") == 1 and not _errors(fit.stderr)
    # the one report holds both ranks' figures, and the scaling the trials measured
    base = report["rungs"][0]["measurement"]
    assert [r["rank"] for r in base["ranks"]] == [0, 1]
    assert all(r["step_ms"] > 0 and r["data_wait_ms"] >= 0 for r in base["ranks"])
    assert report["run"]["world_size"] == 2 and report["run"]["scaling"]["world_size"] == 2
    assert "## Across ranks" in (out / "report.md").read_text()

    # the same recipe again: both ranks re-check the decision the first optimize kept (rank 0 reads the
    # cache, broadcasts it; parity and the final check are collectives) and finish, whatever it finds
    assert "cache: decision kept in" in run.stdout
    again = _speedkit([sys.executable, "-m", "speedkit", "optimize", str(recipe), "--out", str(tmp_path / "again")], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "cache: re-checking the decision of an earlier fit" in again.stdout, again.stdout[-3000:]
    assert ("cache: the decision holds" in again.stdout) != ("cache: the decision did not hold" in again.stdout)
    assert json.loads((tmp_path / "again" / "report.json").read_text())["run"]["cache"]["hit"] is True
