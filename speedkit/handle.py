"""What a change did and how to put it back: the reversible ``Handle`` every rung returns.

A handle is a list of recorded changes, each with an ``undo`` and, where the change can be made
again exactly, a ``redo``. ``undo()`` reverts every change last-first, exactly once. When every
change has a redo, the handle can also be ``suspend()``-ed and ``resume()``-d any number of times:
the very same objects (a compiled forward, a rewritten method, a precision plugin) come back, so
nothing is rebuilt or recompiled. The ladder uses that to measure a configuration with and without
a rung in interleaved windows.

This module depends on nothing else in speedkit, so any layer (rewrites, steps, rungs) can use it.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

_MISSING = object()

_configuration_changes = 0


def configuration_changed() -> None:
    """Note that what a step computes was switched (a handle applied, suspended, resumed or undone;
    dropout rates set to 0 for a parity check): a compiled forward's next call may then compile its
    graphs for the new configuration once, which is not a recompilation storm."""
    global _configuration_changes
    _configuration_changes += 1


def configuration_changes() -> int:
    """How many times :func:`configuration_changed` was called in this process."""
    return _configuration_changes


_in_place_changes = 0

#: handles whose changes alter what a compiled forward traces (``Handle.traced``), and each one's serial
_traced_handles: weakref.WeakSet[Handle] = weakref.WeakSet()
_serials = itertools.count()


def traced_configuration() -> frozenset[int]:
    """The changes in effect now that alter what a compiled forward traces (the serials of the handles
    marked ``traced``, applied and not suspended): a compiled forward keeps one compiled function per
    such configuration (see :class:`speedkit.rungs.compile.GuardedForward`)."""
    return frozenset(h.serial for h in list(_traced_handles) if h.active and not h.suspended)


def changed_in_place() -> None:
    """Note that what a step computes was changed in place, every handle left as it is (dropout rates
    set to 0 for a parity check, and back): a captured CUDA graph still holds the kernels from before
    and must capture again. Switching handles is not such a change: whoever switches a rung beneath a
    graph rebases it (``Handle.rebase``), and a graph's own suspend and resume leave its capture valid."""
    global _in_place_changes
    _in_place_changes += 1
    configuration_changed()


def in_place_changes() -> int:
    """How many times :func:`changed_in_place` was called in this process."""
    return _in_place_changes


class Handle:
    """What a rung changed, and how to put it back (and, where possible, how to do it again).

    Attributes:
        rung: the name of the rung that made the changes.
        changes: human-readable lines for the report.
        active: False once :meth:`undo` ran (the changes are gone for good).
        suspended: True between :meth:`suspend` and :meth:`resume`.
        problem: returns a reason when the applied change stopped working (e.g. a compile fallback).
        report: returns lines on what the change did once steps ran (e.g. graphs compiled).
        counts: returns the same as numbers, for a program to read (e.g. a CUDA graph's captures and
            replays); empty where the change has nothing to count.
        draws_differently: the change computes the same function but draws its random numbers
            (dropout masks) from another stream; the ladder then judges parity with dropout off.
        rebase: called after :meth:`resume` when changes beneath this one were switched while it
            was suspended, for a change that holds what it wrapped by value (a captured CUDA graph).
        settle_steps: steps the change needs after a rebase before its steps are representative
            (e.g. an eager warm-up step and the capture).
        steps_before_effect: returns how many steps the change still needs, beyond the warm-up a
            parity trajectory holds, before it acts in a step (a CUDA graph on a DDP wrapper made in
            the trials: the wrapper's first iterations, which sync with the host, before a capture);
            the parity check runs them first and restores its snapshot after. 0 by default.
        rewrite: what a source-rewriting rung rewrote and left alone
            (:class:`speedkit.rewrite.pipeline.RewriteReport`); None for other rungs.
    """

    def __init__(self, rung: str) -> None:
        self.rung = rung
        self.changes: list[str] = []
        self._entries: list[tuple[Callable[[], None], Callable[[], None] | None, bool]] = []
        self.active = True
        self.suspended = False
        self.problem: Callable[[], str | None] = lambda: None
        self.report: Callable[[], list[str]] = lambda: []
        self.counts: Callable[[], dict[str, Any]] = lambda: {}
        self.draws_differently = False
        self.rebase: Callable[[], None] = lambda: None
        self.settle_steps = 0
        self.steps_before_effect: Callable[[], int] = lambda: 0
        self.rewrite: Any = None
        self.serial = next(_serials)
        self._traced = False

    @property
    def traced(self) -> bool:
        """Its changes alter what a compiled forward traces (a rewrite, a module's forward wrapped, a
        layout or a precision: the rung's ``recompiles``): a compiled forward above it traces anew for
        each configuration of such changes, as a fresh process applying them first would."""
        return self._traced

    @traced.setter
    def traced(self, value: bool) -> None:
        self._traced = bool(value)
        if self._traced:
            _traced_handles.add(self)
        else:
            _traced_handles.discard(self)

    def record(
        self,
        change: str,
        undo: Callable[[], None] | None = None,
        redo: Callable[[], None] | None = None,
        *,
        persistent: bool = False,
    ) -> None:
        """Note ``change`` for the report; ``undo`` reverts it, ``redo`` makes it again after an undo.

        ``persistent``: the change does not alter what a step computes (e.g. a flag that lets the
        optimizer be captured in a CUDA graph); :meth:`suspend` leaves it on, only :meth:`undo` reverts it."""
        if change:
            self.changes.append(change)
        configuration_changed()
        if undo is not None:
            self._entries.append((undo, redo, persistent))

    @property
    def toggleable(self) -> bool:
        """Whether :meth:`suspend`/:meth:`resume` can switch the changes off and on again."""
        return all(redo is not None or persistent for _, redo, persistent in self._entries)

    def suspend(self) -> None:
        """Revert every change, last first, keeping what is needed to :meth:`resume` them."""
        if not self.active or self.suspended:
            return
        if not self.toggleable:
            raise RuntimeError(f"handle of {self.rung!r} records a change that cannot be redone; use undo()")
        self._run([undo for undo, _, persistent in reversed(self._entries) if not persistent])
        self.suspended = True

    def resume(self) -> None:
        """Make every change again, first first (the same objects as before :meth:`suspend`)."""
        if not self.active or not self.suspended:
            return
        self._run([redo for _, redo, persistent in self._entries if not persistent])  # type: ignore[misc]
        self.suspended = False

    def undo(self) -> None:
        """Revert every change, last first; idempotent. The handle is spent afterwards."""
        if not self.active:
            return
        self.active = False
        entries, self._entries = self._entries, []
        suspended, self.suspended = self.suspended, False
        self._run([undo for undo, _, persistent in reversed(entries) if persistent or not suspended])

    @staticmethod
    def _run(functions: list[Callable[[], None]]) -> None:
        configuration_changed()
        errors = []
        for fn in functions:
            try:
                fn()
            except Exception as exc:  # keep going through the rest; report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        state = "suspended" if self.suspended else "active" if self.active else "undone"
        return f"Handle({self.rung!r}, changes={self.changes!r}, {state})"


def set_attr(handle: Handle, obj: Any, attr: str, value: Any, describe: str | None = None) -> None:
    """Set ``obj.attr = value`` and record how to put the previous value (or its absence) back."""
    previous = obj.__dict__.get(attr, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, attr, _MISSING)
    setattr(obj, attr, value)

    def restore() -> None:
        if previous is _MISSING:
            try:
                delattr(obj, attr)
            except AttributeError:
                pass
        else:
            setattr(obj, attr, previous)

    handle.record(describe or f"{type(obj).__name__}.{attr} = {value!r}", restore, lambda: setattr(obj, attr, value))


class AttributeWrapper:
    """Base of the callables a rung sets as an attribute of the user's object (a module's forward or
    hook) around what was there, ``wrapped``. Copied with that object (``copy.deepcopy``: an EMA or SWA
    callback copying the module mid-fit) or pickled with it (``torch.save(module)``), a wrapper comes
    back as what it wraps, bound to the copy: the copy computes with its own weights, never through a
    wrapper still bound to the original, and nothing of the rung's (compiled code, a loader) travels."""

    wrapped: Any

    def __init__(self, wrapped: Any) -> None:
        """Wrap ``wrapped``, whose name, docstring and ``__wrapped__`` the wrapper carries (Lightning
        reads through ``__wrapped__`` whether a hook is overridden)."""
        self.wrapped = wrapped
        functools.update_wrapper(self, wrapped)

    def __reduce__(self) -> tuple[Any, ...]:
        return _itself, (self.wrapped,)


def _itself(value: Any) -> Any:
    return value


def nested(handle: Handle, inner: Handle, change: str) -> None:
    """Record ``inner``'s changes as one line of ``handle`` (toggled and undone with it)."""
    handle.record(change, inner.suspend if inner.toggleable else inner.undo, inner.resume if inner.toggleable else None)
