"""compile: ``torch.compile`` what the training step runs (and, through AOTAutograd, its backward).

Speeds up: chains of element-wise and reduction ops (fused into Triton/C++ kernels), Python
overhead, and with ``mode="reduce-overhead"`` kernel-launch overhead (CUDA graphs).
Does not help: models already dominated by large GEMMs in one kernel each; very dynamic shapes
(recompilations). Costs compile time at the first steps.
Needs: a Python that TorchDynamo supports; Inductor on CPU needs a C++ compiler.
Numerics: the same function; dropout draws its masks from Inductor's own random stream. Fused kernels
reorder some reductions.

What is compiled is what the training step calls, read from its source: a LightningModule whose
``training_step`` calls ``self(...)`` gets its own ``forward`` compiled; one whose step calls
``self.model(...)`` (or ``self.backbone(...)`` and ``self.head(...)``, also through helper methods
and local aliases) gets those modules' forwards compiled. A plain module's forward is compiled.
Each is compiled the way Lightning does it (the module's ``forward`` replaced by its compiled
version, the module itself untouched), so state dicts, hooks and optimizers see the same modules.
Under FSDP2 (``fully_shard`` on each block of a module, Lightning's ``ModelParallelStrategy``) that
module's repeated blocks are compiled one by one instead (regional compilation: one graph for all of
them, FSDP's collectives in its hooks outside it). The blocks of one list share one copy of their
forward per configuration (an earlier compile of the class's forward, the user's own, cannot have used
up Dynamo's entries for it), and a transformers model's KV cache is off for the fit: a training forward
fills it and nothing reads it, and since each layer stores into it by its index Dynamo compiled one graph
per layer (8 at its default limit, the other layers eagerly), not one for all.

Once trial steps ran, the report lists per compiled forward its calls, graphs and recompiles, and
the graph breaks with their reasons. Guards: a compilation failure falls back to the eager forward
with a warning, a recompilation storm (more than ``max_recompiles`` new graphs, not counting those
a call compiles right after a rung or a parity check switched the configuration) too, and a compile
the step never ran ("compiled nothing that the training step runs") is a failed rung, not a slow one.
Each configuration compiles once: while compile is on, Dynamo may keep 64 compiled entries per frame (not
8), and a rung beneath it that the trials switch off is off under compile too. The ``inductor`` option
takes Inductor settings for these forwards only (``{coordinate_descent_tuning: true}``).

Hugging Face models call ``logger.warning_once`` inside ``forward`` (transformers 5 does in
``loss_function`` when the config's ``loss_type`` is None), and Dynamo breaks the graph at every
logging call: the loss then runs eagerly after the compiled forward. Where a compiled module is a
transformers model, Dynamo is told to skip those calls inside compiled code (such a message is not
printed from there); undo takes it back.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from speedkit import compat
from speedkit.errors import first_line
from speedkit.handle import configuration_changes, traced_configuration
from speedkit.rewrite.source import is_user_function, parse_function
from speedkit.rungs.base import AttributeWrapper, Handle, Rung, active_dropouts
from speedkit.rungs.fsdp_knob import sharded_blocks
from speedkit.training.state import TrainState


@dataclass
class CompileOptions:
    """Options of the compile rung (passed to ``torch.compile``)."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    fullgraph: bool = False
    #: None lets torch decide (static first, dynamic after a shape change)
    dynamic: bool | None = None
    backend: str = "inductor"
    #: new graphs tolerated after the first before falling back to eager
    max_recompiles: int = 8
    #: Inductor settings for these compiled forwards only (``torch.compile(options=...)``), on top of
    #: those of ``mode``; e.g. ``{coordinate_descent_tuning: true}`` tunes each generated kernel's
    #: launch configuration by measurement (longer compile, a faster step on some GPUs)
    inductor: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.max_recompiles < 0:
            raise ValueError(f"max_recompiles must be >= 0, found {self.max_recompiles}")
        if self.inductor is not None:
            if not isinstance(self.inductor, dict) or not all(isinstance(k, str) for k in self.inductor):
                raise ValueError(f"inductor must map Inductor setting names to values, found {self.inductor!r}")
            unknown = compat.unknown_inductor_settings(self.inductor)
            if unknown:
                raise ValueError(
                    f"{unknown[0]!r} is not an Inductor setting of torch {torch.__version__}; "
                    "check its spelling against Inductor's config module"
                )
            if self.backend != "inductor":
                raise ValueError(f"inductor settings need backend 'inductor', found backend {self.backend!r}")

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile``: ``mode`` alone, or (torch accepts one or the
        other) the mode's own Inductor settings merged with ``inductor`` as ``options``."""
        kwargs: dict[str, Any] = dict(fullgraph=self.fullgraph, dynamic=self.dynamic, backend=self.backend)
        if not self.inductor:
            kwargs["mode"] = None if self.mode == "default" else self.mode
        else:
            kwargs["options"] = {**compat.inductor_mode_options(self.mode), **self.inductor}
        return kwargs

    def describe(self) -> str:
        settings = f", options={self.inductor!r}" if self.inductor else ""
        return f"mode={self.mode!r}{settings}, fullgraph={self.fullgraph}, dynamic={self.dynamic}, backend={self.backend!r}"


class GuardedForward(AttributeWrapper):
    """A compiled forward that falls back to eager on a compile failure or a recompilation storm,
    and counts what it ran: calls, graphs compiled during them, recompiles. A copy of the module
    (deepcopy, pickle) gets the eager forward, bound to the copy (see :class:`AttributeWrapper`).

    It compiles the forward in effect beneath it (:meth:`use`), one compiled function per distinct
    forward: when another rung switches the forward it wraps (a rewritten one, or the class's own),
    compile follows, and switching back reuses what was compiled, so it is never compiled twice."""

    def __init__(
        self, eager: Any, compile_fn: Callable[[Any], Any], max_recompiles: int, codes: dict[Any, Any] | None = None
    ) -> None:
        self._compile_fn = compile_fn
        #: a group's blocks share this: one copy of the forward's function per configuration, bound to
        #: each block (see :meth:`use`); None: a copy of this module's own for each configuration
        self._codes = codes
        self._variants: dict[tuple[int, int], _Variant] = {}
        self.max_recompiles = max_recompiles
        self.fallback_reason: str | None = None
        self.recompiles = 0
        #: graphs compiled on the first call after a rung or a parity check switched the configuration
        #: (another precision, tf32, dropout at 0): each configuration compiles once, not a storm
        self.switch_graphs = 0
        self.calls = 0
        self.graphs = 0
        self._changes_seen = configuration_changes()
        self.use(eager)
        functools.update_wrapper(self, eager)

    def use(self, eager: Any) -> None:
        """Compile (once per configuration) and run ``eager``, the forward now in effect beneath this one.

        A configuration is that forward and the changes in effect that alter what it traces
        (:func:`speedkit.handle.traced_configuration`: rewrites, wrapped submodule forwards, layouts,
        precisions). Dynamo keeps its compiled code per code object, and a frame whose graph broke
        inside a submodule guards nothing of what lies past the break: a change there (a submodule's
        forward wrapped so that it no longer breaks) would run the frame's old, split graphs, where a
        fresh process applying the same change first traces one graph (the demo Transformer's cached
        re-check compiled its whole-model graph from scratch every time, 0 of 4 from Inductor's cache,
        because the climb had kept running the split one). So each configuration compiles a copy of
        the forward with a code object of its own, traced from the top; switching back to a
        configuration runs what it compiled. The first configuration too: the function's own code is
        every instance's (``nn.Sequential.forward``: every Sequential's in the process), and where the
        process's earlier compiles have used up Dynamo's entries for it (the user's, an earlier fit's),
        Dynamo runs it eagerly, compiling nothing."""
        func, owner = getattr(eager, "__func__", eager), getattr(eager, "__self__", None)
        key = (id(func), id(owner), traced_configuration())
        if key not in self._variants:
            if self._codes is not None:
                # a group of blocks (one class's forward): the copy of each configuration is the group's,
                # so the blocks share its compiled entries, and none made before (the user's own compile of
                # the class's forward, an earlier fit's) uses up Dynamo's entries for it
                code_key = (id(func), key[2])
                if code_key not in self._codes:
                    self._codes[code_key] = _with_own_code(func)
                shared = self._codes[code_key]
                traced = types.MethodType(shared, owner) if owner is not None and eager is not func else shared
            else:  # a copy for each configuration, the first too: see the class's doc
                traced = _with_own_code(eager)
            self._variants[key] = _Variant(eager, self._compile_fn(traced))
        self._variant = self._variants[key]
        self.eager = self._variant.eager

    @property
    def wrapped(self) -> Any:  # type: ignore[override]
        return self.eager

    @property
    def runs_dynamo(self) -> bool:
        """It runs compiled code (not fallen back to eager): see ``compat.runs_compiled_code``."""
        return self.fallback_reason is None

    @property
    def variants(self) -> int:
        """How many distinct forwards were compiled."""
        return len(self._variants)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if compat.is_compiling():  # called inside another compiled forward: traced into that graph
            return self.eager(*args, **kwargs)
        self.calls += 1
        if self.fallback_reason is not None:
            return self.eager(*args, **kwargs)
        variant = self._variant
        changes = configuration_changes()
        switched, self._changes_seen = changes != self._changes_seen, changes
        before = compat.graph_count()
        given_up = compat.frames_given_up() if variant.first_graphs is None else None
        try:
            out = variant.compiled(*args, **kwargs)
        except compat.compile_errors() as exc:
            self._fall_back(f"torch.compile failed ({type(exc).__name__}: {first_line(exc, type(exc).__name__)[:200]})")
            return self.eager(*args, **kwargs)
        new_graphs = compat.graph_count() - before
        self.graphs += new_graphs
        if variant.first_graphs is None:
            variant.first_graphs = new_graphs  # the first call may compile several graphs (graph breaks)
            if given_up is not None and not new_graphs:
                self._nothing_compiled(given_up)
        elif new_graphs and switched:
            self.switch_graphs += new_graphs
        elif new_graphs:
            self.recompiles += new_graphs
            if self.recompiles > self.max_recompiles:
                self._fall_back(
                    f"recompilation storm: {self.recompiles} recompiles, more than max_recompiles={self.max_recompiles}"
                )
        return out

    def _nothing_compiled(self, before: tuple[int, dict[str, int]]) -> None:
        """The first call compiled no graph: fall back, with Dynamo's reason, when Dynamo gave up on
        the forward (it then runs eagerly inside the compiled wrapper; timing it would compare eager
        with eager). A first call whose graphs were in the compile cache tried no frame."""
        frames, reasons = compat.frames_given_up()
        if frames <= before[0]:
            return
        new = [reason for reason, n in reasons.items() if n > before[1].get(reason, 0)]
        why = ""
        if new:
            lines = [line.strip() for line in new[0].splitlines() if line.strip()]
            context = next((line for line in lines if line.startswith("Developer debug context:")), "")
            why = f": {lines[0][:120]}" + (f" ({context.split(':', 1)[1].strip()[:160]})" if context else "")
        self._fall_back(f"compiled no graph: Dynamo gave up on the forward{why}", stacklevel=4)

    def _fall_back(self, reason: str, stacklevel: int = 3) -> None:
        self.fallback_reason = reason
        warnings.warn(f"speedkit compile: {reason}; running the eager forward from now on", stacklevel=stacklevel)


def _with_own_code(fn: Any) -> Any:
    """``fn`` (a function or a bound method) with a code object of its own, which Dynamo traces as
    its top frame: the same function, whose compiled entries Dynamo keeps apart from every other's.
    A copy of its code; where Dynamo would not trace ``fn``'s own frame (torch's own forwards:
    :func:`speedkit.compat.dynamo_skips_as_top_frame`), a copy of a frame of speedkit's that calls it
    (Dynamo traces into torch's modules from there), so that it is not compiled in the wrapper frame
    every such compile in the process shares. ``fn`` itself where it is neither."""
    func = getattr(fn, "__func__", fn)
    if not isinstance(func, types.FunctionType):
        return fn
    traced = func
    if compat.dynamo_skips_as_top_frame(func):

        def forward(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        functools.update_wrapper(forward, func)
        del forward.__wrapped__  # Dynamo would unwrap it back to torch's frame
        traced = forward
    code = traced.__code__.replace()
    copy = types.FunctionType(code, traced.__globals__, traced.__name__, traced.__defaults__, traced.__closure__)
    copy.__kwdefaults__ = traced.__kwdefaults__
    copy.__dict__.update(traced.__dict__)
    copy.__qualname__ = traced.__qualname__
    copy.__module__ = traced.__module__
    owner = getattr(fn, "__self__", None)
    return types.MethodType(copy, owner) if owner is not None and fn is not func else copy


@dataclass
class _Variant:
    """One forward and its compiled function; ``first_graphs``: graphs its first call compiled."""

    eager: Any
    compiled: Any
    first_graphs: int | None = None


def _wrap_forward(handle: Handle, module: nn.Module, guarded: GuardedForward, change: str) -> None:
    """``module.forward = guarded``, compiling the forward in effect each time it is set: a rung
    beneath that is switched off while compile is switched off and on again is then off under
    compile too, and undo puts back what was there when compile was last set, not a stale forward."""
    before: list[Any] = []

    def wrap() -> None:
        before[:] = [module.__dict__.get("forward", _ABSENT)]
        guarded.use(module.forward)
        module.forward = guarded

    def unwrap() -> None:
        previous = before.pop() if before else _ABSENT
        if previous is _ABSENT:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous

    wrap()
    handle.record(change, unwrap, wrap)


_ABSENT = object()


# -- what the training step runs ---------------------------------------------------------------------

_MAX_DEPTH = 3  # helper methods followed from training_step


def _user_method(obj: Any, name: str) -> Any:
    """``type(obj).name`` when it is a plain function defined outside torch and Lightning."""
    fn = getattr(type(obj), name, None)
    return fn if is_user_function(fn) else None


def _method_tree(fn: Any) -> tuple[ast.FunctionDef, str] | None:
    """The parsed source of a method and the name of its ``self`` argument."""
    try:
        func = parse_function(fn).node
    except (OSError, TypeError, SyntaxError):
        return None
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or not func.args.args:
        return None
    return func, func.args.args[0].arg  # type: ignore[return-value]


def _chain(node: ast.expr, aliases: dict[str, list[str]], self_name: str) -> list[str] | None:
    """``self.a.b`` (or an alias of it) as ``["a", "b"]``; ``self`` as ``[]``; else None."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    if node.id == self_name:
        return names[::-1]
    if node.id in aliases:
        return aliases[node.id] + names[::-1]
    return None


def _resolve(root: nn.Module, path: list[str]) -> Any:
    obj: Any = root
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def step_modules(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The modules whose ``forward`` the training step calls, as ``(name, module)`` (``""`` for the
    model itself), and notes on calls left alone. Read from ``training_step`` (and the helper
    methods it calls); a model without one (plain PyTorch) is called by the user's loop itself."""
    step = _user_method(model, "training_step")
    if step is None:
        return [("", model)], []
    found: dict[int, tuple[str, nn.Module]] = {}
    notes: list[str] = []
    seen_methods: set[str] = set()

    def visit(fn: Any, depth: int) -> bool:
        parsed = _method_tree(fn)
        if parsed is None:
            return False
        func, self_name = parsed
        aliases: dict[str, list[str]] = {}
        for node in ast.walk(func):  # local names bound to self's attributes (model = self.model)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                path = _chain(node.value, aliases, self_name)
                if path and isinstance(_resolve(model, path), nn.Module):
                    aliases[node.targets[0].id] = path
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            path = _chain(node.func, aliases, self_name)
            if path is None:
                continue
            if path and path[-1] == "forward":
                path = path[:-1]
            target = _resolve(model, path)
            name = ".".join(path)
            if isinstance(target, nn.Module):
                if target is model and _user_method(model, "forward") is None:
                    continue
                if any(True for _ in target.parameters()) or target is model:
                    found.setdefault(id(target), (name, target))
                continue
            if len(path) == 1 and _user_method(model, path[0]) is not None and path[0] not in seen_methods:
                seen_methods.add(path[0])  # a helper method of the LightningModule: follow it
                if depth < _MAX_DEPTH:
                    visit(_user_method(model, path[0]), depth + 1)
            elif len(path) >= 2 and isinstance(_resolve(model, path[:-1]), nn.Module) and inspect.ismethod(target):
                notes.append(f"self.{name}(...) is not a forward; left eager")
        return True

    if not visit(step, 0):
        notes.append("the training_step's source could not be read: compiled the modules it most likely runs")
        if _user_method(model, "forward") is not None:
            return [("", model)], notes
        return [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())], notes
    return list(found.values()), notes


#: what the rung compiles, in groups said as one: (label, [(name, module), ...])
Targets = list[tuple[str, list[tuple[str, nn.Module]]]]


def compile_targets(model: nn.Module) -> tuple[Targets, list[str]]:
    """The modules whose forwards the rung compiles (:func:`step_modules`), each its own group, where one
    holds blocks that FSDP2's ``fully_shard`` sharded one by one (:func:`~speedkit.rungs.fsdp_knob.sharded_blocks`:
    a transformer's layers) those blocks instead, each compiled on its own (regional compilation, as
    torchtitan compiles under FSDP2): each block's all-gather and reduce-scatter run in FSDP's hooks
    around its compiled forward, outside the graph, and the blocks share one compiled graph (one
    compile for all of them); the rest of that module (embeddings, head, loss) runs eagerly. The blocks
    of one list and class are one group (``layers.0-21 (22 Block blocks).forward``)."""
    targets, notes = step_modules(model)
    groups: Targets = []
    for name, module in targets:
        blocks = sharded_blocks(module)
        if not blocks:
            groups.append((_label(model, name, module), [(name, module)]))
            continue
        names = {id(m): n for n, m in module.named_modules()}
        lists: dict[tuple[str, type], list[tuple[str, nn.Module]]] = {}
        for block in blocks:
            full = f"{name}.{names[id(block)]}" if name else names[id(block)]
            lists.setdefault((full.rpartition(".")[0], type(block)), []).append((full, block))
        for (parent, cls), members in lists.items():
            if len(members) == 1:
                groups.append((_label(model, *members[0]), members))
                continue
            first, last = (members[i][0].rpartition(".")[2] for i in (0, -1))
            where = f"{parent}.{first}-{last}" if parent else f"{first}-{last}"
            groups.append((f"{where} ({len(members)} {cls.__name__} blocks).forward", members))
        notes.append(
            f"{name or type(module).__name__} is sharded with FSDP2: its {len(blocks)} sharded blocks are compiled one by "
            "one (FSDP's gathers and reductions around them, eager), the rest of it runs eagerly"
        )
    return groups, notes


def _label(model: nn.Module, name: str, module: nn.Module) -> str:
    return f"{type(model).__name__}.forward" if not name else f"{name} ({type(module).__name__}).forward"


def check_compile(model: nn.Module, device: torch.device, backend: str = "inductor") -> str | None:
    if not compat.dynamo_supported():
        return f"torch.compile does not support Python {sys.version_info.major}.{sys.version_info.minor} with torch {torch.__version__}"
    if compat.dynamo_disabled():
        return "Dynamo is off in this process (TORCHDYNAMO_DISABLE=1 or TORCH_COMPILE_DISABLE=1): torch.compile would run eagerly"
    if compat.user_compiled(model):
        return "the model was compiled by the user (torch.compile before trainer.fit); left as is"
    if compat.is_compiled_module(model):
        return "the model is already a torch.compile'd module"
    groups, notes = compile_targets(model)
    if not groups:
        return "the training step calls no module with parameters" + (f" ({'; '.join(notes)})" if notes else "")
    for name, module in (member for _, members in groups for member in members):
        forward = module.__dict__.get("forward")
        if compat.is_compiled_module(module):
            return f"{_label(model, name, module)} is already compiled (torch.compile by the user); left as is"
        if isinstance(forward, GuardedForward) or compat.is_compiled_callable(forward):
            return f"{_label(model, name, module)} is already compiled"
    if backend == "inductor" and device.type == "cpu" and compat.inductor_cpu_compiler() is None:
        return "Inductor on CPU needs a C++ compiler (g++ or clang++) on PATH"
    return None


def _compile_forward(
    handle: Handle, module: nn.Module, shown: str, options: CompileOptions, codes: dict[Any, Any] | None = None
) -> GuardedForward:
    """Compile ``module``'s forward, said on ``handle`` as ``shown`` (nothing where it is ""; a block of a
    list its group says); ``codes``: its group's shared copies of the forward (:class:`GuardedForward`)."""
    kwargs = options.compile_kwargs()
    guarded = GuardedForward(module.forward, lambda fn: torch.compile(fn, **kwargs), options.max_recompiles, codes)
    # redo binds the compiled function of the forward then in effect: switching compile off and on
    # recompiles nothing; switching a rung beneath it compiles that forward once
    _wrap_forward(handle, module, guarded, f"{shown} = torch.compile(forward, {options.describe()})" if shown else "")
    return guarded


def _skip_library_logging(handle: Handle, modules: list[nn.Module]) -> None:
    """Have Dynamo skip transformers' ``Logger.warning_once`` in compiled code when one of ``modules``
    is a transformers model (see the module doc), recorded on ``handle`` with its undo and redo."""
    warning_once = getattr(logging.Logger, "warning_once", None)  # transformers adds it to every Logger
    if warning_once is None or not any(type(m).__module__.startswith("transformers.") for m in modules):
        return
    skipped = compat.dynamo_ignored_logging()
    if skipped is None or warning_once in skipped:
        return
    key = compat.dynamo_logging_key(warning_once)
    skipped.add(key)
    handle.record(
        "Dynamo skips transformers' logger.warning_once calls inside the compiled forwards (each would break "
        "the graph; such a message is not printed from compiled code)",
        functools.partial(skipped.discard, key),
        functools.partial(skipped.add, key),
    )


#: compiled entries Dynamo may keep per frame while compile is on: every configuration of the rungs
#: beneath (precision, tf32, layout, dropout at 0 for parity) is one entry, compiled once
CONFIGURATION_ENTRIES = 64


def _room_for_configurations(handle: Handle, blocks: int = 1) -> None:
    """Raise Dynamo's per-frame entry limit to :data:`CONFIGURATION_ENTRIES` (recorded, undone with
    the handle): past its default of 8, Dynamo would run a frame eagerly for good once the ladder has
    switched enough rungs beneath compile, while each entry is compiled once and reused. Recompiles
    that are no configuration's stay bounded by ``max_recompiles`` (:class:`GuardedForward`).
    ``blocks``: the largest group of blocks sharing a forward; blocks that specialize (an integer
    attribute each reads, its index) take an entry each, and at least twice that many are allowed."""
    limit, entries = compat.dynamo_recompile_limit(), max(CONFIGURATION_ENTRIES, 2 * blocks)
    if limit is None or limit >= entries:
        return
    compat.set_dynamo_recompile_limit(entries)
    handle.record(
        f"Dynamo's compiled entries per frame: at most {entries} (was {limit}): each configuration "
        "of the rungs beneath compile is one entry, compiled once"
        + (f", and each of {blocks} blocks that specializes on its own attributes one more" if blocks > 1 else ""),
        functools.partial(compat.set_dynamo_recompile_limit, limit),
        functools.partial(compat.set_dynamo_recompile_limit, entries),
    )


def _training_without_kv_cache(handle: Handle, model: nn.Module) -> None:
    """Turn transformers' KV cache off for the fit (``config.use_cache = False`` on each transformers
    model under ``model`` whose config has it on), recorded on ``handle`` with its undo and redo. In a
    training forward the cache only stores each layer's keys and values (nothing reads them: the loss is
    the same), and it does so by the layer's index, which Dynamo specializes on: blocks compiled one by
    one then compile one graph each (8 at Dynamo's default limit, the rest run eagerly) instead of one
    for all."""
    configs: dict[int, tuple[str, Any]] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if type(module).__module__.startswith("transformers.") and getattr(config, "use_cache", None) is True:
            configs.setdefault(id(config), (type(module).__name__, config))
    for owner, config in configs.values():
        config.use_cache = False
        handle.record(
            f"{owner}.config.use_cache = False (was True): the KV cache, which a training forward fills and "
            "nothing reads, keyed each layer's keys and values by its index, and Dynamo compiled one graph per "
            "layer on it; without it the layers share one",
            functools.partial(setattr, config, "use_cache", True),
            functools.partial(setattr, config, "use_cache", False),
        )


def apply_compile(model: nn.Module, options: CompileOptions) -> tuple[Handle, list[tuple[str, GuardedForward]]]:
    """Compile the forwards the training step runs; the handle reports what ran once steps did (a list
    of blocks compiled one by one in one line)."""
    handle = Handle("compile")
    groups, notes = compile_targets(model)
    targets = [module for _, members in groups for _, module in members]
    # each group said once: on its first member's change line, and in one line of the report
    regional = [members for _, members in groups if len(members) > 1]
    if regional:  # before the forwards are compiled: what they trace reads it
        _training_without_kv_cache(handle, model)
    guards = []
    for label, members in groups:
        codes: dict[Any, Any] | None = {} if len(members) > 1 else None
        for i, (name, module) in enumerate(members):
            guards.append(
                (_label(model, name, module), _compile_forward(handle, module, label if i == 0 else "", options, codes))
            )
    for note in notes:
        handle.record(f"note: {note}")
    _skip_library_logging(handle, targets)
    _room_for_configurations(handle, max((len(members) for members in regional), default=1))
    breaks_before = compat.graph_breaks()

    def problem() -> str | None:
        for label, guarded in guards:
            if guarded.fallback_reason:
                return f"{label}: {guarded.fallback_reason}"
        if guards and not any(g.calls for _, g in guards):
            return f"compiled nothing that the training step runs ({', '.join(label for label, _ in guards)} never called)"
        return None

    def report() -> list[str]:
        lines, done = [], 0
        for label, group in groups:
            members = [g for _, g in guards[done : done + len(group)]]
            done += len(group)
            calls, graphs = sum(g.calls for g in members), sum(g.graphs for g in members)
            recompiles, switch_graphs = sum(g.recompiles for g in members), sum(g.switch_graphs for g in members)
            lines.append(
                f"ran {label}: {calls} calls, {graphs} graphs compiled, {recompiles} recompiles"
                + (f" ({switch_graphs} graphs for configurations other rungs switched)" if switch_graphs else "")
                + (
                    " (its graphs were already in this process's compile cache)"
                    if calls and not graphs and not any(g.fallback_reason for g in members)
                    else ""
                )
            )
        after = compat.graph_breaks()
        new = {reason: n - breaks_before.get(reason, 0) for reason, n in after.items() if n > breaks_before.get(reason, 0)}
        if not new:
            lines.append("graph breaks: none")
        else:
            top = sorted(new.items(), key=lambda kv: -kv[1])
            shown = "; ".join(f"{n}x {reason.splitlines()[0][:160]}" for reason, n in top[:5])
            lines.append(f"graph breaks: {sum(new.values())} ({shown}{'; ...' if len(top) > 5 else ''})")
        return lines

    handle.problem = problem
    handle.report = report
    # Inductor draws dropout masks from its own generator: the same function, other masks
    handle.draws_differently = any(active_dropouts(module) for module in targets)
    return handle, guards


class CompileRung(Rung):
    name = "compile"
    off_at_full_precision = True  # a rewrite is judged at full precision on its arithmetic alone
    # Inductor fuses elementwise ops, norms, a loss computed in the compiled forward and the copies between
    # them; fewer kernels and no Python per op on the host; fused kernels keep fewer activations
    targets = ("elementwise", "normalization", "loss", "memcpy", "host", "memory")
    cuts_host_work = True
    new_shape_cost = True  # a new shape compiles again (or once more, dynamic)
    lightning_stage_sharded = "fit_start"  # block by block, once configure_model sharded them
    Options = CompileOptions

    def check(self, state: TrainState) -> str | None:
        return check_compile(state.model, state.device, self.options.backend)

    def apply(self, state: TrainState) -> Handle:
        return apply_compile(state.model, self.options)[0]
