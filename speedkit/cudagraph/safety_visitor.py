"""The reading of one function's source behind :mod:`speedkit.cudagraph.safety`: the AST visitor
that names each pattern a CUDA graph replay would get wrong, the patterns' tables and the
:class:`Blocker` it reports them as."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

_SYNC_METHODS = {
    "item": "reads a tensor's value on the host",
    "tolist": "copies a tensor to a Python list",
    "cpu": "copies a tensor to the host",
    "numpy": "copies a tensor to a NumPy array",
    "synchronize": "waits for the device",
}
_DYNAMIC = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "nonzero_static"}
_CONVERSIONS = {"bool", "float", "int"}
_CLOCKS = {("time", "time"), ("time", "perf_counter"), ("time", "monotonic"), ("time", "process_time")}
#: attributes of a tensor that are fixed for a captured step (a shape is the same every replay)
_STATIC_ATTRS = {
    "shape",
    "ndim",
    "dtype",
    "device",
    "requires_grad",
    "is_cuda",
    "training",
    "dim",
    "size",
    "numel",
    "nelement",
    "element_size",
    "itemsize",
    "stride",
    "layout",
    "is_floating_point",
    "is_complex",
    "is_contiguous",
    "is_sparse",
    "is_leaf",
    "is_quantized",
    "is_meta",
    "get_device",
}
#: a LightningModule's counters of the fit's progress: host numbers that change as it trains
_PROGRESS_ATTRS = {"global_step", "current_epoch"}
#: parameter names that carry the step's index (a host number that changes every step)
_INDEX_ARGS = {"batch_idx", "batch_nb", "batch_index", "dataloader_idx", "global_step", "current_epoch"}
#: calls that return a boolean tensor (a mask), as methods or ``torch.`` functions
_MASK_CALLS = {
    "bool",
    "eq",
    "ne",
    "gt",
    "ge",
    "lt",
    "le",
    "isfinite",
    "isnan",
    "isinf",
    "isposinf",
    "isneginf",
    "logical_and",
    "logical_or",
    "logical_not",
    "logical_xor",
    "isin",
    "isclose",
    "signbit",
}


@dataclass(frozen=True)
class Blocker:
    """One thing that would make a captured step replay wrong."""

    kind: str  # "host sync" | "dynamic shape" | "data-dependent control flow" | "host work"
    reason: str  # what it does, in words
    where: str  # "path/to/file.py:123 in training_step"
    code: str  # the source line

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}: {self.reason}" + (f" (`{self.code}`)" if self.code else "")


class _Visitor:
    """One pass over a function body, tracking which local names hold per-step values (tensors
    from the batch or the model, the batch index) to tell data-dependent branches from static ones."""

    def __init__(
        self,
        func: ast.FunctionDef | ast.AsyncFunctionDef,
        self_name: str | None,
        per_step_args: bool,
        path: str,
        start: int,
        lines: list[str],
        step_index: bool = False,
    ) -> None:
        self.func, self.self_name, self.path, self.start, self.lines = func, self_name, path, start, lines
        self.blockers: list[Blocker] = []
        self.helpers: list[tuple[str, str, ast.expr]] = []
        self.masks: set[str] = set()  # local names holding a boolean tensor
        self.masked_fills: set[int] = set()  # `t[mask] = number` targets (ids of their nodes)
        args = [a for a in func.args.args + func.args.posonlyargs + func.args.kwonlyargs if a.arg != self_name]
        # names holding host numbers that change every step (the batch index; training_step's
        # arguments after the batch): a graph bakes the capture's value into its kernels
        positional = [a.arg for a in func.args.posonlyargs + func.args.args if a.arg != self_name]
        self.host: set[str] = ({a.arg for a in args if a.arg in _INDEX_ARGS} if per_step_args else set()) | (
            set(positional[1:]) if step_index else set()
        )
        defaults = dict(zip([a.arg for a in (func.args.posonlyargs + func.args.args)][::-1], func.args.defaults[::-1]))
        defaults.update({a.arg: d for a, d in zip(func.args.kwonlyargs, func.args.kw_defaults) if d is not None})
        # arguments with a constant default are options (flags, sizes); the others carry the step's data
        self.dynamic: set[str] = {a.arg for a in args if per_step_args or not isinstance(defaults.get(a.arg), ast.Constant)}
        if func.args.vararg is not None:
            self.dynamic.add(func.args.vararg.arg)

    # -- walking ---------------------------------------------------------------------------------
    def visit_body(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            self.visit_stmt(stmt)

    def visit_stmt(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.ClassDef):
            return  # a nested class: its methods run when called; not scanned
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # a closure (an optimizer's, a hook): run when called, within the step; its arguments are per-step
            for arg in stmt.args.posonlyargs + stmt.args.args + stmt.args.kwonlyargs:
                self.dynamic.add(arg.arg)
            self.visit_body(stmt.body)
            return
        if isinstance(stmt, (ast.If, ast.While)):
            self._check_branch(stmt.test, "if" if isinstance(stmt, ast.If) else "while")
            self.visit_expr(stmt.test)
            self.visit_body(stmt.body)
            self.visit_body(stmt.orelse)
            return
        if isinstance(stmt, ast.Assert):
            self._check_branch(stmt.test, "assert")
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Return, ast.Expr)) and stmt.value is not None:
            self._check_host_number(stmt, _value_read(stmt))
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            self._assignment(stmt)
            if isinstance(stmt, ast.Assign) and self._host_scalar(stmt.value):
                # `t[mask] = 0.0`: a Python number through one boolean mask is a masked_fill_, the same kernel every step
                for target in stmt.targets:
                    if isinstance(target, ast.Subscript) and self._one_mask(target.slice):
                        self.masked_fills.add(id(target))
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            # a loop over a tensor or the batch's structure runs as many times as its shape or
            # structure says, both the same every replay; a range of per-step numbers does not
            counts = [
                a
                for n in ast.walk(stmt.iter)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "range"
                for a in n.args
            ]
            if any(self._is_dynamic(a) for a in counts) or self._is_host(stmt.iter):
                self._add(
                    stmt, "data-dependent control flow", "loops over a per-step value: the iterations of the capture are replayed"
                )
            self.visit_expr(stmt.iter)
            self.visit_body(stmt.body)
            self.visit_body(stmt.orelse)
            return
        if isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)):
            for item in getattr(stmt, "items", []):
                self._check_host_number(stmt, item.context_expr)
                self.visit_expr(item.context_expr)
            for block in ("body", "orelse", "finalbody"):
                self.visit_body(getattr(stmt, block, []))
            for handler in getattr(stmt, "handlers", []):
                self.visit_body(handler.body)
            return
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.expr):
                self.visit_expr(child)

    def visit_expr(self, expr: ast.expr) -> None:
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                self._call(node)
            elif isinstance(node, ast.Subscript) and self._is_mask(node.slice) and id(node) not in self.masked_fills:
                self._add(node, "dynamic shape", "indexes with a boolean mask: the result's size depends on the data")
            elif isinstance(node, ast.IfExp):
                self._check_branch(node.test, "conditional expression")

    # -- what is per-step --------------------------------------------------------------------------
    def _assignment(self, stmt: ast.Assign | ast.AnnAssign | ast.AugAssign) -> None:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        value = stmt.value
        for target in targets:
            if self._on_self(target):
                self._add(
                    stmt, "host work", f"changes `{ast.unparse(target)}` on the host: done once, at capture, not every step"
                )
        if value is None:
            return
        value = _value_read(stmt)
        dynamic = self._is_dynamic(value) or self._calls_model(value)
        host = self._is_host(value) and self._only_host(value)
        mask = isinstance(stmt, (ast.Assign, ast.AnnAssign)) and self._is_mask(value)
        for target in targets:
            # the names the assignment binds; `x[i] = v` and `obj.a = v` bind none (x stays what it was)
            for node in _bound_names(target):
                (self.dynamic.add if dynamic else self.dynamic.discard)(node.id)
                (self.host.add if host else self.host.discard)(node.id)
                (self.masks.add if mask and node is target else self.masks.discard)(node.id)

    def _is_dynamic(self, expr: ast.expr) -> bool:
        """Whether ``expr`` reads a per-step value (other than its static attributes)."""
        for node in _walk_skipping_static(expr):
            if isinstance(node, ast.Name) and node.id in self.dynamic:
                return True
            if self._is_progress(node):
                return True
        return False

    def _is_progress(self, node: ast.AST) -> bool:
        """``self.global_step``, ``self.trainer.current_epoch`` and the like."""
        if not (isinstance(node, ast.Attribute) and node.attr in _PROGRESS_ATTRS and self.self_name is not None):
            return False
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id == self.self_name

    def _host_reads(self, expr: ast.expr) -> list[ast.expr]:
        """Where ``expr`` reads a host number that changes every step (the batch index, the global step),
        not counting one passed on as it is to a call (``self.shared_step(batch, batch_idx)``: the
        callee's own code is read for what it does with it)."""
        passed = {
            id(a)
            for n in ast.walk(expr)
            if isinstance(n, ast.Call)
            for a in [*n.args, *(k.value for k in n.keywords)]
            if isinstance(a, ast.Name)
        }
        return [
            n
            for n in _walk_skipping_static(expr)
            if id(n) not in passed and ((isinstance(n, ast.Name) and n.id in self.host) or self._is_progress(n))
        ]

    def _is_host(self, expr: ast.expr) -> bool:
        return bool(self._host_reads(expr))

    def _only_host(self, expr: ast.expr) -> bool:
        """Whether ``expr`` computes on the host alone: no tensor among its per-step values, no call into torch or the model."""
        names = {n.id for n in _walk_skipping_static(expr) if isinstance(n, ast.Name) and n.id in self.dynamic}
        return names <= self.host and not self._calls_model(expr)

    def _check_host_number(self, stmt: ast.stmt, value: ast.expr) -> None:
        if self._is_host(value) and not self._only_host(value):
            names = sorted({ast.unparse(n) for n in self._host_reads(value)})
            self._add(
                stmt,
                "data-dependent control flow",
                f"computes with a host number that changes every step ({', '.join(names)}): the capture's value "
                "is baked into the graph and replayed every step",
            )

    def _host_scalar(self, expr: ast.expr) -> bool:
        """A Python number: a constant, ``float('-inf')``, ``-1``, a name or attribute not holding a per-step value."""
        if isinstance(expr, ast.Constant):
            return isinstance(expr.value, (int, float)) and not isinstance(expr.value, bool)
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, (ast.USub, ast.UAdd)):
            return self._host_scalar(expr.operand)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("float", "int"):
            return all(isinstance(a, ast.Constant) for a in expr.args)
        if (
            isinstance(expr, ast.Attribute)
            and expr.attr in ("min", "max", "eps", "tiny")
            and isinstance(expr.value, ast.Call)
            and ast.unparse(expr.value.func).endswith(("finfo", "iinfo"))
        ):
            return True
        if isinstance(expr, (ast.Name, ast.Attribute)):
            return not self._is_dynamic(expr)
        return False

    def _calls_model(self, expr: ast.expr) -> bool:
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                root = node.func
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in ("torch", "F", self.self_name):
                    return True
        return False

    def _on_self(self, target: ast.expr) -> bool:
        node = target.value if isinstance(target, ast.Subscript) else target
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == self.self_name
            and self.self_name is not None
        )

    def _is_mask(self, index: ast.expr) -> bool:
        """Whether ``index`` is a boolean tensor (or a tuple of indices holding one)."""
        if isinstance(index, ast.Compare):
            return not all(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in index.ops)
        if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.Invert):
            return True
        if isinstance(index, ast.BinOp) and isinstance(index.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            return self._is_mask(index.left) or self._is_mask(index.right)
        if isinstance(index, ast.Name):
            return index.id in self.masks
        if isinstance(index, ast.Tuple):
            return any(self._is_mask(e) for e in index.elts)
        if isinstance(index, ast.Call) and isinstance(index.func, ast.Attribute) and index.func.attr in _MASK_CALLS:
            return ast.unparse(index.func.value) not in ("np", "numpy", "math")
        return False

    def _one_mask(self, index: ast.expr) -> bool:
        """One boolean mask, beside basic indices only (``mask``, ``mask, :``): what ``index_put_`` makes a ``masked_fill_``."""
        parts = index.elts if isinstance(index, ast.Tuple) else [index]
        masks = [p for p in parts if self._is_mask(p)]
        return len(masks) == 1 and all(p in masks or isinstance(p, (ast.Slice, ast.Constant)) for p in parts)

    # -- patterns ---------------------------------------------------------------------------------
    def _check_branch(self, test: ast.expr, what: str) -> None:
        if self._is_dynamic(test):
            names = sorted(
                {
                    ast.unparse(n)
                    for n in _walk_skipping_static(test)
                    if (isinstance(n, ast.Name) and n.id in self.dynamic) or self._is_progress(n)
                }
            )
            self._add(
                test,
                "data-dependent control flow",
                f"{what} on a per-step value ({', '.join(names)}): the branch taken at capture is replayed every step",
            )

    def _call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        if name is None:
            return
        if isinstance(func, ast.Attribute) and name in _SYNC_METHODS and not (name == "synchronize" and "cuda" not in owner):
            self._add(node, "host sync", f"`.{name}()` {_SYNC_METHODS[name]}")
        elif name == "to" and any(_is_cpu(a) for a in [*node.args, *(k.value for k in node.keywords if k.arg == "device")]):
            self._add(node, "host sync", "`.to('cpu')` copies a tensor to the host")
        elif name in _DYNAMIC:
            self._add(node, "dynamic shape", f"`{name}` returns a tensor whose size depends on the data")
        elif name == "where" and len(node.args) == 1 and not node.keywords:
            self._add(node, "dynamic shape", "`torch.where(condition)` returns indices whose count depends on the data")
        elif name == "repeat_interleave" and self._tensor_repeats(node, owner):
            self._add(
                node,
                "dynamic shape",
                "`repeat_interleave` with a tensor of repeats returns a tensor whose size "
                "depends on the data (read on the host, unless `output_size=` is given)",
            )
        elif isinstance(func, ast.Name) and name in _CONVERSIONS and node.args and self._is_dynamic(node.args[0]):
            self._add(node, "host sync", f"`{name}(...)` of a tensor reads its value on the host")
        elif name == "print" and (isinstance(func, ast.Name) or owner == self.self_name):
            self._add(node, "host work", f"`{ast.unparse(func)}` runs once, at capture")
        elif (owner, name) in _CLOCKS:
            self._add(node, "host work", f"`{owner}.{name}()` reads the host clock once, at capture")
        elif owner in ("random", "np.random", "numpy.random"):
            self._add(node, "host work", f"`{owner}.{name}` draws a host random number once, at capture; the replays reuse it")
        elif name in ("append", "extend", "add", "update") and isinstance(func, ast.Attribute) and self._on_self(func.value):
            self._add(node, "host work", f"`{ast.unparse(func)}` changes host state once, at capture, not every step")
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == self.self_name
            and self.self_name is not None
            and name not in ("log", "log_dict")
        ):
            self.helpers.append(("self", name, func))
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Name)
            and func.value.func.id == "super"
        ):
            self.helpers.append(("super", name, func))
        elif isinstance(func, (ast.Name, ast.Attribute)):
            unbound = (
                isinstance(func, ast.Attribute)
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == self.self_name
                and self.self_name is not None
            )
            self.helpers.append(("unbound" if unbound else "function", name, func))

    def _tensor_repeats(self, node: ast.Call, owner: str) -> bool:
        """``repeat_interleave`` given a tensor of repeats (not a number) and no ``output_size``."""
        if any(k.arg == "output_size" for k in node.keywords):
            return False
        repeats = [k.value for k in node.keywords if k.arg == "repeats"]
        if not repeats and owner in ("torch", "torch.Tensor"):
            # torch.repeat_interleave(input, repeats) or torch.repeat_interleave(repeats), its one argument a tensor
            repeats = node.args[1:2] if len(node.args) > 1 else node.args[:1]
        elif not repeats:
            repeats = node.args[:1]
        return bool(repeats) and not self._host_scalar(repeats[0])

    def _add(self, node: ast.AST, kind: str, reason: str) -> None:
        line = getattr(node, "lineno", 1)
        code = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        self.blockers.append(Blocker(kind, reason, f"{self.path}:{self.start + line - 1} in {self.func.name}", code))


def _value_read(stmt: ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Return | ast.Expr) -> ast.expr:
    """What ``stmt`` computes its value from: ``x += v`` reads ``x`` too (as ``x + v``)."""
    if isinstance(stmt, ast.AugAssign):
        return ast.BinOp(left=stmt.target, op=stmt.op, right=stmt.value)
    return stmt.value


def _bound_names(target: ast.expr) -> list[ast.Name]:
    """The names an assignment to ``target`` binds (``a``, ``a, (b, *c)``)."""
    if isinstance(target, ast.Name):
        return [target]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _bound_names(elt)]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    return []


def _walk_skipping_static(expr: ast.expr) -> Iterator[ast.AST]:
    """The nodes of ``expr``, not entering what is the same every step: a tensor's shape, dtype or
    device, ``x is None``, ``isinstance``/``len``/``hasattr`` and the like."""
    stack: list[ast.AST] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Attribute) and node.attr in _STATIC_ATTRS:
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _STATIC_ATTRS:
            continue
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "len", "hasattr", "getattr", "type", "callable")
        ):
            continue
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            continue
        if (
            isinstance(node, ast.Compare)
            and all(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            and isinstance(node.left, ast.Constant)
            and isinstance(node.left.value, str)
        ):
            continue  # `"labels" in batch`: the batch's keys are the same every replay
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _is_cpu(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and node.value == "cpu":
        return True
    return isinstance(node, ast.Call) and ast.unparse(node.func).endswith("device") and any(_is_cpu(a) for a in node.args)
