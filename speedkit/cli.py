"""The ``speedkit`` command.

    speedkit optimize [RECIPE] [--out DIR]   climb the ladder, write report.json/.md and optimized.yaml
    speedkit fit RECIPE                      train with Lightning, the recipe's rungs applied (no trials)
    speedkit validate RECIPE                 check a recipe without running anything
    speedkit rungs                           list the rungs

Without RECIPE, ``optimize`` runs the embedded default (a tiny GPT on CPU). Errors in the input
print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from speedkit.errors import SpeedkitError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speedkit", description="Make PyTorch training loops fast, and prove it.")
    sub = parser.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("optimize", help="climb the quick-win ladder on a recipe and report each rung")
    opt.add_argument("recipe", nargs="?", help="recipe YAML (default: the embedded tiny CPU recipe)")
    opt.add_argument("--out", default=None, help="output directory (default: runs/<recipe name>)")
    fit = sub.add_parser("fit", help="train a recipe with Lightning, its ladder applied without trials")
    fit.add_argument("recipe", help="recipe YAML, e.g. the optimized.yaml written by optimize")
    val = sub.add_parser("validate", help="check a recipe and build its model and data, without training")
    val.add_argument("recipe")
    sub.add_parser("rungs", help="list the available rungs")
    return parser


def _load(path: str | None):
    from speedkit.recipe import embedded_default_path, load_recipe

    return load_recipe(Path(path) if path else embedded_default_path())


def _optimize(args: argparse.Namespace) -> int:
    from rich.console import Console

    from speedkit.report.console import render_console
    from speedkit.runner import optimize

    recipe = _load(args.recipe)
    out = Path(args.out) if args.out else Path("runs") / (recipe.path.stem if recipe.path else "recipe")
    # a report table needs room; rich assumes 80 columns when the output is not a terminal
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(f"[bold]speedkit optimize[/bold] {recipe.path}  ->  {out}")
    result, written = optimize(recipe, out, on_event=lambda line: console.print(f"[dim]{line}[/dim]"))
    render_console(result.to_dict(), console)
    for kind, path in written.items():
        console.print(f"{kind}: {path}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from speedkit.runner import fit

    recipe = _load(args.recipe)
    _, ladder = fit(recipe)
    print(f"speedkit fit: applied {', '.join(ladder.applied_changes) or 'no rungs'}"
          + "".join(f"; skipped {name}: {reason}" for name, reason in ladder.skipped.items()))
    return 0


def _validate(args: argparse.Namespace) -> int:
    recipe = _load(args.recipe)
    recipe.build_model()
    recipe.build_datamodule()
    print(f"{recipe.path}: ok ({len(recipe.ladder)} rungs: {', '.join(r.name for r in recipe.ladder)})")
    return 0


def _rungs(args: argparse.Namespace) -> int:
    import sys as _sys

    from speedkit import rungs

    for name in rungs.names():
        doc = (_sys.modules[rungs.get(name).__module__].__doc__ or "").strip().splitlines()
        print(f"{name:18s} {doc[0] if doc else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"optimize": _optimize, "fit": _fit, "validate": _validate, "rungs": _rungs}[args.command]
    try:
        return handler(args)
    except SpeedkitError as exc:
        where = getattr(args, "recipe", None)
        prefix = f"{where}: " if where else ""
        print(f"speedkit: error: {prefix}{exc}".replace("\n", " "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
