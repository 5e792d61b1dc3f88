"""speedkit's packages stand in layers: a module imports only from layers below its own.

From the top: what a user calls (the command line, recipes, ``speedkit.apply``) and the reference
models; the Lightning callbacks; the engine that decides; what it reports and profiles; the rungs; the
CUDA graph; the training step and state; the data path and the source rewriter; measuring and the
kernels; and the foundation every layer may use (errors, compat, config, files, handles, options,
fork safety, the results schema). Packages named in one layer with ``|`` are independent: neither
imports the other. Every import counts, lazy ones inside functions too (the graph is
:func:`test_imports._graph`'s), except under ``if TYPE_CHECKING:``. A new package or top-level module
must be placed here, and README's Layout names it (``test_readme_layout_names_every_package``).
"""

from __future__ import annotations

import re

from test_imports import PACKAGE, _graph

#: top to bottom; "a | b": a layer of independent parts
LAYERS = [
    "frontend | demos",
    "lightning",
    "engine",
    "report | profile",
    "rungs",
    "cudagraph",
    "training",
    "data | rewrite",
    "measure | kernels",
    "errors : compat : config : files : handle : options : fork_safety : results : distributed : figures",
]
#: the package's entry points, above every layer
ENTRY = {"speedkit", "speedkit.__main__"}


def _layer_of() -> dict[str, tuple[int, str]]:
    """Part name (``engine``) -> (layer index, group: parts that may import each other share it)."""
    out: dict[str, tuple[int, str]] = {}
    for i, layer in enumerate(LAYERS):
        for part in layer.split("|"):
            names = [n.strip() for n in part.split(":")]
            for name in names:
                out[name] = (i, "+".join(names))
    return out


def _part(module: str) -> str:
    return module.split(".")[1]


def test_every_package_and_module_has_a_layer():
    layers = _layer_of()
    parts = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").exists()
    }
    assert sorted(parts - set(layers)) == [], "place these in LAYERS"
    assert sorted(set(layers) - parts) == [], "LAYERS names parts that do not exist"


def violations(graph: dict[str, set[str]]) -> list[str]:
    layers = _layer_of()
    found = []
    for module, targets in sorted(graph.items()):
        if module in ENTRY:
            continue
        here = layers[_part(module)]
        for target in sorted(targets):
            if target in ENTRY:
                found.append(f"{module} imports {target} (the package's entry point: import the module itself)")
                continue
            there = layers[_part(target)]
            if here == there or there[0] > here[0]:
                continue  # the same part (or group), or a layer below
            how = "a layer above it" if there[0] < here[0] else "an independent part of its layer"
            found.append(f"{module} imports {target}, {how}")
    return found


def test_imports_go_down_the_layers():
    assert violations(_graph()) == []


def test_the_layering_check_finds_an_upward_import():
    graph = {
        "speedkit.data.source": {"speedkit.engine.ladder"},
        "speedkit.report.html": {"speedkit.profile.window"},
        "speedkit.rungs.tf32": {"speedkit.training.state", "speedkit.compat"},
    }
    assert violations(graph) == [
        "speedkit.data.source imports speedkit.engine.ladder, a layer above it",
        "speedkit.report.html imports speedkit.profile.window, an independent part of its layer",
    ]


def test_readme_layout_names_every_package():
    """README's Layout is a list of the package's parts; it names each of them and nothing else."""
    text = (PACKAGE.parent / "README.md").read_text()
    layout = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^  - `([a-z_]+)(?:/|\.py)`", layout, flags=re.M))  # the items under `speedkit/`
    parts = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem not in ("__init__",)) or (p / "__init__.py").exists()
    }
    assert sorted(parts - named) == [], "README's Layout does not name these"
    assert sorted(named - parts) == [], "README's Layout names what does not exist"


def test_no_phase_of_the_ladder_imports_the_ladder_not_even_for_types():
    # the ladder imports its phases (diagnose, plan, decide, confirm); they type against the Trials
    # protocol, so the engine reads in the order it runs, with no circle even for a type checker
    import ast

    engine = PACKAGE / "engine"
    importers = []
    for path in sorted(engine.glob("*.py")):
        if path.name == "ladder.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(n == "speedkit.engine.ladder" for n in names):
                importers.append(path.name)
    assert not importers, importers
