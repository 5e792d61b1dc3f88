"""fused_lm_head's matcher, decisions and emitter for hand-written language models (see
:mod:`speedkit.rungs.fused_lm_head`): in a user module's method,

    logits = self.head(x)                                           # an nn.Linear, no hooks
    ...                                                             # the same block
    loss = F.cross_entropy(logits[.float()].view(-1, logits.size(-1)), targets.view(-1)[, ignore_index=…])

becomes

    __speedkit_lm_0 = __speedkit_ops.lm_head_input(self.head, x)    # (x, None) while training with grad, else (None, self.head(x))
    logits = __speedkit_lm_0[1]
    ...
    loss = (__speedkit_ops.lm_head_loss(__speedkit_lm_0[0], self.head, targets.view(-1), …)
            if __speedkit_lm_0[0] is not None else F.cross_entropy(<as written>))

so the head and the loss run as one chunked op (:func:`speedkit.kernels.linear_cross_entropy.linear_cross_entropy`)
while the model trains, and as written otherwise (evaluation, generation under ``no_grad``).

Taken only where ``logits`` is read nowhere but in that cross-entropy (its reshaping included) and in
``return`` statements, which then return None while training: the same contract as transformers'
fused forward, whose callers the rung checks for reads of the logits. The cross-entropy's logits must
be reshaped to two dims (``view``/``reshape`` with two arguments, ``flatten``), possibly upcast; its
keywords ``ignore_index``, ``label_smoothing`` and a constant ``reduction`` of "mean" or "sum".
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedkit.kernels import layers
from speedkit.rewrite.ast_tools import SCOPES, call_ops, local_names, name_node, resolve, self_attr, self_attribute, where
from speedkit.rewrite.pipeline import Decided, Found, Rewriter
from speedkit.rewrite.source import ParsedMethod, copy_tree

TAG = "fused_lm_head"
_KEYWORDS = {"ignore_index", "label_smoothing", "reduction"}
_BODIES = ("body", "orelse", "finalbody")


@dataclass(frozen=True)
class Site:
    """A head assignment (``name = self.head(x)``) and the cross-entropy over its logits."""

    name: str
    head: str
    line: int
    loss_line: int


def _blocks(node: ast.AST):
    """Every statement list in ``node``'s scope (bodies of ifs, loops, withs, tries), outermost first."""
    for child in ast.walk(node):
        if isinstance(child, SCOPES) and child is not node:
            continue
        for field in _BODIES:
            block = getattr(child, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
        for handler in getattr(child, "handlers", ()):
            yield handler.body


class _Reader:
    """Reads one method: resolves global names, recognises the logits' reshaping and the cross-entropy."""

    def __init__(self, parsed: ParsedMethod) -> None:
        self.parsed = parsed
        self.local_names = local_names(parsed)

    def resolve(self, node: ast.AST) -> Any:
        return resolve(self.parsed, self.local_names, node)

    def head_call(self, stmt: ast.stmt) -> tuple[str, str] | None:
        """``(name, head)`` for ``name = self.head(x)`` (one positional argument)."""
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return None
        call = stmt.value
        if isinstance(call, ast.Call) and len(call.args) == 1 and not call.keywords and not isinstance(call.args[0], ast.Starred):
            head = self_attribute(call.func, self.parsed.self_name)
            if head is not None:
                return stmt.targets[0].id, head
        return None

    def logits_of(self, node: ast.AST, name: str, two_dims: bool = False) -> bool:
        """Whether ``node`` is ``name`` reshaped to two dims (``.view(-1, …)``, ``.reshape(-1, …)``,
        ``.flatten(…)``), upcast or made contiguous on the way."""
        if isinstance(node, ast.Name):
            return node.id == name and two_dims
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            return False
        attr, args = node.func.attr, node.args
        if any(isinstance(a, ast.Starred) for a in args) or node.keywords and attr != "flatten":
            return False
        if attr in ("float", "contiguous") and not args:
            return self.logits_of(node.func.value, name, two_dims)
        if attr == "to" and len(args) == 1 and self.resolve(args[0]) is torch.float32:
            return self.logits_of(node.func.value, name, two_dims)
        if attr in ("view", "reshape") and len(args) == 2:
            return self.logits_of(node.func.value, name, True)
        if attr == "flatten":
            return self.logits_of(node.func.value, name, True)
        return False

    def cross_entropy(self, node: ast.AST, name: str) -> str | None:
        """Why ``node`` is not a cross-entropy over ``name``'s logits that the fused op computes (None: it is)."""
        if not (isinstance(node, ast.Call) and self.resolve(node.func) is F.cross_entropy):
            return "not a cross-entropy"
        if len(node.args) != 2 or any(isinstance(a, ast.Starred) for a in node.args):
            return "its logits and targets are not its two positional arguments"
        if not self.logits_of(node.args[0], name):
            return f"its logits are not {name} reshaped to (tokens, vocabulary)"
        for kw in node.keywords:
            if kw.arg not in _KEYWORDS:
                return f"with {kw.arg or '**'}=: not taken by the fused op"
            if kw.arg == "reduction" and not (isinstance(kw.value, ast.Constant) and kw.value.value in ("mean", "sum")):
                return "a reduction other than a constant 'mean' or 'sum'"
        return None


def _loads(tree: ast.AST, name: str) -> list[ast.Name]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]


def _within(node: ast.AST) -> set[int]:
    return {id(n) for n in ast.walk(node)}


def _sites(parsed: ParsedMethod, tree: ast.FunctionDef) -> tuple[list[tuple[Site, ast.stmt, ast.Call]], list[str]]:
    """The sites of ``tree`` in a deterministic walk (with their head statement and cross-entropy call
    nodes), and the near misses."""
    reader = _Reader(parsed)
    # what a return statement holds: the logits may be read there (they are None while fused)
    returns = set().union(*(_within(r) for r in ast.walk(tree) if isinstance(r, ast.Return)))
    sites: list[tuple[Site, ast.stmt, ast.Call]] = []
    notes: list[str] = []
    for block in _blocks(tree):
        for i, stmt in enumerate(block):
            found = reader.head_call(stmt)
            if found is None:
                continue
            name, head = found
            calls = [
                n
                for later in block[i + 1 :]
                for n in ast.walk(later)
                if isinstance(n, ast.Call) and reader.resolve(n.func) is F.cross_entropy and _loads(n, name)
            ]
            if not calls:
                continue
            call = calls[0]
            why = reader.cross_entropy(call, name)
            if why is None:
                allowed = _within(call.args[0])
                stray = [n for n in _loads(tree, name) if id(n) not in allowed and id(n) not in returns]
                if stray:
                    why = f"{name} is read at line {stray[0].lineno} (besides the loss and the return)"
            if why is not None:
                notes.append(f"{where(parsed, call)}: self.{head}(…) → F.cross_entropy not fused: {why}")
                continue
            sites.append((Site(name, head, stmt.lineno, call.lineno), stmt, call))
    return sites, notes


def find(parsed: ParsedMethod) -> Found:
    sites, notes = _sites(parsed, copy_tree(parsed))
    return Found([site for site, _, _ in sites], notes)


def decide(module: nn.Module, parsed: ParsedMethod, found: Found) -> Decided:
    """Per site: fused where ``self.<head>`` is a plain ``nn.Linear`` without hooks."""
    decisions, done, notes = [], [], []
    for site in found.sites:
        head = getattr(module, site.head, None)
        ok = type(head) is nn.Linear and not layers.hooked(head)
        if isinstance(head, nn.Linear) and not ok:
            notes.append(f"{type(module).__name__}: self.{site.head} (line {site.line}) is an nn.Linear subclass or has hooks")
        decisions.append(ok)
        if ok:
            done.append("lm_head")
    notes += [f"{type(module).__name__}.{parsed.name}: {n}" for n in found.notes]
    return Decided(tuple(decisions), done, notes)


def emit(parsed: ParsedMethod, tree: ast.FunctionDef, decisions: tuple[Any, ...]) -> None:
    """Rewrite ``tree`` in place (see the module doc)."""
    sites, _ = _sites(parsed, tree)
    replace: dict[int, Any] = {}
    for k, ((site, stmt, call), decision) in enumerate(zip(sites, decisions)):
        if not decision:
            continue
        state = f"__speedkit_lm_{k}"
        head = self_attr(parsed.self_name, site.head)
        first = ast.Assign(targets=[name_node(state, store=True)], value=call_ops("lm_head_input", head, stmt.value.args[0]))
        second = ast.Assign(
            targets=[name_node(site.name, store=True)],
            value=ast.Subscript(value=name_node(state), slice=ast.Constant(1), ctx=ast.Load()),
        )
        replace[id(stmt)] = [ast.copy_location(first, stmt), ast.copy_location(second, stmt)]
        hidden = ast.Subscript(value=name_node(state), slice=ast.Constant(0), ctx=ast.Load())
        fused = call_ops(
            "lm_head_loss",
            hidden,
            self_attr(parsed.self_name, site.head),
            copy.deepcopy(call.args[1]),
            keywords=copy.deepcopy(call.keywords),
        )
        test = ast.Compare(left=hidden, ops=[ast.IsNot()], comparators=[ast.Constant(None)])
        replace[id(call)] = ast.copy_location(ast.IfExp(test=test, body=fused, orelse=call), call)
    _Swap(replace).visit(tree)
    ast.fix_missing_locations(tree)


class _Swap(ast.NodeTransformer):
    """Replaces statements and calls by identity, not descending into what it put in."""

    def __init__(self, mapping: dict[int, Any]) -> None:
        self.mapping = mapping

    def visit(self, node: ast.AST) -> Any:
        new = self.mapping.get(id(node))
        if new is not None:
            if isinstance(new, ast.IfExp):  # the call as written stays the else branch: rewrite inside it
                new.orelse = self.generic_visit(new.orelse)
            return new
        return self.generic_visit(node)


LM_HEAD = Rewriter(TAG, find, emit)
