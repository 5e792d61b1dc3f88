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
from collections.abc import Callable
from typing import Any

from torch import nn

from speedkit.cudagraph.safety_visitor import Blocker, _Visitor
from speedkit.rewrite.source import is_user_function, is_users_own_file, parse_function

_MAX_DEPTH = 3  # helper methods followed from training_step


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
