"""batched's matcher: many small GEMMs written one by one in a method's source — sibling Linears on
one input, ``[h(x) for h in self.heads]``, ``for i in range(N)`` loops of per-slice products (see
:mod:`speedkit.rungs.batched`). Found statically and conservatively; near misses are kept as
:class:`Note` with their reason. What an instance decides and the emitter are in
:mod:`speedkit.rewrite.gemms_emit`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from speedkit.rewrite.ast_tools import SCOPES, child_blocks, names_loaded, names_stored, self_attribute, short, walk
from speedkit.rewrite.pipeline import Found
from speedkit.rewrite.source import ParsedMethod, is_user_code

#: statements whose value may hold sibling Linear calls
_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)
#: sub-expressions evaluated zero or many times when their parent is evaluated once
_NOT_ONCE = (
    *SCOPES,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.IfExp,
    ast.BoolOp,
    ast.Compare,
    ast.Await,
    ast.Yield,
    ast.YieldFrom,
)
#: inner loops are reported on their own
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_GEMM_CALLS = {"matmul", "bmm", "mm", "mv", "einsum", "linear", "addmm", "baddbmm", "addbmm"}


@dataclass
class Site:
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
class Note:
    """A near miss: found, left alone, with the reason.

    Shown only where it concerns Linears: ``needs_linears`` names a ModuleList that must hold
    them, ``needs_linear_attrs`` attributes of which at least two must be ``nn.Linear``.
    """

    line: int
    reason: str
    needs_linears: str | None = None
    needs_linear_attrs: tuple[str, ...] = ()


def simple(node: ast.AST) -> bool:
    """A name, attribute chain or constant index on one (``x``, ``self.weight``, ``w.mT``, ``ws[0]``):
    pure and cheap, so evaluating it once instead of once per iteration changes nothing."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Subscript) and not (
            isinstance(node.slice, ast.Name) or isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)
        ):
            return False
        node = node.value
    return isinstance(node, ast.Name)


def root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


class Finder:
    """Finds the sites (and near misses) of one forward, deterministically: the same on any copy."""

    def __init__(self, tree: ast.FunctionDef, self_name: str) -> None:
        self.tree, self.self_name = tree, self_name
        self.sites: list[Site] = []
        self.notes: list[Note] = []
        #: every name node, nested scopes included: a lambda reading a name after the loop reads it too
        self._names = [n for stmt in tree.body for n in ast.walk(stmt) if isinstance(n, ast.Name)]
        self._inplace = self._inplace_names()

    def run(self) -> Finder:
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
            for child in child_blocks(stmt):
                self._block(child)
        for x in list(groups):
            self._close(groups, x, block)

    def _linear_call(self, node: ast.AST) -> tuple[str, str] | None:
        if (
            isinstance(node, ast.Call)
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id != self.self_name
        ):
            attr = self_attribute(node.func, self.self_name)
            if attr is not None:
                return attr, node.args[0].id
        return None

    def _siblings_step(self, stmt: ast.stmt, block: list[ast.stmt], groups: dict) -> None:
        stored = names_stored(stmt)
        touches_self = self.self_name in stored or any(
            isinstance(n, (ast.Attribute, ast.Subscript))
            and isinstance(n.ctx, (ast.Store, ast.Del))
            and root(n) == self.self_name
            for n in ast.walk(stmt)
        )
        if touches_self:  # a Linear (or its weight) may be replaced here: no group spans this statement
            for x in list(groups):
                self._close(groups, x, block)
            return
        if isinstance(stmt, _SIMPLE) and stmt.value is not None:
            walrus = {n.target.id for n in ast.walk(stmt) if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name)}
            for x in walrus & set(groups):
                self._close(groups, x, block)
            for node in walk(stmt.value, _NOT_ONCE):
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
        targets = {
            n.id
            for _, _, st in members
            for t in getattr(st, "targets", [getattr(st, "target", None)])
            if t is not None
            for n in ast.walk(t)
            if isinstance(n, ast.Name)
        }
        modified = sorted(targets & self._inplace)
        if not modified:
            calls = {id(c) for _, c, _ in members}
            modified = [
                short(n.func)
                for _, _, st in members
                for n in ast.walk(st)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and _inplace_method(n.func.attr)
                and any(id(m) in calls for m in ast.walk(n.func.value))
            ]
        if modified:
            attrs = tuple(a for a, _, _ in members)
            self.notes.append(
                Note(
                    line,
                    f"Linears {', '.join(attrs)} on {x}: {', '.join(modified)} modified in place, "
                    "and fused outputs are views of one tensor",
                    needs_linear_attrs=attrs,
                )
            )
            return
        self.sites.append(Site("siblings", line, block, input=x, members=members))

    def _inplace_names(self) -> set[str]:
        """Names the function modifies in place (``q += …``, ``q[…] = …``, ``q.mul_(…)``, ``out=q``)."""
        names: set[str] = set()
        for stmt in self.tree.body:
            for n in walk(stmt):
                if isinstance(n, ast.AugAssign):
                    names.add(root(n.target) or "")
                elif isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store):
                    names.add(root(n) or "")
                elif isinstance(n, ast.Call):
                    if isinstance(n.func, ast.Attribute) and _inplace_method(n.func.attr):
                        names.add(root(n.func.value) or "")
                    names.update(root(k.value) or "" for k in n.keywords if k.arg == "out")
        return names

    # -- loops -----------------------------------------------------------------------------------
    def _loop(self, loop: ast.For | ast.AsyncFor, block: list[ast.stmt]) -> None:
        gemms, indexed_modules = False, []
        for stmt in loop.body:
            for n in [] if isinstance(stmt, _LOOPS) else walk(stmt, (*SCOPES, *_LOOPS)):
                if (
                    isinstance(n, ast.BinOp)
                    and isinstance(n.op, ast.MatMult)
                    or isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr in _GEMM_CALLS
                ):
                    gemms = True
                elif (
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and self_attribute(n.func.value, self.self_name)
                ):
                    indexed_modules.append(self_attribute(n.func.value, self.self_name))
        if not gemms and not indexed_modules:
            self._module_loop(loop)
            return
        # `self.blocks[i](x)` concerns this rung only where the list holds Linears
        needs = None if gemms else indexed_modules[0]

        def note(reason: str) -> None:
            self.notes.append(Note(loop.lineno, reason, needs))

        it = loop.iter
        is_range = isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
        if not is_range or isinstance(loop, ast.AsyncFor):
            note(f"loop over {short(it)}: only `for i in range(N)` loops are rewritten")
            return
        if len(it.args) != 1 or it.keywords or isinstance(it.args[0], ast.Starred):
            note(f"loop over {short(it)}: only range with one argument, range(N), is rewritten")
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
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Subscript)
            and isinstance(stmt.targets[0].slice, ast.Name)
            and stmt.targets[0].slice.id == i
            and simple(stmt.targets[0].value)
        ):
            form, target, value = "store", stmt.targets[0].value, stmt.value
        elif (
            isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Attribute)
            and stmt.value.func.attr == "append"
            and isinstance(stmt.value.func.value, ast.Name)
            and len(stmt.value.args) == 1
            and not stmt.value.keywords
        ):
            form, target, value = "extend", stmt.value.func.value, stmt.value.args[0]
        else:
            note("loop body is not `out[i] = …` or `outs.append(…)`")
            return
        site = Site("loop", loop.lineno, block, loop=loop, form=form, count=it.args[0], target=target, builtin_names={"range"})
        reason = self._gemm(value, i, site)
        written = ast.unparse(target)
        if reason is None and any(
            ast.unparse(e) == written or isinstance(target, ast.Name) and root(e) == target.id for e, _ in site.operands
        ):
            reason = f"the loop writes {written}, which it also reads"
        if reason is not None:
            note(reason)
            return
        if form == "extend":
            self._stack_form(site, block)
        self.sites.append(site)

    def _gemm(self, value: ast.expr, i: str, site: Site) -> str | None:
        """Fill ``site.op``/``operands`` from the per-slice product, or say why it is not one."""
        func = value.func if isinstance(value, ast.Call) else None
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.MatMult):
            site.op, pair = "matmul", [value.left, value.right]
        elif (
            isinstance(func, ast.Attribute)
            and func.attr in ("matmul", "bmm")
            and isinstance(func.value, ast.Name)
            and len(value.args) == 2
            and not value.keywords
        ):
            site.op, pair = "matmul", list(value.args)
            site.torch_names.add(func.value.id)
        elif (
            isinstance(func, ast.Subscript)
            and isinstance(func.slice, ast.Name)
            and func.slice.id == i
            and self_attribute(func.value, self.self_name)
            and len(value.args) == 1
            and not value.keywords
        ):
            site.op, site.attr, pair = "linear", self_attribute(func.value, self.self_name) or "", list(value.args)
        else:
            return f"per-slice statement `{short(value)}` is not one matmul (a[i] @ b[i], torch.matmul, torch.bmm) or self.layers[i](x)"
        for operand in pair:
            if (
                isinstance(operand, ast.Subscript)
                and isinstance(operand.slice, ast.Name)
                and operand.slice.id == i
                and simple(operand.value)
                and i not in names_loaded(operand.value)
            ):
                site.operands.append((operand.value, True))
            elif simple(operand) and i not in names_loaded(operand):
                site.operands.append((operand, False))
            else:
                return f"operand `{short(operand)}` is neither x[{i}] nor a loop-invariant name, attribute or constant index"
        if site.op == "matmul" and not any(indexed for _, indexed in site.operands):
            return f"no operand is indexed by {i!r}"
        return None

    def _stack_form(self, site: Site, block: list[ast.stmt]) -> None:
        """``outs = []`` before, ``torch.stack(outs)`` after and no other use: the batch is the stack."""
        outs = site.target.id  # type: ignore[union-attr]
        uses = [n for n in self._names if n.id == outs]
        stores = [n for n in uses if not isinstance(n.ctx, ast.Load)]
        if len(uses) != 3 or len(stores) != 1:
            return
        at = block.index(site.loop)
        init = next(
            (
                st
                for st in block[:at]
                if isinstance(st, ast.Assign)
                and len(st.targets) == 1
                and st.targets[0] is stores[0]
                and isinstance(st.value, ast.List)
                and not st.value.elts
            ),
            None,
        )
        if init is None:
            return
        for stmt in block[at + 1 :]:
            if not isinstance(stmt, _SIMPLE):
                continue
            for n in walk(stmt, (*SCOPES, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                if (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr == "stack"
                    and isinstance(n.func.value, ast.Name)
                    and n.args
                    and isinstance(n.args[0], ast.Name)
                    and n.args[0].id == outs
                    and _dim_zero(n.args[1:], n.keywords)
                ):
                    site.form, site.init, site.stack_call = "stack", init, n
                    site.torch_names.add(n.func.value.id)
                    return

    def _module_loop(self, loop: ast.For | ast.AsyncFor) -> None:
        """``for h in self.heads: … h(x) …``: reported when the list turns out to hold Linears."""
        it = loop.iter
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id in ("enumerate", "zip") and it.args:
            it = it.args[0]
        attr = self_attribute(it, self.self_name)
        bound = names_stored(loop.target)
        calls = [
            n
            for stmt in loop.body
            for n in walk(stmt)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in bound
        ]
        if attr is None or not calls:
            return
        chained = any(
            names_loaded(ast.Tuple(elts=c.args, ctx=ast.Load())) & names_stored(stmt) for c in calls for stmt in loop.body
        )
        if chained:
            reason = f"loop over self.{attr}: each iteration feeds the next, a chain (not batchable)"
        else:
            reason = f"loop over self.{attr}: only `for i in range(N)` loops are rewritten (a comprehension `[h(x) for h in self.{attr}]` is)"
        self.notes.append(Note(loop.lineno, reason, attr))

    # -- comprehensions over a ModuleList ------------------------------------------------------------
    def _comprehensions(self) -> None:
        for stmt in self.tree.body:
            for n in walk(stmt):
                if not (isinstance(n, ast.ListComp) and len(n.generators) == 1):
                    continue
                gen = n.generators[0]
                attr = self_attribute(gen.iter, self.self_name)
                if attr is None or not isinstance(gen.target, ast.Name):
                    continue
                h, elt = gen.target.id, n.elt
                if (
                    gen.ifs
                    or gen.is_async
                    or not isinstance(elt, ast.Call)
                    or not (isinstance(elt.func, ast.Name) and elt.func.id == h)
                    or elt.keywords
                    or not elt.args
                    or not all(simple(a) and h not in names_loaded(a) for a in elt.args)
                ):
                    if any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == h for c in ast.walk(elt)):
                        self.notes.append(
                            Note(
                                n.lineno,
                                f"`{short(n, 60)}`: only `[h(x) for h in self.{attr}]` "
                                "(plain-name arguments, no condition) is rewritten",
                                attr,
                            )
                        )
                    continue
                self.sites.append(Site("list", n.lineno, [], node=n, attr=attr, args=list(elt.args)))


def _inplace_method(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _dim_zero(args: list[ast.expr], keywords: list[ast.keyword]) -> bool:
    values = list(args) + [k.value for k in keywords if k.arg == "dim"]
    if len(values) != len(args) + len(keywords) or len(values) > 1:
        return False
    return not values or (isinstance(values[0], ast.Constant) and values[0].value == 0 and type(values[0].value) is int)


def find(parsed: ParsedMethod) -> Found:
    """The batchable GEMMs of ``parsed`` and its near misses; nothing in a library's own method."""
    if not is_user_code(parsed.function.__module__ or ""):
        return Found()  # inherited from a library's module: not the user's code
    finder = Finder(parsed.tree, parsed.self_name).run()
    return Found(finder.sites, finder.notes)
