"""Options of rungs and recipe fields: dataclasses validated from plain YAML data.

:func:`parse_options` builds an options dataclass from a mapping and :func:`check_value` checks one
value against a simple annotation; both raise a one-line :class:`~speedkit.errors.ConfigError`
naming the field. Shared by rungs, recipes and the measurement settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, get_args, get_origin

from speedkit.errors import ConfigError


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def check_value(value: Any, tp: Any, where: str) -> Any:
    """Validate ``value`` against a simple annotation (bool/int/float/str/Literal/Optional/dict/list)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(where, f"expected {_type_name(tp)}, found {value!r}")
    if origin in (typing.Union, types.UnionType):
        for arg in get_args(tp):
            try:
                return check_value(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(where, f"expected {_type_name(tp)}, found {_found(value)}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:  # NaN is no number to use
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin in (dict, list) or tp in (dict, list):
        if isinstance(value, origin or tp):
            return value
    else:
        return value
    raise ConfigError(where, f"expected {_type_name(tp)}, found {_found(value)}")


def _found(value: Any) -> str:
    if isinstance(value, float) and value != value:
        return ".nan (not a number); give a number"
    return f"{value!r} ({type(value).__name__})"


def unknown_name(what: str, key: Any, allowed: Iterable[Any]) -> str:
    """The message for a name not among ``allowed``: the closest match where one is close, and the list."""
    allowed = [str(a) for a in allowed]
    close = difflib.get_close_matches(str(key), allowed, n=1)
    if close and len(allowed) > 12:  # a long list would bury the likely fix
        return f"unknown {what} {str(key)!r}; did you mean '{close[0]}'?"
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown {what} {str(key)!r}; {hint}allowed: {', '.join(allowed) or 'none'}"


def describe_value(value: Any) -> str:
    """A value as an error message shows it: null, a mapping or list (shortened), or its repr and type."""
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'} {one_line(repr(value))[:80]}"
    return f"{one_line(repr(value))[:80]} ({type(value).__name__})"


def one_line(text: Any) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def parse_options(options_cls: type, raw: Any, where: str) -> Any:
    """Build an options dataclass from a mapping, naming the offending field on any error."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(where, f"expected a mapping of options, found {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(options_cls)
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        allowed = ", ".join(fields) or "none"
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown option; allowed: {allowed}")
    values = {k: check_value(v, hints[k], f"{where}.{k}") for k, v in raw.items()}
    try:
        return options_cls(**values)
    except (TypeError, ValueError) as exc:  # __post_init__ cross-field checks
        raise ConfigError(where, str(exc)) from None
