"""sdpa's decisions and emitter: per instance, whether each attention site found by
:mod:`speedkit.rewrite.attention` is rewritten (its dropout modules exist, weights read afterwards are
exact, a causal mask is a causal buffer of the instance), and the rewrite itself: each step recorded
where the user's statement stood, the final ``@ v`` one :func:`speedkit.kernels.ops.attention` call.
"""

from __future__ import annotations

import ast
from typing import Any

import torch
from torch import nn

from speedkit.rewrite.ast_tools import call_ops, const, name_node, self_attribute, tuple_of, where
from speedkit.rewrite.attention import Site, Skip, analyze, find, is_torch_attr, src
from speedkit.rewrite.pipeline import Decided, Found, Rewriter
from speedkit.rewrite.source import ParsedMethod


def decide(module: nn.Module, parsed: ParsedMethod, found: Found, exact_float_masks: bool = False) -> Decided:
    """Per site: ``(causal, exact_float_masks)`` when rewritten (``causal``: the mask is the instance's
    causal buffer, SDPA's ``is_causal`` replaces it), None with the reason in the notes otherwise."""
    cls = type(module).__name__
    decided = Decided(notes=[f"{cls} ({where(parsed, line)}): {why}" for line, why in found.notes])
    decisions: list[Any] = []
    for site in found.sites:
        try:
            _check_dropout_modules(module, site, parsed.self_name)
            if site.escapes and not _zero_dropout(module, site, parsed.self_name):
                raise Skip(
                    f"line {site.line}: the attention weights are read after `@ v` (returned or stored) "
                    "while attention dropout may be on: they could not match"
                )
            causal = site.causal_mask is not None and _causal_buffer(module, site.causal_mask, parsed.self_name)
            decisions.append((causal, exact_float_masks))
            decided.done.append("causal" if causal else "attention")
        except Skip as skip:
            decisions.append(None)
            decided.notes.append(f"{cls} ({where(parsed, site.final_stmt)}): {skip}")
    decided.decisions = tuple(decisions)
    return decided


def _resolve(module: nn.Module, node: ast.expr, self_name: str) -> Any:
    """The value of ``self.a.b`` on the instance (or a constant); raises Skip otherwise."""
    if isinstance(node, ast.Constant):
        return node.value
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == self_name:
        value: Any = module
        for attr in reversed(parts):
            value = getattr(value, attr)
        return value
    raise Skip(f"`{src(node)}` is not an attribute of the module")


def _causal_buffer(module: nn.Module, mask: ast.expr, self_name: str) -> bool:
    """Is ``mask`` a causal buffer of the module, sliced to a top-left square (values checked)?"""
    expect_lower = True
    node = mask
    if (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.Eq)
        and isinstance(node.comparators[0], ast.Constant)
        and node.comparators[0].value in (0, False)
    ):
        node = node.left
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Invert, ast.Not)):
        node = node.operand
    elif isinstance(node, ast.Call) and is_torch_attr(node.func, "logical_not") and len(node.args) == 1:
        node = node.args[0]
    else:
        expect_lower = False  # the mask itself marks what is hidden: a strict upper triangle
    if not isinstance(node, ast.Subscript):
        return False
    attr = self_attribute(node.value, self_name)
    if attr is None:
        return False
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if len(elts) < 2 or not all(isinstance(e, ast.Slice) and e.step is None and e.lower is None for e in elts):
        return False
    *lead, row, col = elts
    if (
        any(e.upper is not None for e in lead)
        or row.upper is None
        or col.upper is None
        or ast.dump(row.upper) != ast.dump(col.upper)
    ):
        return False
    buf = getattr(module, attr, None)
    if (
        not isinstance(buf, torch.Tensor)
        or buf.dim() < 2
        or buf.shape[-1] != buf.shape[-2]
        or any(s != 1 for s in buf.shape[:-2])
        or len(lead) != buf.dim() - 2
    ):
        return False
    nonzero = buf.reshape(buf.shape[-2], buf.shape[-1]) != 0
    ones = torch.ones_like(nonzero)
    expected = ones.tril() if expect_lower else ones.triu(1)
    return bool(torch.equal(nonzero.cpu(), expected.cpu()))


def _zero_dropout(module: nn.Module, site: Site, self_name: str) -> bool:
    """Is every dropout of the site provably zero on this instance (so weights read later are exact)?"""
    for kind, expr in site.dropout:
        try:
            if kind == "dropout_module":
                mod = _resolve(module, expr, self_name)
                if not isinstance(mod, nn.Dropout) or mod.p != 0:
                    return False
            else:
                p = _resolve(module, expr.body, self_name)
                if not isinstance(p, (int, float)) or p != 0:
                    return False
        except (Skip, AttributeError):
            return False
    return True


def _check_dropout_modules(module: nn.Module, site: Site, self_name: str) -> None:
    for kind, expr in site.dropout:
        if kind == "dropout_module":
            try:
                mod = _resolve(module, expr, self_name)
            except AttributeError:
                raise Skip(f"`{src(expr)}` does not exist on the module") from None
            if type(mod) is not nn.Dropout:
                raise Skip(f"`{src(expr)}` is applied to the attention weights but is a {type(mod).__name__}, not nn.Dropout")


class _Emitter:
    """Rewrites the decided sites of one (copied) method."""

    def __init__(self, tree: ast.FunctionDef) -> None:
        self.tree = tree

    def emit(self, sites: list[tuple[Site, tuple[bool, bool]]]) -> None:
        replacements: dict[int, list[ast.stmt]] = {}
        inner_replacements: dict[int, ast.stmt] = {}
        expr_replacements: dict[int, ast.expr] = {}
        before: dict[int, list[ast.stmt]] = {}
        for n, (site, (causal, exact)) in enumerate(sites):
            var = f"__sk_attention_{n}"
            head = site.head
            head_tuple = (
                tuple_of(const(head[0]), *head[1:3])
                if head[0] == "mm"
                else tuple_of(const("einsum"), const(head[1]), head[2], head[3])
            )
            if site.inline:
                elts = [e for e in (self._optuple_of(k, x, causal) for k, x in site.steps[0][2]) if e is not None]
                pattern = ast.List(elts=[head_tuple, *elts], ctx=ast.Load())
                expr_replacements[id(site.final_node)] = ast.copy_location(
                    self._call(pattern, site, causal, exact), site.final_node
                )
                continue
            for idx, (st, inner, ops) in enumerate(site.steps):
                elts = [self._optuple_of(k, e, causal) for k, e in ops]
                elts = [e for e in elts if e is not None]
                if idx == 0:
                    stmt: ast.stmt = ast.Assign(
                        targets=[name_node(var, store=True)], value=ast.List(elts=[head_tuple, *elts], ctx=ast.Load())
                    )
                elif elts:
                    stmt = ast.Expr(
                        value=ast.Call(
                            func=ast.Attribute(value=name_node(var), attr="extend", ctx=ast.Load()),
                            args=[ast.List(elts=elts, ctx=ast.Load())],
                            keywords=[],
                        )
                    )
                else:
                    stmt = ast.Pass()
                ast.copy_location(stmt, inner or st)
                if inner is not None:
                    inner_replacements[id(inner)] = stmt
                else:
                    replacements[id(st)] = [stmt]
            expr_replacements[id(site.final_node)] = ast.copy_location(
                self._call(name_node(var), site, causal, exact), site.final_node
            )
            for esc in site.escapes:
                expr_replacements[id(esc)] = ast.copy_location(call_ops("materialize", name_node(esc.id)), esc)
            if site.escapes:
                deferred = ast.Assign(
                    targets=[name_node(site.probs_name, store=True)], value=call_ops("Deferred", name_node(var))
                )
                before.setdefault(id(site.final_stmt), []).append(ast.copy_location(deferred, site.final_stmt))
        self._apply(self.tree, replacements, inner_replacements, expr_replacements, before)
        ast.fix_missing_locations(self.tree)

    @staticmethod
    def _call(pattern: ast.expr, site: Site, causal: bool, exact: bool) -> ast.Call:
        return call_ops(
            "attention",
            pattern,
            site.final_v,
            **{
                k: v
                for k, v in (
                    ("final_eq", const(site.final_eq) if site.final_eq else None),
                    ("is_causal", const(True) if causal else None),
                    ("exact_float_masks", const(True) if exact else None),
                )
                if v is not None
            },
        )

    @staticmethod
    def _optuple_of(kind: str, expr: Any, causal: bool) -> ast.Tuple | None:
        if kind == "fill" and causal:
            return None  # the causal buffer is the whole mask: SDPA's is_causal replaces it
        if kind == "float":
            return tuple_of(const("float"))
        if kind == "softmax":
            return tuple_of(const("softmax"), expr if expr is not None else const(None))
        return tuple_of(const(kind), expr)

    def _apply(self, tree: ast.AST, stmts: dict, inner: dict, exprs: dict, before: dict) -> None:
        class T(ast.NodeTransformer):
            def generic_visit(self, node):  # noqa: N802 - ast API
                for name, value in ast.iter_fields(node):
                    if isinstance(value, list):
                        new = []
                        for item in value:
                            if isinstance(item, ast.stmt):
                                new.extend(before.get(id(item), []))
                                if id(item) in inner:
                                    new.append(inner[id(item)])
                                    continue
                                if id(item) in stmts:
                                    new.extend(stmts[id(item)])
                                    continue
                            if isinstance(item, ast.AST):
                                if id(item) in exprs:
                                    new.append(self.visit_replacement(item))
                                    continue
                                item = self.visit(item)
                            new.append(item)
                        setattr(node, name, new)
                    elif isinstance(value, ast.AST):
                        if id(value) in exprs:
                            setattr(node, name, self.visit_replacement(value))
                        else:
                            setattr(node, name, self.visit(value))
                return node

            def visit_replacement(self, node):
                rep = exprs[id(node)]
                # the replacement's own arguments may contain further replacements (e.g. escapes)
                return self.generic_visit(rep) if rep is not node else rep

        T().visit(tree)


def emit(parsed: ParsedMethod, tree: ast.FunctionDef, decisions: tuple[Any, ...]) -> None:
    """Rewrite ``tree`` (a fresh copy of ``parsed.tree``) in place: its attention sites, as decided."""
    sites = analyze(tree, parsed.self_name).sites  # the same walk: site k of the copy is site k of the original
    _Emitter(tree).emit([(site, decision) for site, decision in zip(sites, decisions) if decision])


ATTENTION = Rewriter("sdpa", find, emit)
