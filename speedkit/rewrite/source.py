"""The source of a model's methods: read and parsed once, compiled back, bound to one instance; and
the one test of whose code it is (the user's, or torch's, Lightning's, speedkit's, a library's).

Rungs that change *what a model computes how* do not swap modules or parameters: they rewrite the
Python source of a method (found by :mod:`inspect`, transformed as an :mod:`ast`), compile the new
function, and bind it to the *instance* — the same place Lightning's own compile puts a compiled
forward. Parameters, buffers, submodules, hooks and the state dict are untouched, so optimizers keep
pointing at the live parameters and checkpoints load into the user's original model. ``undo()``
removes the instance attribute again.

The new function keeps the original's globals (live, not copied), closure values, ``super()``
support, file name and line numbers, so tracebacks still point into the user's file.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import inspect
import os
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from speedkit.handle import Handle

#: name under which rewritten code reaches :mod:`speedkit.kernels.ops`
OPS_NAME = "__speedkit_ops"
_LIBRARIES = ("torch", "lightning", "pytorch_lightning")


class NotRewritable(Exception):
    """The method cannot be rewritten; the message says why (for the report)."""


#: decorators known to call the method they wrap with the same arguments, save for renamed keywords,
#: and to return what it returns: (the file their wrapper is written in, ends with; the wrapper's
#: qualified name, starts with). A rewritten method is wrapped again by a copy of the same wrapper.
_PASS_THROUGH_WRAPPERS = (
    # transformers' deprecate_kwarg: renames a deprecated keyword, may warn, then calls the method
    (os.path.join("transformers", "utils", "deprecation.py"), "deprecate_kwarg.<locals>."),
)


# -- whose code -------------------------------------------------------------------------------------


def is_user_code(module_name: str) -> bool:
    """Code defined in module ``module_name`` is the user's (or a model library's), not torch's or
    Lightning's own."""
    return module_name.split(".")[0] not in _LIBRARIES


def is_user_module(module: nn.Module) -> bool:
    """Modules whose code is the user's (torch's own modules are never rewritten)."""
    return is_user_code(type(module).__module__)


def is_user_function(fn: Any) -> bool:
    """A plain Python function defined outside torch and Lightning."""
    return inspect.isfunction(fn) and is_user_code(fn.__module__ or "")


def is_users_own_file(filename: str) -> bool:
    """Code outside installed packages, torch, Lightning and speedkit: the user's own (a library's
    call is named with it; a library's module is not the user's)."""
    return is_callers_file(filename) and not any(part in filename for part in ("site-packages", "dist-packages", "<frozen"))


#: the packages whose code is never the caller's (a model library's, timm's or transformers', is)
_FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "speedkit")


@functools.cache
def _framework_dirs() -> tuple[str, ...]:
    """The folders :data:`_FRAMEWORKS` are imported from (resolved, each ending in a separator)."""
    found: list[str] = []
    for name in _FRAMEWORKS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            found.append(os.path.join(os.path.realpath(location), ""))
    return tuple(found)


@functools.lru_cache(maxsize=8192)
def is_callers_file(filename: str) -> bool:
    """A file that is not in torch's, Lightning's or speedkit's own package folders (a model library's
    counts as the caller's). By where the packages are installed, not by the path's words: a user's
    project in a folder named ``torch``, ``lightning`` or ``speedkit`` (a clone of speedkit, say) is
    the user's code."""
    if filename.startswith("<"):  # <string>, <frozen ...>, generated code: not a package's file on disk
        return True
    return not os.path.realpath(filename).startswith(_framework_dirs())


# -- parse ------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FunctionSource:
    """A function's source as read (``lines`` from ``first_line`` of ``filename``) and parsed, with line
    numbers relative to ``lines`` (``node`` is the module's first statement: the ``def``, or not)."""

    lines: list[str]
    first_line: int
    filename: str
    node: ast.stmt | None


@functools.cache
def parse_function(fn: Callable[..., Any]) -> FunctionSource:
    """Read and parse ``fn``'s source (cached per function; the tree is shared: do not change it).
    Raises OSError or TypeError (no source) or SyntaxError (it does not parse on its own)."""
    lines, first_line = inspect.getsourcelines(fn)
    filename = inspect.getsourcefile(fn) or "<unknown>"
    module = ast.parse(textwrap.dedent("".join(lines)))
    return FunctionSource(lines, first_line, filename, module.body[0] if module.body else None)


@dataclass(eq=False)  # hashed by identity: analyses are cached per parsed method
class ParsedMethod:
    """The source of a class's method as an AST (absolute line numbers), with what is needed to
    compile it back.

    ``function`` is always the user's original function (its globals, closure and defining class);
    ``tree`` is its source, or the already rewritten source when another rung rewrote this
    instance's method before (rewrites stack).
    """

    cls: type
    function: Callable[..., Any]
    tree: ast.FunctionDef
    filename: str
    first_line: int
    name: str = "forward"  # the attribute it is reached by
    #: pass-through decorators' wrappers around ``function``, outermost first (what the class holds is
    #: the first, or ``function`` when there are none)
    wrappers: tuple[Callable[..., Any], ...] = ()

    @property
    def self_name(self) -> str:
        args = self.tree.args.posonlyargs + self.tree.args.args
        if not args:
            raise NotRewritable(f"{self.name} takes no self argument")
        return args[0].arg


@functools.cache
def parse_method(cls: type, name: str = "forward") -> ParsedMethod:
    """Parse ``cls.<name>`` (cached per class). Raises :class:`NotRewritable` with the reason."""
    label = f"{cls.__name__}.{name}"
    owner = next((k for k in cls.__mro__ if name in k.__dict__), None)  # inherited: the class that defines it
    function = owner.__dict__[name] if owner is not None else None
    if not isinstance(function, types.FunctionType):
        raise NotRewritable(f"{label} is not a plain Python function")
    wrappers: list[Callable[..., Any]] = []
    while _is_pass_through(function):
        wrappers.append(function)
        function = function.__wrapped__
    forward = name == "forward"  # (a forward's refusals are worded as they always were)
    if not forward and not is_user_code(function.__module__ or ""):
        raise NotRewritable(f"{label} is the library's own")
    try:
        source = parse_function(function)
    except (OSError, TypeError) as exc:
        raise NotRewritable(f"source of {label} is not available ({exc})") from None
    except SyntaxError as exc:
        raise NotRewritable(
            f"source of {label} does not parse on its own ({exc.msg})"
            if forward
            else f"source of {label} is not available ({exc})"
        ) from None
    tree = source.node
    if isinstance(tree, ast.FunctionDef) and wrappers and len(tree.decorator_list) == len(wrappers):
        tree = copy.copy(tree)
        tree.decorator_list = []  # each one is a pass-through wrapper, put back by compile_method
    if not isinstance(tree, ast.FunctionDef) or tree.decorator_list:
        if not forward:
            raise NotRewritable(f"{label} is decorated or not a def")
        if not isinstance(tree, ast.FunctionDef):
            raise NotRewritable(f"{label} is not a def (async or a lambda)")
        raise NotRewritable(f"{label} is decorated; decorators could change its meaning")
    tree = copy.deepcopy(tree)
    ast.increment_lineno(tree, source.first_line - 1)
    return ParsedMethod(cls, function, tree, source.filename, source.first_line, name, tuple(wrappers))


def _is_pass_through(function: Any) -> bool:
    """``function`` is the wrapper of a decorator in :data:`_PASS_THROUGH_WRAPPERS`, around a plain
    function held in its closure."""
    if not isinstance(function, types.FunctionType) or not isinstance(getattr(function, "__wrapped__", None), types.FunctionType):
        return False
    code = function.__code__
    qualname = getattr(code, "co_qualname", function.__qualname__)
    known = any(code.co_filename.endswith(file) and qualname.startswith(prefix) for file, prefix in _PASS_THROUGH_WRAPPERS)
    return known and any(cell.cell_contents is function.__wrapped__ for cell in function.__closure__ or ())


def _wrap_again(wrapper: Callable[..., Any], inner: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of a pass-through ``wrapper`` that calls ``inner`` where it called the function it wrapped."""
    wrapped = wrapper.__wrapped__
    cells = tuple(types.CellType(inner) if cell.cell_contents is wrapped else cell for cell in wrapper.__closure__ or ())
    copied = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, cells)
    copied.__kwdefaults__ = wrapper.__kwdefaults__
    copied.__dict__.update(wrapper.__dict__)
    copied.__wrapped__ = inner
    copied.__qualname__ = inner.__qualname__
    return copied


def parse_instance_method(module: nn.Module, name: str = "forward") -> ParsedMethod:
    """What a rung should transform for ``module.<name>``: the class's method, or — when a speedkit
    rung already rewrote it on this instance — that rewritten source, so rewrites stack."""
    bound = module.__dict__.get(name)
    if bound is None:
        return parse_method(type(module), name)
    parsed = getattr(getattr(bound, "__func__", None), "__speedkit_parsed__", None)
    if parsed is None:
        how = "(compiled or patched)" if name == "forward" else "(patched)"
        raise NotRewritable(f"{type(module).__name__} already has an instance-level {name} {how}")
    return parsed


def copy_tree(parsed: ParsedMethod) -> ast.FunctionDef:
    """A fresh deep copy of the method's AST, to transform."""
    return copy.deepcopy(parsed.tree)


# -- compile and bind --------------------------------------------------------------------------------


def compile_method(parsed: ParsedMethod, tree: ast.FunctionDef, tag: str) -> Callable[..., Any]:
    """Compile a transformed method into a function with the original's globals and closure."""
    import speedkit.kernels.ops as ops

    fn = parsed.function
    freevars = list(fn.__code__.co_freevars)
    closure_values = {name: cell.cell_contents for name, cell in zip(freevars, fn.__closure__ or ())}
    # the class that *defines* the method: zero-argument super() must see it (not a subclass), and
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
        "decorator_list": [],
        "returns": None,
        "type_params": [],
    }
    factory = ast.FunctionDef(**{k: v for k, v in fields.items() if k in ast.FunctionDef._fields})
    class_fields = {
        "name": defining.__name__,
        "bases": [],
        "keywords": [],
        "body": [factory],
        "decorator_list": [],
        "type_params": [],
    }
    holder = ast.ClassDef(**{k: v for k, v in class_fields.items() if k in ast.ClassDef._fields})
    module = ast.Module(body=[holder], type_ignores=[])
    ast.fix_missing_locations(module)
    code = compile(module, f"{parsed.filename}", "exec")
    namespace: dict[str, Any] = {}
    exec(code, fn.__globals__, namespace)  # noqa: S102 - our own transformed copy of the user's method
    make = namespace[defining.__name__].__dict__["speedkit_factory_"]
    new = make(defining, ops, *[closure_values[v] for v in freevars if v != "__class__"])
    new.__qualname__ = f"{fn.__qualname__}[speedkit:{tag}]"
    new.__defaults__ = fn.__defaults__
    new.__kwdefaults__ = fn.__kwdefaults__
    for wrapper in reversed(parsed.wrappers):  # the pass-through decorators, innermost first
        new = _wrap_again(wrapper, new)
    new.__speedkit_rewrite__ = tag
    new.__speedkit_source__ = ast.unparse(tree)  # what runs instead of the user's method, for debugging
    # a later rung transforms this source, not the class's, so rewrites of one instance stack
    new.__speedkit_parsed__ = ParsedMethod(
        parsed.cls, parsed.function, copy.deepcopy(tree), parsed.filename, parsed.first_line, parsed.name, parsed.wrappers
    )
    return new


def _defining_class(parsed: ParsedMethod) -> type:
    """The class in whose body the method was written (for name mangling)."""
    for klass in parsed.cls.__mro__:
        if klass.__dict__.get(parsed.name) is (parsed.wrappers[0] if parsed.wrappers else parsed.function):
            return klass
    return parsed.cls


def bind_method(handle: Handle, module: nn.Module, name: str, function: Callable[..., Any], description: str) -> None:
    """Set ``module.<name>`` to ``function`` bound to it; ``handle`` puts back what was there and,
    on redo, binds the very same bound method again (compiled code keyed on it stays valid).

    For ``forward``, an earlier speedkit rewrite of the instance may be replaced (``function`` was
    built on its source); anything else at instance level (a compiled or patched forward) is refused.
    """
    previous = module.__dict__.get(name)
    if name == "forward" and previous is not None and not hasattr(getattr(previous, "__func__", None), "__speedkit_parsed__"):
        raise NotRewritable(f"{type(module).__name__} already has an instance-level forward (compiled or patched)")
    bound = types.MethodType(function, module)
    setattr(module, name, bound)

    def restore() -> None:
        if previous is None:
            module.__dict__.pop(name, None)
        else:
            setattr(module, name, previous)

    handle.record(description, restore, lambda: setattr(module, name, bound))
