"""speedkit's module graph has no import cycles, and private torch/Lightning APIs are reached only
through ``speedkit.compat``.

Every ``import`` counts, also those inside functions (a lazy import still ties the two modules'
designs together); only ``if TYPE_CHECKING:`` blocks are left out. Importing ``a.b.c`` also imports
the packages ``a`` and ``a.b``, so those are edges too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "speedkit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, name: str, is_package: bool) -> list[tuple[str, int]]:
    """(imported module, line) for every import, resolving relative imports and `from pkg import submodule`."""
    out: list[tuple[str, int]] = []
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, node.lineno))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _ in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # a.b.c imports a, a.b and a.b.c
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    graph[name].add(prefix)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: private names of torch / Lightning, reached only through speedkit/compat.py
PRIVATE = re.compile(
    r"\btorch\._(?!_)|torch\.utils\._|torch\.ops\.\w+\._|\blightning\.\S*\._|\._(compiler_ctx|results|current_fx_name|"
    r"iterator|step_supports_amp_scaling|forward_hooks|forward_pre_hooks|backward_hooks|backward_pre_hooks|"
    r"on_before_batch_transfer|lightning_optimizers)\b|_torchdynamo_orig_callable"
)


def test_private_torch_and_lightning_apis_only_in_compat():
    offenders = []
    for name, path in _modules().items():
        if name == "speedkit.compat" or name.startswith("speedkit.kernels"):
            continue  # kernels use Triton's public API only; torch.library is public
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE.search(code) and "torch.library" not in code:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}")
    assert offenders == []
