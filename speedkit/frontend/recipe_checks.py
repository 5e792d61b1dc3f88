"""The generic checks behind recipe validation: a class imported by its path and checked against a base
class (:func:`_import_class`), keyword arguments checked against a constructor's signature
(:func:`_init_args`), and values against simple type annotations (:func:`_check`)."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import re
import types
import typing
from typing import Any, Literal

from speedkit.errors import ConfigError
from speedkit.options import describe_value as _describe
from speedkit.options import one_line as _one_line
from speedkit.options import unknown_name as _unknown


def _import_class(class_path: Any, where: str, base: str | None) -> type:
    """Import ``package.module.ClassName``, telling a missing module from a missing attribute."""
    if not isinstance(class_path, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", class_path):
        raise ConfigError(where, f"class_path must be 'package.module.ClassName', found {_describe(class_path)}")
    parts = class_path.split(".")
    missing: str | None = None  # the deepest module that does not exist
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                missing = missing or module_name
                continue
            raise ConfigError(
                where, f"importing module '{module_name}' failed: No module named '{exc.name}' (a dependency is not installed)"
            ) from None
        except Exception as exc:  # the user's module raised while importing
            raise ConfigError(where, f"importing module '{module_name}' failed: {type(exc).__name__}: {_one_line(exc)}") from None
        owner = module_name
        for j, attr in enumerate(parts[i:]):
            if not hasattr(obj, attr):
                if j == 0 and missing is not None:
                    break
                close = difflib.get_close_matches(attr, [n for n in dir(obj) if not n.startswith("_")], n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(where, f"module '{owner}' has no attribute '{attr}'{hint}")
            obj = getattr(obj, attr)
            owner = f"{owner}.{attr}"
        else:
            return _check_class(obj, class_path, where, base)
        break
    raise ConfigError(
        where, f"module '{missing}' not found; install it, or put it next to the recipe or in the current directory"
    )


def _check_class(obj: Any, class_path: str, where: str, base: str | None) -> type:
    if not inspect.isclass(obj):
        raise ConfigError(where, f"expected a class, found {type(obj).__name__} '{class_path}'")
    if base is not None:
        base_cls = _import_base(base)
        if not issubclass(obj, base_cls):
            bases = ", ".join(b.__name__ for b in obj.__bases__)
            raise ConfigError(where, f"expected a subclass of {base_cls.__name__}, found '{class_path}' (a subclass of {bases})")
    return obj


@functools.cache
def _import_base(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _init_args(cls: type, value: Any, where: str) -> dict[str, Any]:
    """Check ``init_args`` against ``cls``'s constructor: names, required ones, simple types."""
    if value is None:
        value = {}  # still checked below: a constructor with required arguments needs them
    if not isinstance(value, dict):
        raise ConfigError(where, f"expected a mapping of {cls.__name__} arguments, found {_describe(value)}")
    params, hints, sig = _signature(cls)
    if sig is None:  # no introspectable signature: the constructor will judge
        return dict(value)
    for key in value:
        if params is not None and key not in params:
            raise ConfigError(f"{where}.{key}", _unknown(f"argument of {cls.__name__}", key, params))
    try:
        sig.bind(**value)
    except TypeError as exc:
        raise ConfigError(where, f"{cls.__name__}: {_one_line(exc)}; give it in {where}") from None
    for key, item in value.items():
        if key in hints:
            _check(item, hints[key], f"{where}.{key}")
    return dict(value)


@functools.cache
def _signature(cls: type) -> tuple[tuple[str, ...] | None, dict[str, Any], inspect.Signature | None]:
    """Keyword parameter names of ``cls``'s constructor (None if it takes ``**kwargs``), their type
    hints, and the signature itself (None if it cannot be introspected)."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return None, {}, None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        names = None
    else:
        names = tuple(n for n, p in sig.parameters.items() if p.kind in kinds)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable forward references: judge only the annotations that are real types
        hints = {
            n: p.annotation
            for n, p in sig.parameters.items()
            if p.annotation is not inspect.Parameter.empty and not isinstance(p.annotation, str)
        }
    hints.pop("return", None)
    return names, hints, sig


def _check(value: Any, tp: Any, where: str) -> Any:
    """``check_value`` for simple annotations; annotations it cannot judge accept anything."""
    from speedkit.options import check_value

    if not _judgeable(tp):
        return value
    return check_value(value, tp, where)


def _judgeable(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal or tp in (bool, int, float, str, type(None), Any):
        return True
    if origin in (typing.Union, types.UnionType):
        # a union with a class check_value cannot judge would accept anything anyway
        return all(_judgeable(a) or typing.get_origin(a) in (list, dict) or a in (list, dict) for a in typing.get_args(tp))
    return origin in (list, dict) or tp in (list, dict)
