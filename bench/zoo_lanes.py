"""The zoo on a host of several GPUs: ``bench/zoo.py`` once per model, one model per GPU at a time.

One lane per GPU (``CUDA_VISIBLE_DEVICES`` set to that GPU alone) and an equal share of the host's
cores (the process's CPU affinity split into contiguous blocks, so that a lane's loader workers and
compile workers stay off its neighbours' cores: on an 8-core-per-GPU share that is the one-GPU
machine's 16 cores for a 4-GPU host of 64). Each lane, when free, takes the longest model still
waiting that it can finish in the call's time left (each model's expected wall time on the H200,
trials and fits, from the last runs there; hf-t5's
695 s at c5f4f53 ended with its fit cut short after trials of 590 s: 780 s with the fit's own guard); a model that fits no lane is reported ``NOT RUN``. Each
model is still one process, so its variants (fp32, switches, speedkit) share one GPU, one process
and one host share, as on a one-GPU machine.

Every row carries ``lane`` ("GPU 2 of 4, cores 32-47, 4 lanes"): the other lanes ran beside it on
the same host (memory bandwidth, PCIe and the page cache shared), which a one-GPU machine does not do.

Output (under ``--out``, default ``$OUT``): ``<date>_<gpu>.jsonl`` (every lane's rows, in order of
completion), ``zoo_lanes.tgz`` (each model's log and speedkit report) and ``zoo_lanes.txt`` (the
table printed last).

Other work may share the lanes (``--job NAME:SECONDS:COMMAND``, repeatable: GPU tests, a profile): a
job is a shell command, run with its lane's GPU and cores and ``$OUT`` set to ``<pack>/NAME``, picked
by the same rule as the models. It runs beside the models on the same host, as they run beside each
other.

A run longer than one device call (hf-t5 alone takes about 780 s): start it with ``--detach`` (it
runs in a session of its own, which outlives the call until the machine goes back), then, in the
next call within the machine's idle time, ``--collect SECONDS`` waits for it and packs its folder.

Usage: PYTHONPATH=. python bench/zoo_lanes.py --commit C [--budget-s 590] [--gpus 0,1] [model ...]
       PYTHONPATH=. python bench/zoo_lanes.py --commit C --budget-s 900 --gpus 3 --out /tmp/t5 --detach hf-t5
       PYTHONPATH=. python bench/zoo_lanes.py --out /tmp/t5 --collect 300
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: a model's whole process on the H200 (trials and the three fits, seconds), from its last runs there;
#: one not listed is given DEFAULT_EXPECTED_S
#: (the three variants' wall times at c5f4f53 on an nvidia-h200-x4 lane, and 20 s to start the process)
EXPECTED_S = {
    "lstm-lm": 75,
    "lightning-transformer": 225,
    "timm-vit": 145,
    "timm-convnext": 235,
    "hf-bert-mlm": 320,
    "hf-gpt2": 310,
    "hf-llama": 410,
    "nanogpt": 275,
    "tv-resnet50": 270,
    "hf-t5": 780,
    "timm-mobilenetv3": 310,
    "hf-bert-cls": 510,
}
DEFAULT_EXPECTED_S = 300


@dataclass
class Lane:
    gpu: int
    cores: list[int]
    label: str
    proc: subprocess.Popen | None = None
    model: str | None = None
    started: float = 0.0
    done: list[tuple[str, int, float]] = field(default_factory=list)


def core_blocks(cores: list[int], n: int) -> list[list[int]]:
    """``cores`` split into ``n`` contiguous blocks of equal size (the remainder left unused)."""
    size = max(1, len(cores) // n)
    return [cores[i * size : (i + 1) * size] or cores for i in range(n)]


def span(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))


def pick(waiting: list[str], time_left: float, expected: dict[str, float] = EXPECTED_S) -> str | None:
    """The longest waiting model (or job) expected to finish in ``time_left``."""
    fits = [m for m in waiting if expected.get(m, DEFAULT_EXPECTED_S) <= time_left]
    return max(fits, key=lambda m: expected.get(m, DEFAULT_EXPECTED_S)) if fits else None


def parse_job(spec: str) -> tuple[str, float, str]:
    """``NAME:SECONDS:COMMAND`` -> (name, expected seconds, shell command)."""
    name, _, rest = spec.partition(":")
    seconds, _, command = rest.partition(":")
    try:
        expected = float(seconds)
    except ValueError:
        expected = -1.0
    if not name.replace("-", "").replace("_", "").isalnum() or expected <= 0 or not command.strip():
        raise SystemExit(
            f"--job {spec!r}: expected NAME:SECONDS:COMMAND (a name of letters, digits, - and _; "
            "the expected wall seconds; a shell command)"
        )
    return name, expected, command


def main() -> None:
    import torch

    from bench.common import gpu_slug
    from speedkit.demos.zoo import ZOO

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=None, help="zoo models (default: all, or none where --job is given)")
    parser.add_argument("--commit", default=None, help="the commit measured (the device's tree has no history)")
    parser.add_argument("--budget-s", type=float, default=590.0, help="wall seconds for the whole call")
    parser.add_argument(
        "--gpus",
        default=None,
        help="the GPUs used, one lane each, comma-separated (default: all); the host's cores are split "
        "among all the host's GPUs, so that two launchers on one host keep apart",
    )
    parser.add_argument("--tiny", action="store_true", help="zoo.py --tiny on the CPU: a smoke test of the lanes")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for rows, logs and reports")
    parser.add_argument(
        "--detach",
        action="store_true",
        help="start the run in a session of its own and return at once (it outlives the device "
        "call, up to the machine's return); --out must be a folder that stays, e.g. /tmp/zoo; "
        "it writes <out>/done at the end",
    )
    parser.add_argument(
        "--job",
        action="append",
        default=[],
        metavar="NAME:SECONDS:COMMAND",
        help="another job for the lanes beside the models (repeatable): a shell command run in the "
        "repository with the lane's GPU and cores, $OUT set to <out's pack>/NAME, its log NAME.log; "
        "SECONDS is its expected wall time, for the lanes' choice",
    )
    parser.add_argument(
        "--collect",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wait up to SECONDS for a detached run's <out>/done, then pack <out> into $OUT/zoo_run.tgz",
    )
    args = parser.parse_args()
    if args.collect is not None:
        collect(Path(args.out), args.collect)
        return
    if args.commit is None:
        raise SystemExit("--commit is needed to run models (the device's tree has no history)")
    if args.detach:
        detach(__file__, args.out, sys.argv[1:], REPO)
        return
    if args.models is None:
        args.models = [] if args.job else list(ZOO)
    unknown = [m for m in args.models if m not in ZOO]
    count = torch.cuda.device_count() or (2 if args.tiny else 0)  # --tiny: CPU lanes, for the smoke test
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(count))
    if unknown or not gpus or any(not 0 <= g < count for g in gpus):
        raise SystemExit(f"unknown model(s) {unknown} or --gpus {args.gpus} outside 0..{count - 1} (GPUs seen)")
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zoo-lanes-"))
    blocks = core_blocks(sorted(os.sched_getaffinity(0)), count)
    lanes = [Lane(g, blocks[g], f"GPU {g} of {count}, cores {span(blocks[g])}, {len(gpus)} lanes") for g in gpus]
    jobs = {name: (expected, command) for name, expected, command in map(parse_job, args.job)}
    expected = {**EXPECTED_S, **{name: e for name, (e, _) in jobs.items()}}
    waiting = list(args.models) + list(jobs)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPEEDKIT_COMMIT": args.commit, "PYTHONUNBUFFERED": "1"}

    def launch(lane: Lane, model: str) -> None:
        left = args.budget_s - (time.monotonic() - start)
        log = open(work / f"{model}.log", "w")
        if model in jobs:
            (work / model).mkdir(exist_ok=True)
            lane.proc = subprocess.Popen(
                ["timeout", str(int(left - 3)), "bash", "-c", jobs[model][1]],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**env, "CUDA_VISIBLE_DEVICES": str(lane.gpu), "OUT": str(work / model)},
                preexec_fn=lambda cores=lane.cores: os.sched_setaffinity(0, cores),
            )
            lane.model, lane.started = model, time.monotonic()
            print(
                f"[{time.monotonic() - start:5.0f} s] {lane.label}: job {model} (expected {jobs[model][0]:.0f} s, "
                f"{left:.0f} s left)",
                flush=True,
            )
            return
        cmd = [
            "timeout",
            str(int(left - 3)),
            sys.executable,
            str(REPO / "bench/zoo.py"),
            "--models",
            model,
            "--time-guard-s",
            "180",
            "--results",
            str(work / f"rows_{model}.jsonl"),
            "--lane",
            lane.label,
            *(["--tiny"] if args.tiny else []),
        ]
        lane.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**env, "CUDA_VISIBLE_DEVICES": str(lane.gpu)},
            preexec_fn=lambda cores=lane.cores: os.sched_setaffinity(0, cores),
        )
        lane.model, lane.started = model, time.monotonic()
        print(
            f"[{time.monotonic() - start:5.0f} s] {lane.label}: {model} (expected "
            f"{EXPECTED_S.get(model, DEFAULT_EXPECTED_S)} s, {left:.0f} s left)",
            flush=True,
        )

    while True:
        for lane in lanes:
            if lane.proc is not None and lane.proc.poll() is not None:
                lane.done.append((lane.model, lane.proc.returncode, time.monotonic() - lane.started))
                print(
                    f"[{time.monotonic() - start:5.0f} s] {lane.label}: {lane.model} rc {lane.proc.returncode} "
                    f"after {lane.done[-1][2]:.0f} s",
                    flush=True,
                )
                lane.proc = lane.model = None
            if lane.proc is None and waiting:
                model = pick(waiting, args.budget_s - (time.monotonic() - start), expected)
                if model is not None:
                    waiting.remove(model)
                    launch(lane, model)
        if all(lane.proc is None for lane in lanes):
            break
        time.sleep(1.0)
    not_run = waiting  # fitted no lane's time left
    rows = out / f"{datetime.date.today().isoformat()}_{gpu_slug()}.jsonl"
    with open(rows, "a") as f:
        for lane in lanes:
            for model, _, _ in lane.done:
                part = work / f"rows_{model}.jsonl"
                if part.exists():
                    f.write(part.read_text())
    with tarfile.open(out / "zoo_lanes.tgz", "w:gz") as tar:
        for path in sorted(work.iterdir()):
            if not path.name.startswith("rows_"):
                tar.add(path, arcname=path.name)
    lines = [f"{lane.label}: " + ", ".join(f"{m} rc {rc} {s:.0f} s" for m, rc, s in lane.done) for lane in lanes]
    lines += [f"NOT RUN {m} (expected {expected.get(m, DEFAULT_EXPECTED_S):.0f} s)" for m in not_run]
    for path in sorted(work.glob("*.log")):
        lines += [
            line for line in path.read_text().splitlines() if "/ switches =" in line or " FAILED" in line or "Traceback" in line
        ]
    (out / "zoo_lanes.txt").write_text("\n".join(lines) + "\n")
    (out / "done").write_text(f"{time.monotonic() - start:.0f} s\n")
    print("\n".join(lines))


def detach(script: str, out: str | Path, argv: list[str], cwd: Path) -> None:
    """Start ``script`` again with ``argv`` less ``--detach`` in a session of its own (it outlives the
    device call that started it), its output in ``<out>/launcher.log``; says where to look.

    It runs from a copy of the tree ``cwd`` (``<out>/tree``): each device call lays the working tree
    (and the paths it carries) down afresh, and on 2026-12-07 a run started from the carried tree lost
    its working directory at the next call ("getcwd() failed"; one run failed with FileNotFoundError)."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = out / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(
        cwd, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", ".frozen", ".venv", ".whl", "runs", "results")
    )
    (tree / "bench" / "results").mkdir(parents=True, exist_ok=True)
    copied = tree / Path(script).resolve().relative_to(Path(cwd).resolve())
    with open(out / "launcher.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(copied), *(a for a in argv if a != "--detach")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=tree,
        )
    print(
        f"detached: pid {proc.pid}, from a copy of the tree in {tree}, output in {out} (done when {out}/done exists)", flush=True
    )


def without_tree(name: str) -> Callable[[tarfile.TarInfo], tarfile.TarInfo | None]:
    """A ``tarfile`` filter leaving out ``<name>/tree``, the copy of the code a detached run ran from."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if info.name == f"{name}/tree" or info.name.startswith(f"{name}/tree/") else info

    return keep


def collect(folder: Path, wait_s: float) -> None:
    """Wait for a detached run to write ``done`` (at most ``wait_s``), then pack its folder into
    ``$OUT/zoo_run.tgz`` (finished or not: what is there comes back) and print its table."""
    deadline = time.monotonic() + wait_s
    while not (folder / "done").exists() and time.monotonic() < deadline:
        time.sleep(2.0)
    finished = (folder / "done").exists()
    dest = Path(os.environ.get("OUT", "."))
    with tarfile.open(dest / "zoo_run.tgz", "w:gz") as tar:
        tar.add(folder, arcname=folder.name, filter=without_tree(folder.name))
    table = folder / "zoo_lanes.txt"
    print(table.read_text() if table.exists() else "(no table yet)")
    print(f"{'finished' if finished else 'NOT finished'}; packed {folder} into {dest / 'zoo_run.tgz'}")


if __name__ == "__main__":
    main()
