"""Every code block of README.md runs as a new user would run it, on tiny data: a README that
drifts from the code fails here.

The blocks are read from README.md itself (never copied into this file). What the harness adds,
and only that:

* **Python blocks** run in a fresh interpreter. The names a block uses without defining them are the
  user's own objects (``model``, ``datamodule``, ``optimizer``, ``loader``, ``scheduler``); the
  harness defines those, tiny, in front of the block (:data:`USERS_OBJECTS`). A block that uses a
  name the harness does not know fails: the README asks the reader for something it never named.
* **Shell blocks** run line by line (comments stripped) with the test's virtual environment first on
  ``PATH``, so ``pip`` and ``speedkit`` are the ones installed (``python -m speedkit`` where the
  checkout runs uninstalled). Small: ``speedkit optimize|fit`` get :data:`CPU_SIZE` appended
  (LightningCLI-style overrides: a tiny model, short sequences, few timing blocks; on the CPU where
  there is no GPU), and ``--trainer.max_steps`` is cut to a few steps;
  ``make test`` runs the README's command with ``PYTEST_ADDOPTS`` naming one small test (the whole
  suite is what is running this). ``make`` uses this environment's venv (``VENV=``), as it does
  after the README's own ``make test``. Commands other than ``pip install -e .`` run in a scratch
  folder where ``recipes/`` is the repository's, so ``runs/`` lands there.
* **YAML blocks** are recipes: written to a file, ``speedkit validate`` accepts them and a CPU-sized
  ``speedkit optimize`` runs them.

Every command must exit 0 within its time limit.
"""

from __future__ import annotations

import builtins
import functools
import os
import re
import shlex
import subprocess
import symtable
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: seconds one block (or one shell command) may take before it counts as never finishing
LIMIT_S = 900

#: the user's own objects a README block may name without defining, made tiny
USERS_OBJECTS = {
    "model": """
        import torch
        import lightning.pytorch as pl

        class _TinyClassifier(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))

            def forward(self, x):
                return self.net(x)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = torch.nn.functional.cross_entropy(self(x), y)
                self.log("loss", loss)
                return loss

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        torch.manual_seed(0)
        model = _TinyClassifier()
    """,
    "datamodule": """
        import torch
        import lightning.pytorch as pl

        class _TinyData(pl.LightningDataModule):
            def train_dataloader(self):
                g = torch.Generator().manual_seed(1)
                data = torch.utils.data.TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g))
                return torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)

        datamodule = _TinyData()
    """,
    "optimizer": "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)",
    "loader": """
        _g = torch.Generator().manual_seed(1)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(128, 32, generator=_g), torch.randint(0, 10, (128,), generator=_g)),
            batch_size=16, shuffle=True)
    """,
    "scheduler": "scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.9)",
}
#: what each of them is made from (defined before it)
_NEEDS = {"optimizer": ["model"], "scheduler": ["optimizer"], "loader": ["model"], "datamodule": ["model"]}

#: overrides that make a recipe small (appended after the README's own arguments: the last wins); on a
#: machine without CUDA also ``--trainer.accelerator cpu --trainer.precision 32-true``
CPU_SIZE = [
    "--model.init_args.size",
    "tiny",
    "--data.batch_size",
    "2",
    "--data.seq_len",
    "32",
    "--data.vocab_size",
    "512",
    "--data.length",
    "256",
    "--measure.warmup",
    "1",
    "--measure.steps",
    "3",
    "--measure.repeats",
    "2",
    "--measure.parity_steps",
    "2",
    "--measure.min_blocks",
    "2",
    "--measure.max_blocks",
    "2",
    "--measure.holds_windows",
    "1",
]
#: steps a ``speedkit fit`` from the README trains here
FIT_STEPS = "3"
#: the test run by the README's ``make test`` here (the whole suite is what runs this file)
NESTED_TESTS = "tests/test_api.py -k batches_end_with_the_epoch"


@dataclass
class Block:
    lang: str
    code: str
    line: int

    @property
    def id(self) -> str:
        return f"{self.lang}@README.md:{self.line}"


def readme_blocks() -> list[Block]:
    blocks, lang, start, lines = [], None, 0, []
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence and lang is None:
            lang, start, lines = fence.group(1) or "text", number, []
        elif fence and line.strip() == "```":
            blocks.append(Block(lang, "\n".join(lines) + "\n", start))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, f"README.md: the code block opened at line {start} is never closed"
    return blocks


BLOCKS = readme_blocks()


def test_every_block_is_of_a_kind_this_test_runs():
    assert BLOCKS, "README.md has no code blocks"
    unknown = [b.id for b in BLOCKS if b.lang not in ("python", "bash", "yaml")]
    assert not unknown, f"README blocks this test cannot run (tag them python, bash or yaml): {unknown}"


def _free_names(code: str) -> list[str]:
    """Names ``code`` reads as globals but never binds at its top level (scopes as Python sees them)."""
    top = symtable.symtable(code, "README block", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    free: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for sym in table.get_symbols():
            if (sym.is_referenced() and (table is top or sym.is_global())) and sym.get_name() not in bound:
                free.add(sym.get_name())
    return sorted(n for n in free if not hasattr(builtins, n))


def _prelude(names: list[str]) -> str:
    """The user's objects ``names`` (and what they are made from), defined tiny, in a fixed order."""
    unknown = [n for n in names if n not in USERS_OBJECTS]
    assert not unknown, (
        f"the block uses {unknown} without defining them, and they are not the user's objects this "
        f"test provides ({sorted(USERS_OBJECTS)})"
    )
    needed = set(names)
    while True:
        more = {need for n in needed for need in _NEEDS.get(n, [])} - needed
        if not more:
            break
        needed |= more
    return "".join(textwrap.dedent(code).strip() + "\n" for name, code in USERS_OBJECTS.items() if name in needed)


#: the trials' time budget the README's commands get here (``measure.trials_budget_s`` and
#: ``trials_min_s``): the default, 120 s, is sized for a GPU fit; on CI's CPU each block's tiny model
#: goes through the same phases in a shorter budget (five blocks at 120 s each made the suite 26 min)
CI_TRIALS_S = 20.0


@functools.cache
def _ci_config_dir() -> Path:
    """The shipped configs with the trials' budget at :data:`CI_TRIALS_S` (``$SPEEDKIT_CONFIG_DIR``),
    written once per test process."""
    import tempfile

    import yaml

    folder = Path(tempfile.mkdtemp(prefix="speedkit-readme-configs-"))
    for path in (REPO / "configs").glob("*.yaml"):
        (folder / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    defaults = yaml.safe_load((folder / "defaults.yaml").read_text(encoding="utf-8"))
    defaults["measure"].update(trials_budget_s=CI_TRIALS_S, trials_min_s=CI_TRIALS_S)
    (folder / "defaults.yaml").write_text(yaml.safe_dump(defaults, sort_keys=False), encoding="utf-8")
    return folder


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "SPEEDKIT_CONFIG_DIR": str(_ci_config_dir()),
    }


def _run(argv: list[str] | str, cwd: Path, what: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=env or _env(),
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
            shell=isinstance(argv, str),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {LIMIT_S} s")
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs(block: Block, workdir: Path) -> None:
    script = workdir / "block.py"
    script.write_text(_prelude(_free_names(block.code)) + "\n# --- README.md block ---\n" + block.code, encoding="utf-8")
    _run([sys.executable, str(script)], workdir, f"the python block at README.md:{block.line}")


def _speedkit_cpu_sized(args: list[str]) -> list[str]:
    """A ``speedkit optimize|fit|validate`` command as run here: CPU-sized where there is no GPU."""
    import torch

    if args[1] not in ("optimize", "fit"):
        return args
    on_cpu = [] if torch.cuda.is_available() else ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true"]
    return [*args, *CPU_SIZE, *on_cpu, *(["--trainer.max_steps", FIT_STEPS] if args[1] == "fit" else [])]


def _speedkit_command() -> list[str]:
    """``speedkit`` as installed (the console script), or the module where the checkout runs uninstalled."""
    script = Path(sys.executable).parent / "speedkit"
    return [str(script)] if script.exists() else [sys.executable, "-m", "speedkit"]


def _make_venv() -> Path:
    """The venv make's targets install into: this interpreter's, when ``make`` made it."""
    prefix = Path(sys.prefix)
    if prefix == Path(sys.base_prefix) or not any((prefix / f".{t}-installed").exists() for t in ("test", "demo")):
        pytest.skip("runs `make` only from a venv that `make` made (as CI's `make test` does); this is not one")
    return prefix


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "bash"], ids=lambda b: b.id)
def test_shell_block_runs(block: Block, workdir: Path) -> None:
    commands = [line.split(" #", 1)[0].strip() for line in block.code.splitlines()]
    commands = [c for c in commands if c and not c.startswith("#")]
    assert commands, f"the shell block at README.md:{block.line} has no command"
    for command in commands:
        args = shlex.split(command)
        what = f"`{command}` (README.md:{block.line})"
        env = _env()
        cwd = workdir
        if args[0] == "make":
            env["VENV"] = str(_make_venv())
            if args[1:] == ["test"]:
                env["PYTEST_ADDOPTS"] = NESTED_TESTS
            args = [*args, f"VENV={env['VENV']}"]
            cwd = REPO
        elif args[:3] == ["pip", "install", "-e"]:
            cwd = REPO  # "." is the checkout
            args = [sys.executable, "-m", *args]
        elif args[0] == "speedkit":
            args = [*_speedkit_command(), *_speedkit_cpu_sized(args)[1:]]
        proc = _run(args, cwd, what, env)
        if command.startswith("make demo"):
            assert (REPO / "runs" / "tiny-cpu" / "report.json").exists() and "baseline" in proc.stdout
        if command.startswith("speedkit optimize"):
            assert "report.json" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "yaml"], ids=lambda b: b.id)
def test_yaml_block_is_a_recipe_that_runs(block: Block, workdir: Path) -> None:
    recipe = workdir / "recipe.yaml"
    recipe.write_text(block.code, encoding="utf-8")
    speedkit = _speedkit_command()
    _run([*speedkit, "validate", str(recipe)], workdir, f"`speedkit validate` of the recipe at README.md:{block.line}")
    optimize = _speedkit_cpu_sized(["speedkit", "optimize", str(recipe), "--out", str(workdir / "out")])
    proc = _run([*speedkit, *optimize[1:]], workdir, f"`speedkit optimize` of the recipe at README.md:{block.line}")
    assert (workdir / "out" / "report.json").exists(), proc.stdout
