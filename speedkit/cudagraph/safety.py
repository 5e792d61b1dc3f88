"""What would make a CUDA graph of the training step replay wrong: found before capturing it.

A graph records the kernels of one step and replays them; everything the host decides while the
step runs is decided once, at capture. So a step is unsafe to capture when it

* **syncs with the host** (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)``,
  ``torch.cuda.synchronize()``): capture fails, or the value read is the capture's;
* has **dynamic shapes** (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing): the
  sizes are the capture's;
* has **data-dependent control flow** (``if loss > x``, ``if batch_idx % 10 == 0``,
  ``if self.current_epoch < 2``): the branch taken at capture is replayed every step; so is a
  Python number computed from the step's index (``beta = min(1, self.global_step / n)``), baked in;
* does **host work** whose effect must happen every step (``print``, clocks, Python/NumPy random
  numbers, counters and lists on ``self``): it runs once, at capture.

Two checks find them. :func:`scan_step`, here, reads the source of the step's own code
(``training_step`` and the helper methods it calls, the user's modules' ``forward``) and names each
unsafe pattern with its file and line; it runs anywhere, before anything is captured.
:mod:`speedkit.cudagraph.step_watch` runs one real step and names every synchronizing call and every random
number drawn on the host (library code included). Model libraries' code is left to the second
check: reading it statically would refuse on branches that never run.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from speedkit.rewrite.source import is_user_function, is_users_own_file, parse_function

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
_MAX_DEPTH = 3  # helper methods followed from training_step


@dataclass(frozen=True)
class Blocker:
    """One thing that would make a captured step replay wrong."""

    kind: str  # "host sync" | "dynamic shape" | "data-dependent control flow" | "host work"
    reason: str  # what it does, in words
    where: str  # "path/to/file.py:123 in training_step"
    code: str  # the source line

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}: {self.reason}" + (f" (`{self.code}`)" if self.code else "")


# -- static: the step's own source ----------------------------------------------------------------


def scan_step(model: nn.Module) -> list[Blocker]:
    """Unsafe patterns in the step's own code: ``training_step`` and what it calls of the user's
    (helper, static and class methods, ``super()``'s, functions of the user's own modules, not
    installed libraries'), and ``forward`` of every module class defined in the user's own package
    with the helper methods it calls."""
    blockers: list[Blocker] = []
    seen: set[Any] = set()
    step = _own_function(type(model), "training_step")
    if step is not None:
        _scan_method(model, step, blockers, seen, depth=0, per_step_args=True, step_index=True)
    home = _package(type(model).__module__)
    for module in model.modules():
        if _package(type(module).__module__) != home or _speedkit_layer(type(module).__module__):
            continue
        forward = _own_function(type(module), "forward")
        if forward is not None and forward not in seen:
            _scan_method(module, forward, blockers, seen, depth=1, per_step_args=False)
    return sorted(set(blockers), key=lambda b: b.where)


def scan_function(fn: Callable[..., Any], *, per_step_args: bool = True) -> list[Blocker]:
    """Unsafe patterns in one function (``per_step_args``: its arguments change every step)."""
    blockers: list[Blocker] = []
    _scan(fn, blockers, self_name=None, per_step_args=per_step_args)
    return blockers


def _package(module_name: str) -> str:
    return (module_name or "").split(".")[0]


def _speedkit_layer(module_name: str) -> bool:
    """A module speedkit swapped in (its norms and activations): built to be captured, its branches
    read only the input's device, dtype and shape, which a graph fixes. The demo models are user code."""
    return module_name.startswith("speedkit.") and not module_name.startswith("speedkit.demos")


def _own_function(cls: type, name: str) -> Any:
    """``cls.name`` as a plain function (a static or class method's own function), unless torch or
    Lightning defines it."""
    fn = getattr(cls, name, None)
    fn = fn.__func__ if inspect.ismethod(fn) else fn  # a classmethod, bound to the class
    return fn if is_user_function(fn) else None


def _takes_self(cls: type, name: str) -> bool:
    """Whether ``cls.name``'s first parameter is the instance (or the class): not a staticmethod."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return not isinstance(vars(klass)[name], staticmethod)
    return True


def _super_function(cls: type, fn: Any, name: str) -> Any:
    """What ``super().name`` resolves to inside ``fn``, a method of ``cls`` or of one of its bases."""
    mro = cls.__mro__
    owner = next((i for i, klass in enumerate(mro) if any(getattr(v, "__func__", v) is fn for v in vars(klass).values())), None)
    if owner is None:
        return None
    for klass in mro[owner + 1 :]:
        if name in vars(klass):
            found = getattr(vars(klass)[name], "__func__", vars(klass)[name])
            return found if is_user_function(found) else None
    return None


def _global_function(fn: Any, call: ast.expr) -> Any:
    """The user's own function a call names through ``fn``'s globals (``helper(...)``,
    ``losses.helper(...)``), not a library's: their code is left to the run-time checks."""
    scope = getattr(fn, "__globals__", {})
    if isinstance(call, ast.Name):
        found = scope.get(call.id)
    elif (
        isinstance(call, ast.Attribute)
        and isinstance(call.value, ast.Name)
        and (inspect.ismodule(scope.get(call.value.id)) or inspect.isclass(scope.get(call.value.id)))
    ):
        found = getattr(scope[call.value.id], call.attr, None)  # losses.focal(...), Base.training_step(self, ...)
        found = found.__func__ if inspect.ismethod(found) else found
    else:
        return None
    module = found.__module__ or "" if inspect.isfunction(found) else ""
    if not is_user_function(found) or _speedkit_layer(module) or _package(module) in sys.stdlib_module_names:
        return None
    try:
        path = inspect.getsourcefile(found) or ""
    except TypeError:
        return None
    return found if is_users_own_file(path) else None


def _scan_method(
    obj: Any,
    fn: Any,
    blockers: list[Blocker],
    seen: set[Any],
    depth: int,
    per_step_args: bool,
    step_index: bool = False,
    takes_self: bool = True,
) -> None:
    seen.add(fn)
    calls = _scan(fn, blockers, self_name="self" if takes_self else None, per_step_args=per_step_args, step_index=step_index)
    if depth >= _MAX_DEPTH:
        return
    for kind, name, node in calls:
        if kind == "self":
            helper, method = _own_function(type(obj), name), _takes_self(type(obj), name)
        elif kind == "super":
            helper, method = _super_function(type(obj), fn, name), True
        else:  # a function of the user's own module (or a class's function called with self)
            helper, method = _global_function(fn, node), kind == "unbound"
        if helper is not None and helper not in seen:
            _scan_method(obj, helper, blockers, seen, depth + 1, per_step_args, takes_self=method)


def _scan(
    fn: Any, blockers: list[Blocker], self_name: str | None, per_step_args: bool, step_index: bool = False
) -> list[tuple[str, str, ast.expr]]:
    """Scan ``fn``'s source into ``blockers``; returns the calls it makes that may be the user's own
    code: ``("self", name, _)`` for ``self.<name>(...)``, ``("super", name, _)`` for
    ``super().<name>(...)``, ``("function" | "unbound", name, func)`` for a plain function (or a
    class's, given ``self``)."""
    try:
        source = parse_function(fn)
    except (OSError, TypeError, SyntaxError):
        return []
    func, lines, start, path = source.node, source.lines, source.first_line, source.filename
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    if self_name is not None and func.args.args:
        self_name = func.args.args[0].arg
    visitor = _Visitor(func, self_name, per_step_args, path, start, lines, step_index)
    visitor.visit_body(func.body)
    blockers.extend(visitor.blockers)
    return visitor.helpers


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
