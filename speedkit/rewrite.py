"""Reversible rewriting of a module's ``forward``: the one model-surgery utility of speedkit.

Rungs that change *what a model computes how* (attention to SDPA, loops of GEMMs to one batched
GEMM, …) do not swap modules or parameters: they rewrite the Python source of the class's
``forward`` (found by :mod:`inspect`, transformed as an :mod:`ast`), compile the new function, and
bind it to the *instance* as ``module.forward`` — the same place Lightning's own compile puts a
compiled forward. Parameters, buffers, submodules, hooks and the state dict are untouched, so
optimizers keep pointing at the live parameters and checkpoints load into the user's original
model. ``undo()`` removes the instance attribute again.

The new function keeps the original's globals (live, not copied), closure values, ``super()``
support, file name and line numbers, so tracebacks still point into the user's file.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from speedkit.handle import Handle

#: name under which rewritten code reaches :mod:`speedkit.ops`
OPS_NAME = "__speedkit_ops"


class NotRewritable(Exception):
    """The forward cannot be rewritten; the message says why (for the report)."""


@dataclass(eq=False)  # hashed by identity: analyses are cached per parsed forward
class ParsedForward:
    """The source of a class's ``forward`` as an AST, with what is needed to compile it back.

    ``function`` is always the user's original function (its globals, closure and defining
    class); ``tree`` is its source, or the already rewritten source when another rung rewrote
    this instance's forward before (rewrites stack).
    """

    cls: type
    function: Callable[..., Any]
    tree: ast.FunctionDef
    filename: str
    first_line: int

    @property
    def self_name(self) -> str:
        args = self.tree.args.posonlyargs + self.tree.args.args
        if not args:
            raise NotRewritable("forward takes no self argument")
        return args[0].arg


@functools.lru_cache(maxsize=None)
def _parse_cached(cls: type) -> ParsedForward:
    function = cls.__dict__.get("forward")
    if function is None:  # inherited: rewrite the class that defines it
        for base in cls.__mro__[1:]:
            if "forward" in base.__dict__:
                function = base.__dict__["forward"]
                break
    if function is None or not isinstance(function, types.FunctionType):
        raise NotRewritable(f"{cls.__name__}.forward is not a plain Python function")
    try:
        lines, first_line = inspect.getsourcelines(function)
        filename = inspect.getsourcefile(function) or "<unknown>"
    except (OSError, TypeError) as exc:
        raise NotRewritable(f"source of {cls.__name__}.forward is not available ({exc})") from None
    source = textwrap.dedent("".join(lines))
    try:
        module = ast.parse(source)
    except SyntaxError as exc:
        raise NotRewritable(f"source of {cls.__name__}.forward does not parse on its own ({exc.msg})") from None
    tree = module.body[0]
    if not isinstance(tree, ast.FunctionDef):
        raise NotRewritable(f"{cls.__name__}.forward is not a def (async or a lambda)")
    if tree.decorator_list:
        raise NotRewritable(f"{cls.__name__}.forward is decorated; decorators could change its meaning")
    ast.increment_lineno(module, first_line - 1)
    return ParsedForward(cls, function, tree, filename, first_line)


def parse_forward(cls: type) -> ParsedForward:
    """Parse ``cls.forward`` (cached per class). Raises :class:`NotRewritable` with the reason."""
    return _parse_cached(cls)


def parse_module_forward(module: nn.Module) -> ParsedForward:
    """What a rung should transform for this instance: the class's forward, or — when a speedkit
    rung already rewrote this instance — that rewritten source, so rewrites stack."""
    bound = module.__dict__.get("forward")
    if bound is None:
        return parse_forward(type(module))
    parsed = getattr(getattr(bound, "__func__", None), "__speedkit_parsed__", None)
    if parsed is None:
        raise NotRewritable(f"{type(module).__name__} already has an instance-level forward (compiled or patched)")
    return parsed


def copy_tree(parsed: ParsedForward) -> ast.FunctionDef:
    """A fresh deep copy of the forward's AST, to transform."""
    return copy.deepcopy(parsed.tree)


def compile_forward(parsed: ParsedForward, tree: ast.FunctionDef, tag: str) -> Callable[..., Any]:
    """Compile a transformed forward into a function with the original's globals and closure."""
    import speedkit.ops as ops

    fn = parsed.function
    freevars = list(fn.__code__.co_freevars)
    closure_values = {name: cell.cell_contents for name, cell in zip(freevars, fn.__closure__ or ())}
    # the class that *defines* forward: zero-argument super() must see it (not a subclass), and
    # private names (self.__x) are mangled with its name
    defining = closure_values.get("__class__") or _defining_class(parsed)
    # a factory supplies the closure: __class__, the original's free variables, and speedkit's
    # ops; it sits in a class body named like the defining class so that the compiler mangles
    # private names the same way; the inner function keeps the user's module globals, live
    params = ["__class__", OPS_NAME, *[v for v in freevars if v != "__class__"]]
    fields = {
        "name": "speedkit_factory_",
        "args": ast.arguments(posonlyargs=[], args=[ast.arg(arg=p) for p in params], kwonlyargs=[], kw_defaults=[], defaults=[]),
        "body": [tree, ast.Return(value=ast.Name(id=tree.name, ctx=ast.Load()))],
        "decorator_list": [], "returns": None, "type_params": [],
    }
    factory = ast.FunctionDef(**{k: v for k, v in fields.items() if k in ast.FunctionDef._fields})
    class_fields = {"name": defining.__name__, "bases": [], "keywords": [], "body": [factory], "decorator_list": [], "type_params": []}
    holder = ast.ClassDef(**{k: v for k, v in class_fields.items() if k in ast.ClassDef._fields})
    module = ast.Module(body=[holder], type_ignores=[])
    ast.fix_missing_locations(module)
    code = compile(module, f"{parsed.filename}", "exec")
    namespace: dict[str, Any] = {}
    exec(code, fn.__globals__, namespace)  # noqa: S102 - our own transformed copy of the user's forward
    make = namespace[defining.__name__].__dict__["speedkit_factory_"]
    new = make(defining, ops, *[closure_values[v] for v in freevars if v != "__class__"])
    new.__qualname__ = f"{fn.__qualname__}[speedkit:{tag}]"
    new.__defaults__ = fn.__defaults__
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__speedkit_rewrite__ = tag
    new.__speedkit_source__ = ast.unparse(tree)  # what runs instead of the user's forward, for debugging
    # a later rung transforms this source, not the class's, so rewrites of one instance stack
    new.__speedkit_parsed__ = ParsedForward(parsed.cls, parsed.function, copy.deepcopy(tree), parsed.filename, parsed.first_line)
    return new


def _defining_class(parsed: ParsedForward) -> type:
    """The class in whose body ``forward`` was written (for name mangling)."""
    for klass in parsed.cls.__mro__:
        if klass.__dict__.get("forward") is parsed.function:
            return klass
    return parsed.cls


def bind_forward(handle: Handle, module: nn.Module, function: Callable[..., Any], description: str) -> None:
    """Set ``module.forward`` to ``function`` bound to it; ``handle`` puts back what was there.

    An earlier speedkit rewrite of the instance may be replaced (``function`` was built on its
    source); anything else at instance level (a compiled or patched forward) is refused.
    """
    previous = module.__dict__.get("forward")
    if previous is not None and not hasattr(getattr(previous, "__func__", None), "__speedkit_parsed__"):
        raise NotRewritable(f"{type(module).__name__} already has an instance-level forward (compiled or patched)")
    bind_method(handle, module, "forward", function, description)


def bind_method(handle: Handle, module: nn.Module, name: str, function: Callable[..., Any], description: str) -> None:
    """Set ``module.<name>`` to ``function`` bound to it; ``handle`` puts back what was there and,
    on redo, binds the very same bound method again (compiled code keyed on it stays valid)."""
    previous = module.__dict__.get(name)
    bound = types.MethodType(function, module)
    setattr(module, name, bound)

    def restore() -> None:
        if previous is None:
            module.__dict__.pop(name, None)
        else:
            setattr(module, name, previous)

    handle.record(description, restore, lambda: setattr(module, name, bound))


def is_user_code(module_name: str) -> bool:
    """Code defined in module ``module_name`` is the user's (or a model library's), not torch's or
    Lightning's own."""
    return module_name.split(".")[0] not in ("torch", "lightning", "pytorch_lightning")


def is_user_module(module: nn.Module) -> bool:
    """Modules whose code is the user's (torch's own modules are never rewritten)."""
    return is_user_code(type(module).__module__)


def call_ops(name: str, *args: ast.expr, **kwargs: ast.expr) -> ast.Call:
    """The AST of ``__speedkit_ops.<name>(*args, **kwargs)``."""
    return ast.Call(func=ast.Attribute(value=ast.Name(id=OPS_NAME, ctx=ast.Load()), attr=name, ctx=ast.Load()),
                    args=list(args), keywords=[ast.keyword(arg=k, value=v) for k, v in kwargs.items()])


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


def where(parsed: ParsedForward, node: ast.AST) -> str:
    """``file.py:LINE`` of a node, for reports."""
    import os

    return f"{os.path.basename(parsed.filename)}:{getattr(node, 'lineno', parsed.first_line)}"
