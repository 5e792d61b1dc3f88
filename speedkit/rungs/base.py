"""The rung protocol: every quick win says whether it applies, applies itself, and can be undone.

A rung is a small class over two plain-PyTorch functions::

    class MyRung(Rung):
        name = "my_rung"
        Options = MyOptions              # a dataclass; validated from recipes by parse_options
        precision = None                 # or "tf32"/"bf16"/"fp16" if it changes numerics

        def check(self, state) -> str | None:   # None = applies; else the reason it does not
        def apply(self, state) -> Handle:        # mutate state reversibly; say what changed

:class:`Handle` collects undo callbacks; ``handle.undo()`` runs them in reverse order, exactly once.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Literal, get_args, get_origin

from speedkit.errors import ConfigError
from speedkit.state import TrainState


@dataclasses.dataclass
class NoOptions:
    """This rung takes no options."""


class Handle:
    """What a rung changed, and how to put it back.

    ``changes`` are human-readable lines for the report; ``undo()`` reverts every change in the
    reverse order it was made and is idempotent.
    """

    def __init__(self, rung: str) -> None:
        self.rung = rung
        self.changes: list[str] = []
        self._undo: list[Callable[[], None]] = []
        self.active = True
        #: returns a reason when the applied change stopped working (e.g. a compile fallback)
        self.problem: Callable[[], str | None] = lambda: None

    def record(self, change: str, undo: Callable[[], None] | None = None) -> None:
        self.changes.append(change)
        if undo is not None:
            self._undo.append(undo)

    def undo(self) -> None:
        if not self.active:
            return
        self.active = False
        errors = []
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except Exception as exc:  # keep undoing the rest; report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        return f"Handle({self.rung!r}, changes={self.changes!r}, active={self.active})"


class Rung:
    """Base class of all rungs. Subclasses set ``name`` and implement ``check`` and ``apply``."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: numerics this rung introduces; None when it must not change numerics beyond reordering
    precision: ClassVar[str | None] = None
    #: when the Lightning callback applies it: "setup" (before the strategy wraps the model and
    #: builds optimizers) or "fit_start" (once optimizers exist)
    lightning_stage: ClassVar[str] = "setup"
    #: re-tested by the ladder's closing check once later rungs are kept on top of it (its gain may
    #: depend on them: a fused kernel pays in eager and may not under torch.compile)
    recheck: ClassVar[bool] = False

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()

    def check(self, state: TrainState) -> str | None:
        """Return ``None`` if the rung applies to ``state``, else a one-line reason why not."""
        return None

    def apply(self, state: TrainState) -> Handle:
        raise NotImplementedError

    # -- Lightning -------------------------------------------------------------------------
    def check_lightning(self, trainer: Any, module: Any, state: TrainState) -> str | None:
        """Like :meth:`check`, inside a Lightning Trainer. Defaults to :meth:`check`."""
        return self.check(state)

    def apply_lightning(self, trainer: Any, module: Any, state: TrainState) -> Handle:
        """Apply inside a Lightning Trainer. Defaults to :meth:`apply` on the trainer's objects."""
        return self.apply(state)

    def options_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.options)

    def __repr__(self) -> str:
        opts = self.options_dict()
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in opts.items())})"


# -- option parsing (shared by recipes and Python callers) ---------------------------------


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
        raise ConfigError(where, f"expected {_type_name(tp)}, found {value!r} ({type(value).__name__})")
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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin in (dict, list) or tp in (dict, list):
        if isinstance(value, origin or tp):
            return value
    else:
        return value
    raise ConfigError(where, f"expected {_type_name(tp)}, found {value!r} ({type(value).__name__})")


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


def set_attr(handle: Handle, obj: Any, attr: str, value: Any, describe: str | None = None) -> None:
    """Set ``obj.attr = value`` and record how to put the previous value (or absence) back."""
    missing = object()
    previous = obj.__dict__.get(attr, missing) if hasattr(obj, "__dict__") else getattr(obj, attr, missing)
    setattr(obj, attr, value)

    def restore() -> None:
        if previous is missing:
            try:
                delattr(obj, attr)
            except AttributeError:
                pass
        else:
            setattr(obj, attr, previous)

    handle.record(describe or f"{type(obj).__name__}.{attr} = {value!r}", restore)
