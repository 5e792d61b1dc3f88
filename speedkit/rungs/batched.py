"""batched: many small GEMMs written one by one, run as one (batched) GEMM.

Speeds up: models that launch many small matrix products where one larger one would do: sibling
``nn.Linear`` layers reading the same input (separate q/k/v or gate/up projections, per-head
Linears in a ``ModuleList``), Python loops of per-slice matmuls, ensembles of identical members.
Each small GEMM leaves most of a GPU idle and costs a launch; one GEMM over the whole keeps it busy.
Does not help: models whose GEMMs are already large (a 4096-wide projection is compute-bound;
fusing it saves a launch, no more), or CPU runs bound by arithmetic.
Needs: nothing beyond PyTorch (``torch.func`` for ensembles).

Nothing is swapped: the rung rewrites the source of each user module's ``forward`` through
:mod:`speedkit.rewrite` and binds the new function to the instance, so parameters, state dicts and
optimizers are untouched; the runtime in :mod:`speedkit.ops` concatenates/stacks the live
parameters on every call, differentiably. Recognised, statically and conservatively:

1. ``self.A(x)``, ``self.B(x)``, … (same plain name ``x``, no keywords) in the values of statements
   of one block, ``x`` and ``self`` attributes not stored in between → one
   ``ops.fused_linear(x, (self.A, self.B, …))`` before the first, each call replaced by its output.
2. ``[h(x) for h in self.heads]`` → one fused Linear when the list holds Linears of one input
   width, else ``ops.ensemble`` (vmap over stacked weights) when its members are identical.
3. ``for i in range(N):`` with exactly one statement, ``out[i] = a[i] @ b[i]`` (or ``torch.matmul``,
   ``torch.bmm``, an operand shared by all slices, ``self.layers[i](x[i])``) or
   ``outs.append(…)`` → one ``ops.loop_matmul``/``ops.loop_linear``; ``outs = []`` … ``torch.stack(outs)``
   around the loop becomes the batched result itself.

What each instance gets is decided at apply time (the Linears must be plain ``nn.Linear`` without
hooks, of one input width, dtype and device; ensemble members identical in structure, parameters
and attributes, with no running statistics or dropout). Everything else, and every near miss
(other loop forms, more statements, a loop variable read afterwards), is left as it was and named
in the report with its reason.
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speedkit import rewrite
from speedkit.rewrite import NotRewritable, ParsedForward, call_ops
from speedkit.rungs.base import Handle, Rung, nested
from speedkit.state import TrainState

NOTHING_FOUND = "no sibling Linears, per-slice GEMM loops or module ensembles found"

#: statements whose value may hold sibling Linear calls
_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)
#: other scopes: their bodies run at another time, with other names
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
#: sub-expressions evaluated zero or many times when their parent is evaluated once
_NOT_ONCE = (*_SCOPES, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.IfExp, ast.BoolOp,
             ast.Compare, ast.Await, ast.Yield, ast.YieldFrom)
#: inner loops are reported on their own
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_GEMM_CALLS = {"matmul", "bmm", "mm", "mv", "einsum", "linear", "addmm", "baddbmm", "addbmm"}


@dataclass
class BatchedOptions:
    """Options of the batched rung: which forms it may rewrite."""

    #: sibling Linears on one input, and ModuleLists of Linears (``fused_linear``)
    linears: bool = True
    #: ``for i in range(N)`` loops of per-slice matmuls / Linears (``loop_matmul``, ``loop_linear``)
    loops: bool = True
    #: ensembles of identical modules applied to one input (``ensemble``, vmap)
    ensembles: bool = True


# -- static analysis: what the source of one forward offers -----------------------------------------


@dataclass
class _Site:
    """One candidate in a forward's AST. Nodes belong to the tree the finder walked."""

    kind: str  # "siblings" | "list" | "loop"
    line: int
    block: list[ast.stmt]
    # siblings: (attr, call, statement) per member, in order
    input: str = ""
    members: list[tuple[str, ast.Call, ast.stmt]] = field(default_factory=list)
    # list: the comprehension, the ModuleList attribute, the call's arguments
    node: ast.expr | None = None
    attr: str = ""
    args: list[ast.expr] = field(default_factory=list)
    # loop: "matmul" | "linear"; "store" | "extend" | "stack"
    loop: ast.For | None = None
    op: str = ""
    form: str = ""
    count: ast.expr | None = None
    operands: list[tuple[ast.expr, bool]] = field(default_factory=list)
    target: ast.expr | None = None
    init: ast.stmt | None = None
    stack_call: ast.Call | None = None
    #: global names that must resolve to the torch module / builtins at apply time
    torch_names: set[str] = field(default_factory=set)
    builtin_names: set[str] = field(default_factory=set)


@dataclass
class _Note:
    """A near miss: found, left alone, with the reason.

    Shown only where it concerns Linears: ``needs_linears`` names a ModuleList that must hold
    them, ``needs_linear_attrs`` attributes of which at least two must be ``nn.Linear``.
    """

    line: int
    reason: str
    needs_linears: str | None = None
    needs_linear_attrs: tuple[str, ...] = ()


def _walk(node: ast.AST, skip: tuple[type, ...] = _SCOPES) -> Any:
    """``ast.walk`` in source order that does not enter the node types in ``skip``."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, skip):
            yield from _walk(child, skip)


def _simple(node: ast.AST) -> bool:
    """A name, attribute chain or constant index on one (``x``, ``self.weight``, ``w.mT``, ``ws[0]``):
    pure and cheap, so evaluating it once instead of once per iteration changes nothing."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Subscript) and not (isinstance(node.slice, ast.Name)
                                                    or isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
            return False
        node = node.value
    return isinstance(node, ast.Name)


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _short(node: ast.AST, limit: int = 40) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _child_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [getattr(stmt, name) for name in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, name, None), list)]
    blocks += [h.body for h in getattr(stmt, "handlers", [])]
    blocks += [c.body for c in getattr(stmt, "cases", [])]
    return [b for b in blocks if b and isinstance(b[0], ast.stmt)]


class _Finder:
    """Finds the sites (and near misses) of one forward, deterministically: the same on any copy."""

    def __init__(self, tree: ast.FunctionDef, self_name: str) -> None:
        self.tree, self.self_name = tree, self_name
        self.sites: list[_Site] = []
        self.notes: list[_Note] = []
        #: every name node, nested scopes included: a lambda reading a name after the loop reads it too
        self._names = [n for stmt in tree.body for n in ast.walk(stmt) if isinstance(n, ast.Name)]
        self._inplace = self._inplace_names()

    def run(self) -> _Finder:
        self._block(self.tree.body)
        self._comprehensions()
        return self

    # -- blocks: sibling groups and loops ------------------------------------------------------
    def _block(self, block: list[ast.stmt]) -> None:
        groups: dict[str, list[tuple[str, ast.Call, ast.stmt]]] = {}
        for stmt in block:
            if isinstance(stmt, (ast.For, ast.AsyncFor)):
                self._loop(stmt, block)
            self._siblings_step(stmt, block, groups)
            for child in _child_blocks(stmt):
                self._block(child)
        for x in list(groups):
            self._close(groups, x, block)

    def _linear_call(self, node: ast.AST) -> tuple[str, str] | None:
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords \
                and isinstance(node.args[0], ast.Name) and node.args[0].id != self.self_name:
            attr = rewrite.self_attribute(node.func, self.self_name)
            if attr is not None:
                return attr, node.args[0].id
        return None

    def _siblings_step(self, stmt: ast.stmt, block: list[ast.stmt], groups: dict) -> None:
        stored = rewrite.names_stored(stmt)
        touches_self = self.self_name in stored or any(
            isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, (ast.Store, ast.Del)) and _root(n) == self.self_name
            for n in ast.walk(stmt))
        if touches_self:  # a Linear (or its weight) may be replaced here: no group spans this statement
            for x in list(groups):
                self._close(groups, x, block)
            return
        if isinstance(stmt, _SIMPLE) and stmt.value is not None:
            walrus = {n.target.id for n in ast.walk(stmt) if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name)}
            for x in walrus & set(groups):
                self._close(groups, x, block)
            for node in _walk(stmt.value, _NOT_ONCE):
                found = self._linear_call(node)
                if found is not None and found[1] not in walrus:
                    groups.setdefault(found[1], []).append((found[0], node, stmt))
        for x in stored & set(groups):  # targets are stored after the value is computed
            self._close(groups, x, block)

    def _close(self, groups: dict, x: str, block: list[ast.stmt]) -> None:
        members = groups.pop(x)
        if len(members) < 2:
            return
        line = members[0][2].lineno
        targets = {n.id for _, _, st in members for t in getattr(st, "targets", [getattr(st, "target", None)]) if t is not None
                   for n in ast.walk(t) if isinstance(n, ast.Name)}
        modified = sorted(targets & self._inplace)
        if not modified:
            calls = {id(c) for _, c, _ in members}
            modified = [_short(n.func) for _, _, st in members for n in ast.walk(st)
                        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and _inplace_method(n.func.attr)
                        and any(id(m) in calls for m in ast.walk(n.func.value))]
        if modified:
            attrs = tuple(a for a, _, _ in members)
            self.notes.append(_Note(line, f"Linears {', '.join(attrs)} on {x}: {', '.join(modified)} modified in place, "
                                          "and fused outputs are views of one tensor", needs_linear_attrs=attrs))
            return
        self.sites.append(_Site("siblings", line, block, input=x, members=members))

    def _inplace_names(self) -> set[str]:
        """Names the function modifies in place (``q += …``, ``q[…] = …``, ``q.mul_(…)``, ``out=q``)."""
        names: set[str] = set()
        for stmt in self.tree.body:
            for n in _walk(stmt):
                if isinstance(n, ast.AugAssign):
                    names.add(_root(n.target) or "")
                elif isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store):
                    names.add(_root(n) or "")
                elif isinstance(n, ast.Call):
                    if isinstance(n.func, ast.Attribute) and _inplace_method(n.func.attr):
                        names.add(_root(n.func.value) or "")
                    names.update(_root(k.value) or "" for k in n.keywords if k.arg == "out")
        return names

    # -- loops -----------------------------------------------------------------------------------
    def _loop(self, loop: ast.For | ast.AsyncFor, block: list[ast.stmt]) -> None:
        gemms, indexed_modules = False, []
        for stmt in loop.body:
            for n in [] if isinstance(stmt, _LOOPS) else _walk(stmt, (*_SCOPES, *_LOOPS)):
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult) \
                        or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _GEMM_CALLS:
                    gemms = True
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and rewrite.self_attribute(n.func.value, self.self_name):
                    indexed_modules.append(rewrite.self_attribute(n.func.value, self.self_name))
        if not gemms and not indexed_modules:
            self._module_loop(loop)
            return
        # `self.blocks[i](x)` concerns this rung only where the list holds Linears
        needs = None if gemms else indexed_modules[0]

        def note(reason: str) -> None:
            self.notes.append(_Note(loop.lineno, reason, needs))

        it = loop.iter
        is_range = isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
        if not is_range or isinstance(loop, ast.AsyncFor):
            note(f"loop over {_short(it)}: only `for i in range(N)` loops are rewritten")
            return
        if len(it.args) != 1 or it.keywords or isinstance(it.args[0], ast.Starred):
            note(f"loop over {_short(it)}: only range with one argument, range(N), is rewritten")
            return
        if not isinstance(loop.target, ast.Name) or loop.orelse:
            note("loop with a tuple target or an else clause")
            return
        if len(loop.body) != 1:
            note(f"loop body has {len(loop.body)} statements; only one `out[i] = …` or `outs.append(…)` is rewritten")
            return
        i, stmt = loop.target.id, loop.body[0]
        inside = {id(n) for n in ast.walk(loop)}
        if any(n.id == i and isinstance(n.ctx, ast.Load) and id(n) not in inside for n in self._names):
            note(f"loop variable {i!r} is read outside the loop")
            return
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript) \
                and isinstance(stmt.targets[0].slice, ast.Name) and stmt.targets[0].slice.id == i and _simple(stmt.targets[0].value):
            form, target, value = "store", stmt.targets[0].value, stmt.value
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute) \
                and stmt.value.func.attr == "append" and isinstance(stmt.value.func.value, ast.Name) \
                and len(stmt.value.args) == 1 and not stmt.value.keywords:
            form, target, value = "extend", stmt.value.func.value, stmt.value.args[0]
        else:
            note("loop body is not `out[i] = …` or `outs.append(…)`")
            return
        site = _Site("loop", loop.lineno, block, loop=loop, form=form, count=it.args[0], target=target, builtin_names={"range"})
        reason = self._gemm(value, i, site)
        written = ast.unparse(target)
        if reason is None and any(ast.unparse(e) == written or isinstance(target, ast.Name) and _root(e) == target.id
                                  for e, _ in site.operands):
            reason = f"the loop writes {written}, which it also reads"
        if reason is not None:
            note(reason)
            return
        if form == "extend":
            self._stack_form(site, block)
        self.sites.append(site)

    def _gemm(self, value: ast.expr, i: str, site: _Site) -> str | None:
        """Fill ``site.op``/``operands`` from the per-slice product, or say why it is not one."""
        func = value.func if isinstance(value, ast.Call) else None
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.MatMult):
            site.op, pair = "matmul", [value.left, value.right]
        elif isinstance(func, ast.Attribute) and func.attr in ("matmul", "bmm") and isinstance(func.value, ast.Name) \
                and len(value.args) == 2 and not value.keywords:
            site.op, pair = "matmul", list(value.args)
            site.torch_names.add(func.value.id)
        elif isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Name) and func.slice.id == i \
                and rewrite.self_attribute(func.value, self.self_name) and len(value.args) == 1 and not value.keywords:
            site.op, site.attr, pair = "linear", rewrite.self_attribute(func.value, self.self_name) or "", list(value.args)
        else:
            return f"per-slice statement `{_short(value)}` is not one matmul (a[i] @ b[i], torch.matmul, torch.bmm) or self.layers[i](x)"
        for operand in pair:
            if isinstance(operand, ast.Subscript) and isinstance(operand.slice, ast.Name) and operand.slice.id == i \
                    and _simple(operand.value) and i not in rewrite.names_loaded(operand.value):
                site.operands.append((operand.value, True))
            elif _simple(operand) and i not in rewrite.names_loaded(operand):
                site.operands.append((operand, False))
            else:
                return f"operand `{_short(operand)}` is neither x[{i}] nor a loop-invariant name, attribute or constant index"
        if site.op == "matmul" and not any(indexed for _, indexed in site.operands):
            return f"no operand is indexed by {i!r}"
        return None

    def _stack_form(self, site: _Site, block: list[ast.stmt]) -> None:
        """``outs = []`` before, ``torch.stack(outs)`` after and no other use: the batch is the stack."""
        outs = site.target.id  # type: ignore[union-attr]
        uses = [n for n in self._names if n.id == outs]
        stores = [n for n in uses if not isinstance(n.ctx, ast.Load)]
        if len(uses) != 3 or len(stores) != 1:
            return
        at = block.index(site.loop)
        init = next((st for st in block[:at] if isinstance(st, ast.Assign) and len(st.targets) == 1 and st.targets[0] is stores[0]
                     and isinstance(st.value, ast.List) and not st.value.elts), None)
        if init is None:
            return
        for stmt in block[at + 1:]:
            if not isinstance(stmt, _SIMPLE):
                continue
            for n in _walk(stmt, (*_SCOPES, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "stack" \
                        and isinstance(n.func.value, ast.Name) and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == outs \
                        and _dim_zero(n.args[1:], n.keywords):
                    site.form, site.init, site.stack_call = "stack", init, n
                    site.torch_names.add(n.func.value.id)
                    return

    def _module_loop(self, loop: ast.For | ast.AsyncFor) -> None:
        """``for h in self.heads: … h(x) …``: reported when the list turns out to hold Linears."""
        it = loop.iter
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id in ("enumerate", "zip") and it.args:
            it = it.args[0]
        attr = rewrite.self_attribute(it, self.self_name)
        bound = rewrite.names_stored(loop.target)
        calls = [n for stmt in loop.body for n in _walk(stmt) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in bound]
        if attr is None or not calls:
            return
        chained = any(rewrite.names_loaded(ast.Tuple(elts=c.args, ctx=ast.Load())) & rewrite.names_stored(stmt) for c in calls for stmt in loop.body)
        if chained:
            reason = f"loop over self.{attr}: each iteration feeds the next, a chain (not batchable)"
        else:
            reason = f"loop over self.{attr}: only `for i in range(N)` loops are rewritten (a comprehension `[h(x) for h in self.{attr}]` is)"
        self.notes.append(_Note(loop.lineno, reason, attr))

    # -- comprehensions over a ModuleList ------------------------------------------------------------
    def _comprehensions(self) -> None:
        for stmt in self.tree.body:
            for n in _walk(stmt):
                if not (isinstance(n, ast.ListComp) and len(n.generators) == 1):
                    continue
                gen = n.generators[0]
                attr = rewrite.self_attribute(gen.iter, self.self_name)
                if attr is None or not isinstance(gen.target, ast.Name):
                    continue
                h, elt = gen.target.id, n.elt
                if gen.ifs or gen.is_async or not isinstance(elt, ast.Call) or not (isinstance(elt.func, ast.Name) and elt.func.id == h) \
                        or elt.keywords or not elt.args \
                        or not all(_simple(a) and h not in rewrite.names_loaded(a) for a in elt.args):
                    if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == h for c in ast.walk(elt)):
                        self.notes.append(_Note(n.lineno, f"`{_short(n, 60)}`: only `[h(x) for h in self.{attr}]` "
                                                          "(plain-name arguments, no condition) is rewritten", attr))
                    continue
                self.sites.append(_Site("list", n.lineno, [], node=n, attr=attr, args=list(elt.args)))


def _inplace_method(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _dim_zero(args: list[ast.expr], keywords: list[ast.keyword]) -> bool:
    values = list(args) + [k.value for k in keywords if k.arg == "dim"]
    if len(values) != len(args) + len(keywords) or len(values) > 1:
        return False
    return not values or (isinstance(values[0], ast.Constant) and values[0].value == 0 and type(values[0].value) is int)


# -- per class (cached) and per instance ------------------------------------------------------------


@dataclass
class _ClassAnalysis:
    parsed: ParsedForward | None
    sites: list[_Site]
    notes: list[_Note]
    #: why the forward cannot be rewritten, when its source has candidates nonetheless
    error: str | None = None

    def where(self, line: int) -> str:
        cls = self.parsed.cls.__name__ if self.parsed else "?"
        file = os.path.basename(self.parsed.filename) if self.parsed else "?"
        return f"{cls} ({file}:{line})"


def _analyze_module(module: nn.Module) -> _ClassAnalysis:
    """The analysis of what this instance runs: its class's forward, or an earlier rung's rewrite of it."""
    try:
        parsed = rewrite.parse_module_forward(module)
    except NotRewritable as exc:
        return _ClassAnalysis(None, [], [], error=str(exc) if _source_has_candidates(type(module)) else None)
    return _analyze(parsed)


@functools.lru_cache(maxsize=None)
def _analyze(parsed: ParsedForward) -> _ClassAnalysis:
    if parsed.function.__module__.split(".")[0] in ("torch", "lightning", "pytorch_lightning"):
        return _ClassAnalysis(None, [], [])  # inherited from a library's module: not the user's code
    finder = _Finder(parsed.tree, parsed.self_name).run()
    return _ClassAnalysis(parsed, finder.sites, finder.notes)


def _source_has_candidates(cls: type) -> bool:
    """For a forward speedkit cannot rewrite: would its source have offered anything?"""
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
        args = tree.args.posonlyargs + tree.args.args  # type: ignore[attr-defined]
        finder = _Finder(tree, args[0].arg).run()  # type: ignore[arg-type]
        return bool(finder.sites)
    except Exception:  # no source, no self argument, … : nothing to say
        return False


def _resolve(function: Any, name: str) -> Any:
    """What a global-looking name in ``function`` refers to: a closure cell, a global, or a builtin."""
    code = function.__code__
    if name in code.co_freevars:
        return function.__closure__[code.co_freevars.index(name)].cell_contents
    if name in function.__globals__:
        return function.__globals__[name]
    return getattr(builtins, name, None)


def _hook_reason(module: nn.Module) -> str | None:
    for kind in ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks"):
        if getattr(module, f"_{kind}", None):
            return f"has {kind.replace('_', ' ')[:-1]}"
    if "forward" in module.__dict__:
        return "has an instance-level forward"
    return None


def _linear_reason(module: Any, label: str) -> str | None:
    if type(module) is not nn.Linear:
        return f"{label} is a {type(module).__name__}, not an nn.Linear"
    reason = _hook_reason(module)
    return f"{label} {reason}" if reason else None


def _linear_key(lin: nn.Linear) -> tuple:
    return lin.in_features, lin.weight.dtype, lin.weight.device, lin.bias is not None


def _key_difference(key: tuple, other: tuple) -> str:
    for name, mine, theirs in zip(("in_features", "dtype", "device"), key, other):
        if mine != theirs:
            return f"{name} {mine} where the others have {theirs}"
    return "no bias where the others have one" if not key[3] else "a bias where the others have none"


def _ensemble_reason(members: list[nn.Module]) -> str | None:
    """Why vmap over stacked weights of ``members`` would not compute what calling each does."""
    internals = set(nn.Module().__dict__) | {"training"}
    base = members[0]

    def signature(m: nn.Module) -> tuple:
        return ([(n, type(s)) for n, s in m.named_modules()],
                [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in m.named_parameters()],
                [(n, b.shape, b.dtype, b.device) for n, b in m.named_buffers()])

    wanted = signature(base)
    for k, m in enumerate(members):
        if type(m) is not type(base) or signature(m) != wanted:
            return f"member {k} differs from member 0 in structure, parameter or buffer shapes"
        for name, sub in m.named_modules():
            label = f"member {k}{'.' + name if name else ''}"
            reason = _hook_reason(sub)
            if reason:
                return f"{label} {reason}"
            if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats:
                return f"{label} keeps running statistics (updated in place per member)"
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                return f"{label} uses dropout (random masks would differ from the loop's)"
            twin = base.get_submodule(name)
            for key, value in vars(sub).items():
                if key in internals:
                    continue
                other = vars(twin).get(key)
                same = value is other or (isinstance(value, (int, float, str, bool, type(None), tuple, list))
                                          and type(value) is type(other) and value == other)
                if not same:
                    return f"{label}.{key} differs from member 0's"
    return None


def _module_list(module: nn.Module, attr: str) -> nn.ModuleList | None:
    value = getattr(module, attr, None)
    return value if isinstance(value, nn.ModuleList) else None


def _decide(module: nn.Module, analysis: _ClassAnalysis, options: BatchedOptions) -> tuple[tuple, list[str], list[str]]:
    """Per site of the class: the decision for this instance (None = left alone), what it does, and near misses."""
    parsed = analysis.parsed
    assert parsed is not None
    decisions: list[Any] = []
    done: list[str] = []
    notes: list[str] = []

    def skip(site: _Site, reason: str) -> None:
        decisions.append(None)
        notes.append(f"{analysis.where(site.line)}: {reason}")

    for note in analysis.notes:
        if note.needs_linears is not None:
            lst = _module_list(module, note.needs_linears)
            if lst is None or not len(lst) or not all(isinstance(m, nn.Linear) for m in lst):
                continue
        if note.needs_linear_attrs and sum(isinstance(getattr(module, a, None), nn.Linear) for a in note.needs_linear_attrs) < 2:
            continue
        notes.append(f"{analysis.where(note.line)}: {note.reason}")
    arguments = {a.arg for a in ast.walk(parsed.tree.args) if isinstance(a, ast.arg)}
    for site in analysis.sites:
        shadowed = [n for n in site.torch_names if _resolve(parsed.function, n) is not torch] + \
                   [n for n in site.builtin_names if _resolve(parsed.function, n) is not getattr(builtins, n)]
        local = (site.torch_names | site.builtin_names) & (rewrite.names_stored(parsed.tree) | arguments)
        if shadowed or local:
            skip(site, f"`{sorted(set(shadowed) | local)[0]}` does not refer to what it seems")
        elif site.kind == "siblings":
            if not options.linears:
                decisions.append(None)
                continue
            # other modules called on the same input (norms, dropout, blocks) are no candidates at all
            mods = [getattr(module, attr, None) for attr, _, _ in site.members]
            linears = [j for j, m in enumerate(mods) if isinstance(m, nn.Linear)]
            if len(linears) < 2:
                decisions.append(None)
                continue
            by_key: dict[tuple, list[int]] = {}
            for j in linears:
                reason = _linear_reason(mods[j], f"self.{site.members[j][0]}")
                if reason:
                    notes.append(f"{analysis.where(site.members[j][2].lineno)}: not fused with its siblings on {site.input}: {reason}")
                else:
                    by_key.setdefault(_linear_key(mods[j]), []).append(j)
            fused = tuple(tuple(js) for js in by_key.values() if len(js) > 1)
            common = max(by_key, key=lambda key: len(by_key[key])) if by_key else None
            for key, js in by_key.items():
                if len(js) == 1 and len(by_key) > 1:
                    j = js[0]
                    notes.append(f"{analysis.where(site.members[j][2].lineno)}: self.{site.members[j][0]} not fused with its "
                                 f"siblings on {site.input}: {_key_difference(key, common)}")
            decisions.append(fused or None)
            done += [f"fused {','.join(site.members[j][0] for j in js)} Linear" for js in fused]
        elif site.kind == "list":
            lst = _module_list(module, site.attr)
            if lst is None:
                skip(site, f"self.{site.attr} is not an nn.ModuleList")
            elif len(lst) < 2:
                skip(site, f"self.{site.attr} holds {len(lst)} module(s): nothing to batch")
            elif len(site.args) == 1 and all(type(m) is nn.Linear for m in lst) \
                    and not any(_linear_reason(m, "") for m in lst) and len({_linear_key(m) for m in lst}) == 1:
                if options.linears:
                    decisions.append("linear")
                    done.append(f"fused {len(lst)} Linears of self.{site.attr}")
                else:
                    decisions.append(None)
            elif not options.ensembles:
                decisions.append(None)
            else:
                reason = _ensemble_reason(list(lst))
                if reason:
                    skip(site, f"self.{site.attr}: {reason}")
                else:
                    decisions.append("ensemble")
                    done.append(f"vmapped ensemble self.{site.attr} of {len(lst)} {type(lst[0]).__name__}")
        elif site.kind == "loop":
            if not options.loops:
                decisions.append(None)
                continue
            what = f"{'stacked ' if site.form == 'stack' else ''}loop over range({_short(site.count, 24)})"  # type: ignore[arg-type]
            if site.op == "linear":
                lst = _module_list(module, site.attr)
                reasons = [r for k, m in enumerate(lst or []) if (r := _linear_reason(m, f"self.{site.attr}[{k}]"))]
                if lst is None or not any(isinstance(m, nn.Linear) for m in lst):
                    decisions.append(None)  # a list of other modules (blocks, convs): no Linear candidate
                elif reasons:
                    skip(site, reasons[0])
                elif len({(_linear_key(m), m.out_features) for m in lst}) != 1:
                    skip(site, f"the Linears of self.{site.attr} differ in shape, dtype, device or bias")
                else:
                    decisions.append("loop")
                    done.append(f"{what} of self.{site.attr}[i] Linear → one batched GEMM")
            else:
                decisions.append("loop")
                done.append(f"{what} of matmuls → one batched matmul")
    # an instance already rewritten by another rung was analysed on that rewrite (rewrites stack);
    # a compiled or patched forward never gets here (parse_module_forward refuses it)
    return tuple(decisions), done, notes


# -- emitting the rewritten forward ---------------------------------------------------------------


def _name(id_: str, store: bool = False) -> ast.Name:
    return ast.Name(id=id_, ctx=ast.Store() if store else ast.Load())


class _Replace(ast.NodeTransformer):
    def __init__(self, mapping: dict[int, ast.expr]) -> None:
        self.mapping = mapping

    def visit(self, node: ast.AST) -> Any:
        new = self.mapping.get(id(node))
        return new if new is not None else self.generic_visit(node)


def _emit(tree: ast.FunctionDef, sites: list[_Site], decisions: tuple, self_name: str) -> None:
    """Rewrite ``tree`` (a copy) in place: the sites found in it, as decided."""
    replace: dict[int, ast.expr] = {}
    for k, (site, decision) in enumerate(zip(sites, decisions)):
        if decision is None:
            continue
        if site.kind == "siblings":
            for g, group in enumerate(decision):
                members = [site.members[j] for j in group]
                temps = [f"__sk_lin_{k}_{g}_{j}" for j in range(len(members))]
                first = min((st for _, _, st in members), key=site.block.index)
                linears = ast.Tuple(elts=[ast.Attribute(value=_name(self_name), attr=a, ctx=ast.Load()) for a, _, _ in members], ctx=ast.Load())
                fused = ast.Assign(targets=[ast.Tuple(elts=[_name(t, True) for t in temps], ctx=ast.Store())],
                                   value=call_ops("fused_linear", _name(site.input), linears))
                site.block.insert(site.block.index(first), ast.copy_location(fused, first))
                replace.update({id(call): _name(t) for t, (_, call, _) in zip(temps, members)})
        elif site.kind == "list":
            lst = site.node.generators[0].iter  # type: ignore[union-attr]
            if decision == "linear":  # a list display, not list(...): the user's globals may shadow builtins
                new: ast.expr = ast.List(elts=[ast.Starred(value=call_ops("fused_linear", site.args[0], lst), ctx=ast.Load())], ctx=ast.Load())
            else:
                new = call_ops("ensemble", lst, *site.args)
            replace[id(site.node)] = new
        else:
            n = f"__sk_n_{k}"
            if site.op == "matmul":
                (a, a_idx), (b, b_idx) = site.operands
                batched = call_ops("loop_matmul", a, b, _name(n), ast.Constant(a_idx), ast.Constant(b_idx))
            else:
                (x, x_idx), = site.operands
                layers = ast.Attribute(value=_name(self_name), attr=site.attr, ctx=ast.Load())
                batched = call_ops("loop_linear", layers, x, _name(n), ast.Constant(x_idx))
            stmts: list[ast.stmt] = [ast.Assign(targets=[_name(n, True)], value=site.count)]
            if site.form == "store":
                stmts.append(ast.Expr(call_ops("store_slices", site.target, _name(n), batched)))
            elif site.form == "extend":
                stmts.append(ast.Expr(ast.Call(func=ast.Attribute(value=site.target, attr="extend", ctx=ast.Load()),
                                               args=[call_ops("unstack", batched)], keywords=[])))
            else:
                stmts.append(ast.Assign(targets=[_name(f"__sk_batch_{k}", True)], value=call_ops("stack", batched)))
                site.block.remove(site.init)  # type: ignore[arg-type]
                replace[id(site.stack_call)] = _name(f"__sk_batch_{k}")
            at = site.block.index(site.loop)  # type: ignore[arg-type]
            site.block[at:at + 1] = [ast.copy_location(st, site.loop) for st in stmts]  # type: ignore[arg-type]
    if replace:
        _Replace(replace).visit(tree)


@functools.lru_cache(maxsize=None)
def _compiled(parsed: ParsedForward, decisions: tuple) -> Any:
    """The rewritten forward for one tuple of decisions (shared by all instances that run ``parsed``)."""
    tree = rewrite.copy_tree(parsed)
    sites = _Finder(tree, parsed.self_name).run().sites  # same walk, same order: site k of the copy is site k
    _emit(tree, sites, decisions, parsed.self_name)
    return rewrite.compile_forward(parsed, tree, "batched")


# -- the rung -------------------------------------------------------------------------------------


@dataclass
class _Plan:
    targets: list[tuple[nn.Module, tuple, list[str]]] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)

    @property
    def rewritten(self) -> int:
        return sum(len(done) for _, _, done in self.targets)

    @property
    def found(self) -> int:
        return self.rewritten + len(self.left_alone)


def plan_batched(model: nn.Module, options: BatchedOptions) -> _Plan:
    """Which instances get which rewrites, and what is left alone (cheap: the parsing is cached per class)."""
    plan = _Plan()
    inside_ensembles: set[int] = set()
    for module in model.modules():
        if id(module) in inside_ensembles or not rewrite.is_user_module(module):
            continue
        analysis = _analyze_module(module)
        if analysis.error is not None:
            plan.left_alone.append(f"{type(module).__name__}: {analysis.error}")
            continue
        if analysis.parsed is None or not (analysis.sites or analysis.notes):
            continue
        decisions, done, notes = _decide(module, analysis, options)
        plan.left_alone += notes
        if done:
            plan.targets.append((module, decisions, done))
        for site, decision in zip(analysis.sites, decisions):
            if decision == "ensemble":  # members run inside vmap through the base's own forward: leave them as they are
                inside_ensembles.update(id(m) for m in getattr(module, site.attr).modules())
    plan.left_alone = list(dict.fromkeys(plan.left_alone))
    return plan


def apply_batched(model: nn.Module, options: BatchedOptions, plan: _Plan | None = None) -> Handle:
    plan = plan if plan is not None else plan_batched(model, options)
    handle, bound = Handle("batched"), Handle("batched")
    try:
        for module, decisions, done in plan.targets:
            function = _compiled(_analyze_module(module).parsed, decisions)
            rewrite.bind_forward(bound, module, function, f"{type(module).__name__}.forward rewritten: {'; '.join(done)}")
    except Exception:
        bound.undo()
        raise
    per_class: dict[str, Counter[str]] = {}
    for module, _, done in plan.targets:
        per_class.setdefault(type(module).__name__, Counter()).update(done)
    summary = "; ".join(f"{cls}: " + ", ".join(f"{what} ×{count}" for what, count in counts.items())
                        for cls, counts in per_class.items())
    nested(handle, bound, f"batched: rewrote {plan.rewritten} sites in {len(plan.targets)} modules ({summary or 'none'})")
    for note in plan.left_alone:
        handle.record(f"left alone: {note}")
    handle.sites = {  # type: ignore[attr-defined]
        "found": plan.found, "rewritten": plan.rewritten, "modules": len(plan.targets),
        "rewrites": [f"{type(m).__name__}: {d}" for m, _, done in plan.targets for d in done],
        "left_alone": list(plan.left_alone),
    }
    return handle


class BatchedRung(Rung):
    """Rewrites sibling Linears, ModuleList heads/ensembles and per-slice GEMM loops into batched calls.

    ``check`` runs the (per-class cached) analysis and says why nothing applies; ``apply`` binds the
    rewritten forwards and returns a handle whose ``sites`` dict holds found/rewritten/left-alone.
    """

    name = "batched"
    judged_at_full_precision = True
    Options = BatchedOptions

    def check(self, state: TrainState) -> str | None:
        plan = plan_batched(state.model, self.options)
        if plan.found == 0:
            return NOTHING_FOUND
        if plan.rewritten == 0:
            return f"found {plan.found} candidate site(s), none rewritable: {'; '.join(plan.left_alone)}"
        return None

    def apply(self, state: TrainState) -> Handle:
        return apply_batched(state.model, self.options)
