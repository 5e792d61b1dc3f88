"""The one pipeline of the source-rewriting rungs, in the order it runs:

``parse`` (:mod:`speedkit.rewrite.source`, cached per class) → ``find`` (a matcher's pure reading of
the source, cached per parsed method) → ``decide`` (per instance: a decision per site, or a reason it
is left alone) → made into one :class:`RewritePlan` in ``check``, reused by ``apply`` while the model
is unchanged (:class:`PlanCache`) → ``emit`` (the matcher's emitter, on a fresh copy of the source)
→ ``compile`` (cached per parsed method and decisions) → ``bind`` on a :class:`~speedkit.handle.Handle`,
which undoes it; :func:`swap_class` gives an instance another class on the same terms. What was
rewritten and left alone is a typed :class:`RewriteReport`, set as ``handle.rewrite``.

A rewriter (:class:`Rewriter`) is a tag, a ``find`` and an ``emit``: sdpa's is in
:mod:`speedkit.rewrite.attention`, batched's in :mod:`speedkit.rewrite.gemms`, triton_layers' in
:mod:`speedkit.rewrite.layers`.
"""

from __future__ import annotations

import ast
import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speedkit.handle import Handle
from speedkit.rewrite.source import NotRewritable, ParsedMethod, bind_method, compile_method, copy_tree, parse_instance_method


@dataclass
class Found:
    """What a matcher finds in one method's source: its sites (in a deterministic walk: site k of a copy
    of the tree is site k of the original) and its near misses (the matcher's own notes)."""

    sites: list[Any] = field(default_factory=list)
    notes: list[Any] = field(default_factory=list)


@dataclass
class Decided:
    """What one instance gets: a decision per site (falsy: left as written), a line per rewrite made,
    the reasons for what is left alone, and submodules the rewrite now runs itself (left as they are)."""

    decisions: tuple[Any, ...] = ()
    done: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    takes_over: list[nn.Module] = field(default_factory=list)


@dataclass(frozen=True)
class Rewriter:
    """A matcher and an emitter: ``find(parsed) -> Found`` reads a method, pure;
    ``emit(parsed, tree, decisions)`` rewrites ``tree`` (a fresh copy of ``parsed.tree``) in place."""

    tag: str
    find: Callable[[ParsedMethod], Found]
    emit: Callable[[ParsedMethod, ast.FunctionDef, tuple[Any, ...]], None]


@dataclass
class MethodRewrite:
    """One instance's method, rewritten as decided."""

    module: nn.Module
    method: str
    parsed: ParsedMethod
    decisions: tuple[Any, ...]
    done: list[str]


@dataclass
class RewritePlan:
    """What a rewrite rung will do to one model, made in ``check`` and applied in ``apply``."""

    rewrites: list[MethodRewrite] = field(default_factory=list)
    #: instances given another class (:func:`swap_class`), as (module, new class)
    swaps: list[tuple[nn.Module, type]] = field(default_factory=list)
    #: ready-made functions bound to an instance, as (module, method name, function, description)
    bindings: list[tuple[nn.Module, str, Callable[..., Any], str]] = field(default_factory=list)
    #: sites per kind, for the report
    counts: Counter[str] = field(default_factory=Counter)
    left_alone: list[str] = field(default_factory=list)
    #: what the rung does beyond rewriting (sdpa: the libraries' switches; triton_layers: Hugging Face losses)
    extra: Any = None


@dataclass(frozen=True)
class RewriteReport:
    """What a rewrite rung rewrote and left alone (``handle.rewrite``): counts per kind in the rung's
    order, the rewrites made (where the rung lists them) and the reasons for what was left alone."""

    rung: str
    counts: dict[str, int]
    left_alone: tuple[str, ...] = ()
    rewrites: tuple[str, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data: the counts, ``rewrites`` where listed, ``left_alone``."""
        out: dict[str, Any] = dict(self.counts)
        if self.rewrites is not None:
            out["rewrites"] = list(self.rewrites)
        out["left_alone"] = list(self.left_alone)
        return out


# -- find, decide: the plan ---------------------------------------------------------------------------


@functools.cache
def find(rewriter: Rewriter, parsed: ParsedMethod) -> Found:
    """The rewriter's sites in ``parsed`` (cached: a class's source is read once)."""
    return rewriter.find(parsed)


def plan_rewrites(
    rewriter: Rewriter,
    targets: Iterable[tuple[nn.Module, str]],
    decide: Callable[[nn.Module, ParsedMethod, Found], Decided],
    refused: Callable[[nn.Module, str, NotRewritable], str | None] = lambda *_: None,
) -> tuple[list[MethodRewrite], list[str]]:
    """Parse, find and decide for each (instance, method name) of ``targets``: the rewrites, and what
    is left alone (``refused`` words a method that cannot be rewritten, or says nothing)."""
    rewrites: list[MethodRewrite] = []
    left_alone: list[str] = []
    taken_over: set[int] = set()
    for module, method in targets:
        if id(module) in taken_over:
            continue
        try:
            parsed = parse_instance_method(module, method)
        except NotRewritable as exc:
            note = refused(module, method, exc)
            if note:
                left_alone.append(note)
            continue
        decided = decide(module, parsed, find(rewriter, parsed))
        left_alone += decided.notes
        if decided.done:
            rewrites.append(MethodRewrite(module, method, parsed, decided.decisions, decided.done))
        taken_over.update(id(m) for m in decided.takes_over)
    return rewrites, list(dict.fromkeys(left_alone))


class PlanCache:
    """The plan ``check`` made, handed to ``apply`` for the same model and options unless the model
    changed since (another rung rebound a method, swapped a class or a tensor, added a hook, changed
    an attribute): then it is made again. Tensor values are not compared."""

    def __init__(self) -> None:
        self._model: weakref.ref[nn.Module] | None = None
        self._key: Any = None
        self._plan: RewritePlan | None = None

    def plan(self, model: nn.Module, options: Any, make: Callable[[], RewritePlan]) -> RewritePlan:
        key = (repr(options), _fingerprint(model))
        if self._plan is None or self._model is None or self._model() is not model or key != self._key:
            self._plan = make()
            self._model, self._key = weakref.ref(model), key
        return self._plan


def _fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """What a plan depends on, as a comparable value: each module's identity, class and attributes
    (plain values by value, containers by what they hold, anything else by identity), and the dtype,
    device and shape of its tensors."""

    def value(v: Any) -> Any:
        if isinstance(v, (bool, int, float, str, type(None))):
            return v
        if isinstance(v, dict):
            return tuple((k, id(x)) for k, x in v.items())
        return id(v)

    out: list[Any] = []
    for m in model.modules():
        tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        out.append(
            (
                id(m),
                type(m),
                tuple((k, value(v)) for k, v in vars(m).items()),
                tuple((t.dtype, t.device, tuple(t.shape)) for t in tensors if isinstance(t, torch.Tensor)),
            )
        )
    return tuple(out)


# -- emit, compile, bind: the apply ----------------------------------------------------------------------


@functools.cache
def compiled(rewriter: Rewriter, parsed: ParsedMethod, decisions: tuple[Any, ...]) -> Callable[..., Any]:
    """The rewritten method for one tuple of decisions (shared by all instances that run ``parsed``)."""
    tree = copy_tree(parsed)
    rewriter.emit(parsed, tree, decisions)
    return compile_method(parsed, tree, rewriter.tag)


def apply_plan(handle: Handle, rewriter: Rewriter, plan: RewritePlan, describe: Callable[[MethodRewrite], str]) -> None:
    """Swap the plan's classes, bind its functions and its rewritten methods (``describe`` words each),
    in that order, on ``handle`` (a fresh one, nested by the rung: on an error it is undone and the
    error raised)."""
    try:
        for module, new_class in plan.swaps:
            swap_class(handle, module, new_class)
        for module, method, function, description in plan.bindings:
            bind_method(handle, module, method, function, description)
        for rewrite in plan.rewrites:
            bind_method(
                handle, rewrite.module, rewrite.method, compiled(rewriter, rewrite.parsed, rewrite.decisions), describe(rewrite)
            )
    except Exception:
        handle.undo()
        raise


def swap_class(handle: Handle, module: nn.Module, new_class: type, description: str = "") -> None:
    """Give ``module`` the class ``new_class`` (the same object, parameters, hooks and state dict);
    ``handle`` assigns the original class back."""
    old_class = type(module)
    handle.record(
        description,
        functools.partial(setattr, module, "__class__", old_class),
        functools.partial(setattr, module, "__class__", new_class),
    )
    module.__class__ = new_class
