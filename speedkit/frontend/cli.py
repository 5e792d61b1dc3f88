"""The ``speedkit`` command.

    speedkit optimize [RECIPE] [--out DIR] [--KEY.PATH VALUE ...]   climb the ladder in the recipe's
                                       Trainer; write report.json/.md and optimized.yaml
    speedkit fit RECIPE [--KEY.PATH VALUE ...]   train with Lightning, the recipe's rungs applied (no trials)
    speedkit validate RECIPE           check a recipe without running anything (noting what this machine lacks)
    speedkit rungs                     list the rungs
    speedkit report DIR                render report.md and report.html again from DIR/report.json
    speedkit compare A B [--out F.md]  two runs side by side (A, B: report folders or report.json files)
    speedkit --version

Without RECIPE, ``optimize`` runs the embedded default (a tiny model on CPU). Overrides follow
LightningCLI: ``--trainer.max_steps 50``, ``--measure.steps=20``, ``--ladder '[tf32, compile]'``
(values are read as YAML). Errors in the input print one line and exit with code 2; an exception in
your own code prints its frames in your code and one line, and exits with 1; an interrupted
``optimize`` writes a partial report, prints one line and exits with 130 (Ctrl-C) or 143 (SIGTERM);
a report that cannot be written (a full disk) leaves nothing half-written: ``optimize`` prints the
ladder's table, one line naming the file and the reason, and exits with 74.

A recipe whose Trainer runs several processes (``trainer: {devices: 2, strategy: ddp}``, any number of
devices and nodes) runs through Lightning's own launcher, which starts the same command line again in
each other process of this node. Global rank 0 alone prints the lines, the table and the progress,
and writes the files; every rank exits 0 on success. Another rank's error line names it
(``speedkit: error: local rank 1: ...``).
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from pathlib import Path
from typing import Any

from speedkit.errors import ConfigError, OutputError, SpeedkitError, UserCodeError

#: exit code of a run whose results could not be written (sysexits' EX_IOERR)
OUTPUT_ERROR_EXIT = 74


class _Parser(argparse.ArgumentParser):
    """argparse's errors in one line (not its usage block), exit code 2; subcommands' parsers too."""

    def error(self, message: str) -> typing.NoReturn:
        if message == "the following arguments are required: command":
            message = "no command given; give one of optimize, fit, validate, rungs, sweep, report, compare"
        where = self.prog.partition(" ")[2]
        print(f"speedkit: error: {where + ': ' if where else ''}{message}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    from speedkit import __version__

    parser = _Parser(prog="speedkit", description="Make PyTorch training loops fast, and prove it.")
    parser.add_argument("--version", action="version", version=f"speedkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("optimize", help="climb the quick-win ladder in the recipe's Trainer and report each rung")
    opt.add_argument("recipe", nargs="?", help="recipe YAML (default: the embedded tiny CPU recipe)")
    opt.add_argument("--out", default=None, help="output folder (default: runs/<recipe name>)")
    opt.add_argument(
        "--no-cache",
        action="store_true",
        help="climb without the decision cache: no earlier decision re-checked, none kept (default: kept in "
        "$SPEEDKIT_CACHE_DIR or ~/.cache/speedkit; `speedkit cache clear` forgets them)",
    )
    fit = sub.add_parser("fit", help="train a recipe with Lightning, its ladder applied without trials")
    fit.add_argument("recipe", help="recipe YAML, e.g. the optimized.yaml written by optimize")
    swp = sub.add_parser("sweep", help="find the micro-batch of highest throughput for a recipe (short timed fits)")
    swp.add_argument("recipe", nargs="?", help="recipe YAML (default: the embedded tiny CPU recipe)")
    swp.add_argument("--out", default=None, help="output folder for sweep.json and sweep.md (default: runs/<recipe name>)")
    swp.add_argument(
        "--change-effective-batch",
        action="store_true",
        help="let the effective batch grow with the micro-batch (default: keep it through accumulation)",
    )
    swp.add_argument(
        "--checkpointing",
        choices=("auto", "off"),
        default="auto",
        help="auto: a size that does not fit is measured again with the model's repeated blocks checkpointed (default)",
    )
    swp.add_argument("--margin", type=float, default=None, help="share of device memory left free (default 0.10)")
    swp.add_argument("--max-trials", type=int, default=None, help="sizes measured at most (default 8)")
    val = sub.add_parser("validate", help="check a recipe and build its model and data, without training")
    val.add_argument("recipe")
    sub.add_parser("rungs", help="list the available rungs")
    rep = sub.add_parser("report", help="render report.md and report.html again from a run's report.json")
    rep.add_argument("dir", help="the run's folder (or its report.json)")
    cmp = sub.add_parser("compare", help="two runs side by side: headline figures, rungs, time breakdown")
    cmp.add_argument("a", help="run A: its folder or report.json")
    cmp.add_argument("b", help="run B: its folder or report.json")
    cmp.add_argument("--out", default=None, help="also write the comparison as markdown to this file")
    cache = sub.add_parser("cache", help="the decisions SpeedLadder() keeps between fits: list them or clear them")
    cache.add_argument("action", choices=("list", "clear"), help="list: one line each; clear: forget every decision")
    cache.add_argument("--dir", default=None, help="the cache folder (default: $SPEEDKIT_CACHE_DIR or ~/.cache/speedkit)")
    return parser


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, Any]]]:
    """Take ``--a.b value`` / ``--a.b=value`` pairs (a dotted key, or a recipe's top-level key such as
    ``--seed 1`` or ``--ladder '[tf32, compile]'``) out of ``argv``; values read as YAML.

    Done before argparse sees the arguments: it would take a value such as ``50`` for the optional
    recipe argument. One-line ConfigError for a key without a value or a value that is not YAML.
    """
    import yaml

    from speedkit.frontend.recipe import TOP_LEVEL_KEYS

    rest: list[str] = []
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, text = arg[2:].partition("=")
        if not arg.startswith("--") or ("." not in key and key not in TOP_LEVEL_KEYS):
            rest.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"--{key}", "needs a value, e.g. --trainer.max_steps 50")
            text = argv[i + 1]
            i += 1
        i += 1
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            raise ConfigError(f"--{key}", f"cannot read {text!r} as a YAML value") from None
        out.append((key, value))
    return rest, out


def _load(path: str | None, overrides: list[tuple[str, Any]]):
    from speedkit.frontend.recipe import embedded_default_path, load_recipe

    return load_recipe(Path(path) if path else embedded_default_path(), overrides=overrides)


def _optimize(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    from rich.console import Console

    from speedkit.frontend.progress import ProgressBar
    from speedkit.frontend.runner import Interrupted, optimize, rank_label
    from speedkit.report.console import render_console

    recipe = _load(args.recipe, overrides)
    if rank_label() is not None:  # another rank, started by Lightning's launcher: it trains in step and says nothing
        try:
            optimize(recipe, _out_dir(args.out, recipe), cache=not args.no_cache)
        except Interrupted as exc:  # rank 0 says so
            return exc.exit_code
        return 0
    out = _out_dir(args.out, recipe)
    # a report table needs room; rich assumes 80 columns when the output is not a terminal
    console = Console(width=None if sys.stdout.isatty() else 160)
    # optimize's checks refuse files in `out` it did not write; its own earlier ones it replaces, and says so
    earlier = [name for name in ("report.json", "report.md", "report.html", "optimized.yaml") if (out / name).is_file()]
    header: str | None = f"[bold]speedkit optimize[/bold] {recipe.path}  ->  {out}" + (
        f"  (replacing the earlier {', '.join(earlier)} there)" if earlier else ""
    )

    def on_event(line: str) -> None:
        nonlocal header
        if header is not None:  # with the first event, after optimize's checks: a wrong input gets its one line alone
            console.print(header)
            header = None
        console.print(f"[dim]{line}[/dim]", highlight=False)

    try:
        with ProgressBar(console, "trials") as bar:
            result, written = optimize(recipe, out, on_event=on_event, on_progress=bar, cache=not args.no_cache)
    except Interrupted as exc:
        print(f"speedkit: {exc}", file=sys.stderr)
        return exc.exit_code
    except OutputError as exc:  # the ladder ran: its results go to the terminal rather than be lost
        if exc.result is not None:
            render_console(exc.result.to_dict(), console)
        done = f"; written whole: {', '.join(str(p) for p in exc.written.values())}" if exc.written else ""
        print(f"speedkit: error: {exc} (nothing half-written is left; the results are printed above{done})", file=sys.stderr)
        return OUTPUT_ERROR_EXIT
    render_console(result.to_dict(), console)
    for kind, path in written.items():
        console.print(f"{kind}: {path}")
    return 0


def _out_dir(out: str | None, recipe: Any) -> Path:
    """``--out``, or runs/<recipe name>."""
    if out is not None and not out.strip():
        raise ConfigError("--out", "is empty; give a folder for the report, e.g. --out runs/mymodel")
    return Path(out) if out else Path("runs") / (recipe.path.stem if recipe.path else "recipe")


def _fit(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    from speedkit.frontend.runner import fit

    recipe = _load(args.recipe, overrides)
    trainer, ladder = fit(recipe)
    if not trainer.is_global_zero:  # the other ranks of a DDP fit: rank 0 speaks for the run
        return 0
    print(
        f"speedkit fit: applied {', '.join(ladder.applied_changes) or 'no rungs'}"
        + "".join(f"; skipped {name}: {reason}" for name, reason in ladder.skipped.items())
    )
    from speedkit.lightning import SpeedProfiler

    profiler = next((c for c in trainer.callbacks if isinstance(c, SpeedProfiler)), None)
    if profiler is not None and profiler.summary is not None:
        print(f"speedkit fit: {profiler_line(profiler.summary)}")
    return 0


def profiler_line(s: dict[str, Any]) -> str:
    """The fit's figures in one line: steps, median step time, throughput, MFU, data wait, peak memory."""
    parts = [f"{s['steps']} optimizer steps"]
    if s.get("step_ms_median") is not None:
        parts.append(f"{s['step_ms_median']:.2f} ms/step (median of {s['timed_steps']})")
    if s.get("throughput"):
        parts.append(f"{s['throughput']:,.0f} {s['throughput_unit']}")
    if s.get("mfu") is not None:
        parts.append(f"MFU {s['mfu']:.1%}")
    if s.get("data_wait_ms") is not None:
        parts.append(f"data wait {s['data_wait_ms']:.2f} ms/step")
    if s.get("peak_memory_bytes"):
        parts.append(f"peak memory {s['peak_memory_bytes'] / 1e9:.2f} GB")
    return ", ".join(parts)


def _sweep(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    from rich.console import Console

    from speedkit.frontend.progress import ProgressBar
    from speedkit.frontend.sweep_runner import sweep_recipe

    recipe = _load(args.recipe, overrides)
    if (recipe.processes or 1) > 1:
        raise ConfigError(
            "trainer",
            f"speedkit sweep times each size in one process, and this Trainer runs {recipe.processes}; sweep on "
            "one device (--trainer.devices 1 --trainer.num_nodes 1): the micro-batch it finds is per device under DDP",
        )
    if args.max_trials is not None and args.max_trials < 1:
        raise ConfigError("--max-trials", f"expected a number of sizes >= 1, found {args.max_trials}")
    out = Path(args.out) if args.out else Path("runs") / (recipe.path.stem if recipe.path else "recipe")
    console = Console(width=None if sys.stdout.isatty() else 160)
    with ProgressBar(console, "sweep") as bar:
        result = sweep_recipe(
            recipe,
            out,
            keep_effective=not args.change_effective_batch,
            checkpointing=args.checkpointing,
            margin=args.margin,
            max_trials=args.max_trials,
            on_event=lambda line: console.print(line, highlight=False),
            on_progress=bar,
        )
    print("\n".join(result.table()))
    gain = f" ({result.gain:.2f}x yours)" if result.gain else ""
    acc = result.trial(result.chosen).accumulate if result.trial(result.chosen) else 1
    print(f"chosen micro-batch: {result.chosen} x {acc} accumulated{gain}; written: {out / 'sweep.json'}, {out / 'sweep.md'}")
    scaling = result.lr_scaling(int(recipe.trainer.get("accumulate_grad_batches") or 1))
    if scaling is not None:
        print(f"learning rate: {scaling['line']}")
    return 0


def _validate(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    from speedkit.frontend.runner import check_model_takes_data, check_trainer

    recipe = _load(args.recipe, overrides)
    note = check_trainer(recipe, here=False)
    check_model_takes_data(recipe, recipe.build_model(), recipe.build_datamodule())
    which = "rungs" if recipe.ladder_given else "rungs of the default ladder, as the recipe lists none"
    print(
        f"{recipe.path}: ok ({len(recipe.ladder)} {which}: {', '.join(r.name for r in recipe.ladder)})"
        + (f"; note: {note}" if note else "")
    )
    return 0


def _rungs(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    from speedkit import rungs

    for name in rungs.names():
        doc = (sys.modules[rungs.get(name).__module__].__doc__ or "").strip().splitlines()
        line = _plain(doc[0]) if doc else ""
        print(f"{name:18s} {line.removeprefix(f'{name}: ')}")
    return 0


def _plain(rest: str) -> str:
    """A line of a docstring as plain text for a terminal: reST roles (:class:`~a.B`) by their last
    name, literals (``x``) without their quotes."""
    rest = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).split(".")[-1] if "~" in m.group(0) else m.group(1), rest)
    return rest.replace("``", "")


def _report(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    from speedkit.report import load_report, write_report

    path = Path(args.dir)
    d = load_report(path)
    out = path if path.is_dir() else path.parent
    try:
        written = write_report(d, out, formats=("md", "html"))
    except OutputError as exc:
        print(f"speedkit: error: {exc}".replace("\n", " "), file=sys.stderr)
        return OUTPUT_ERROR_EXIT
    for kind, p in written.items():
        print(f"{kind}: {p}")
    return 0


def _compare(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    from rich.console import Console

    from speedkit.files import write_text_atomic
    from speedkit.report import load_report
    from speedkit.report.compare import compare_reports

    if args.out is not None and (not args.out.strip() or Path(args.out).is_dir()):
        raise ConfigError("--out", f"{args.out!r} is not a file name; give one, e.g. --out compare.md")
    a, b = load_report(args.a), load_report(args.b)
    result = compare_reports(a, b, args.a, args.b)
    result.render_console(Console(width=None if sys.stdout.isatty() else 160))
    if args.out:
        try:
            print(f"md: {write_text_atomic(Path(args.out), result.to_markdown())}")
        except OutputError as exc:
            print(f"speedkit: error: {exc}".replace("\n", " "), file=sys.stderr)
            return OUTPUT_ERROR_EXIT
    return 0


def _cache(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> int:
    """``speedkit cache list|clear``: the decisions kept between fits (:mod:`speedkit.engine.cache`)."""
    import datetime

    from speedkit.engine.cache import DecisionCache

    cache = DecisionCache(args.dir)
    if args.action == "clear":
        print(f"speedkit: forgot {cache.clear()} decision(s) in {cache.folder}")
        return 0
    entries = cache.entries()
    print(f"speedkit: {len(entries)} decision(s) in {cache.folder}")
    for e in entries:
        when = datetime.datetime.fromtimestamp(e.created).strftime("%Y-%m-%d %H:%M")
        speed = f"{e.speedup:.2f}x the baseline" if e.speedup else "speedup not measured"
        print(f"  {e.key[:12]}  {when}  kept: {', '.join(e.kept) or 'none'} ({speed})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from speedkit.distributed import end_process_group
    from speedkit.frontend.runner import rank_label

    argv = list(sys.argv[1:] if argv is None else argv)
    # in a process Lightning's launcher started (DDP), the error lines say which: rank 0 may not be the one that failed
    rank = rank_label()
    error = f"speedkit: error: {rank}: " if rank else "speedkit: error: "
    try:
        argv, overrides = split_overrides(argv)
    except SpeedkitError as exc:
        print(f"{error}{exc}".replace("\n", " "), file=sys.stderr)
        return 2
    args, extra = _parser().parse_known_args(argv)
    handler = {
        "optimize": _optimize,
        "fit": _fit,
        "sweep": _sweep,
        "validate": _validate,
        "rungs": _rungs,
        "report": _report,
        "compare": _compare,
        "cache": _cache,
    }[args.command]
    try:
        if extra:
            raise ConfigError(extra[0], "unexpected argument; overrides look like --trainer.max_steps 50")
        if overrides and args.command in ("rungs", "report", "compare", "cache"):
            raise ConfigError(f"--{overrides[0][0]}", f"speedkit {args.command} takes no overrides")
        code = handler(args, overrides)
        end_process_group()  # this process's run is over: its process group too (under strategy: ddp)
        return code
    except UserCodeError as exc:
        print("Traceback of your code (most recent call last):\n" + "".join(exc.frames).rstrip(), file=sys.stderr)
        print(f"{error}{exc}".replace("\n", " "), file=sys.stderr)
        return 1
    except SpeedkitError as exc:
        where = getattr(args, "recipe", None)
        prefix = f"{where}: " if where else ""
        print(f"{error}{prefix}{exc}".replace("\n", " "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
