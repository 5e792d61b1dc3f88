"""Small AST helpers shared by the matchers and emitters of :mod:`speedkit.rewrite`: which names a
node reads and binds, the blocks a statement holds, what a global name refers to, and builders for
the nodes an emitter writes (names, constants, tuples, ``self.attr``, calls into :mod:`speedkit.kernels.ops`)."""

from __future__ import annotations

import ast
import builtins
import os
import types
from collections.abc import Iterator
from typing import Any

from speedkit.rewrite.source import OPS_NAME, ParsedMethod

#: other scopes: their bodies run at another time, with other names
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


# -- reading ----------------------------------------------------------------------------------------


def names_loaded(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def names_stored(node: ast.AST) -> set[str]:
    out = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
    return out


def self_attribute(node: ast.AST, self_name: str) -> str | None:
    """``'attr'`` if ``node`` is ``self.attr``, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == self_name:
        return node.attr
    return None


def child_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement blocks nested in ``stmt``: bodies, ``else``/``finally``, handlers, ``match`` cases."""
    blocks = [getattr(stmt, name) for name in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, name, None), list)]
    blocks += [h.body for h in getattr(stmt, "handlers", [])]
    blocks += [c.body for c in getattr(stmt, "cases", [])]
    return [b for b in blocks if b and isinstance(b[0], ast.stmt)]


def walk(node: ast.AST, skip: tuple[type, ...] = SCOPES) -> Iterator[ast.AST]:
    """``ast.walk`` in source order that does not enter the node types in ``skip``."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, skip):
            yield from walk(child, skip)


def local_names(parsed: ParsedMethod) -> set[str]:
    """The names local to a parsed method: its parameters and every name it binds."""
    a = parsed.tree.args
    params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
    return params | (names_stored(parsed.tree) - {parsed.tree.name})


def resolve(parsed: ParsedMethod, local: set[str], node: ast.AST) -> Any:
    """The object a global/closure name or a module attribute chain in ``parsed`` names (``local``: its
    :func:`local_names`, which name nothing known before it runs), else None."""
    if isinstance(node, ast.Attribute):
        base = resolve(parsed, local, node.value)
        return getattr(base, node.attr, None) if isinstance(base, types.ModuleType) else None
    if isinstance(node, ast.Name) and node.id not in local:
        return global_value(parsed.function, node.id)
    return None


def global_value(function: Any, name: str) -> Any:
    """What a global-looking name in ``function`` refers to: a (filled) closure cell, a global, or a
    builtin; None when it names nothing."""
    code = function.__code__
    if name in code.co_freevars:
        try:
            return function.__closure__[code.co_freevars.index(name)].cell_contents
        except ValueError:  # an empty cell: not bound yet
            return None
    if name in function.__globals__:
        return function.__globals__[name]
    return getattr(builtins, name, None)


def where(parsed: ParsedMethod, at: ast.AST | int) -> str:
    """``file.py:LINE`` of a node (or a line), for reports."""
    line = at if isinstance(at, int) else getattr(at, "lineno", parsed.first_line)
    return f"{os.path.basename(parsed.filename)}:{line}"


def short(node: ast.AST, limit: int = 40) -> str:
    """The source of ``node``, cut to ``limit`` characters for a report line."""
    text = ast.unparse(node)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- writing ----------------------------------------------------------------------------------------


def name_node(id_: str, store: bool = False) -> ast.Name:
    return ast.Name(id=id_, ctx=ast.Store() if store else ast.Load())


def const(value: Any) -> ast.Constant:
    return ast.Constant(value=value)


def tuple_of(*items: ast.expr) -> ast.Tuple:
    return ast.Tuple(elts=list(items), ctx=ast.Load())


def self_attr(self_name: str, attr: str) -> ast.Attribute:
    """The AST of ``self.attr``."""
    return ast.Attribute(value=name_node(self_name), attr=attr, ctx=ast.Load())


def call_ops(op: str, *args: ast.expr, keywords: list[ast.keyword] | None = None, **kwargs: ast.expr) -> ast.Call:
    """The AST of ``__speedkit_ops.<op>(*args, *keywords, **kwargs)``."""
    return ast.Call(
        func=ast.Attribute(value=name_node(OPS_NAME), attr=op, ctx=ast.Load()),
        args=list(args),
        keywords=[*(keywords or []), *(ast.keyword(arg=k, value=v) for k, v in kwargs.items())],
    )


class Replace(ast.NodeTransformer):
    """Replaces nodes by identity (``id(node)`` → new node), not descending into a replacement."""

    def __init__(self, mapping: dict[int, ast.AST]) -> None:
        self.mapping = mapping

    def visit(self, node: ast.AST) -> Any:
        new = self.mapping.get(id(node))
        return new if new is not None else self.generic_visit(node)
