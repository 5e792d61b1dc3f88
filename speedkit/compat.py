"""Every private PyTorch / Lightning API speedkit touches, in one place, with version guards.

speedkit runs on torch 2.11 (the GPU machines) and 2.13 (the CPU machines), and Lightning 2.4+.
Anything below that is not public API is reached only through this module, each with the reason
it is needed and what happens when the private name moves: a guard that finds nothing answers
conservatively (no fused kernels, "not compiled", "no hooks known") instead of raising, so a new
release degrades speedkit's choices rather than breaking the user's run. ``tests/test_compat.py``
checks every entry against the installed versions.

Why one module of about 900 lines: the point of it is that a reviewer (or a new torch release) finds
every private name speedkit reaches in one file, grouped by subsystem (dynamo and inductor, autograd
and hooks, CUDA graphs, the allocator, Lightning's loop, trainer and precision internals); its entries
are short, independent functions that share no state, and splitting them would scatter exactly what
``tests/test_imports.py`` keeps in one place.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from speedkit.errors import ConfigError

# -- torch.compile (dynamo / inductor) -----------------------------------------------------------


def dynamo_supported() -> bool:
    """Whether TorchDynamo runs on this Python (``torch._dynamo.is_dynamo_supported``)."""
    check = getattr(getattr(torch, "_dynamo", None), "is_dynamo_supported", None)
    try:
        return bool(check()) if check is not None else True
    except Exception:
        return False


def dynamo_disabled() -> bool:
    """Dynamo is switched off in this process (``TORCHDYNAMO_DISABLE=1`` in the environment, which
    ``torch.compile`` reads on each call, or ``torch._dynamo.config.disable``, which
    ``TORCH_COMPILE_DISABLE=1`` sets): ``torch.compile`` then returns functions that run eagerly."""
    if os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        return True
    try:
        import torch._dynamo.config as dynamo_config

        return bool(getattr(dynamo_config, "disable", False))
    except Exception:
        return False


def dynamo_counters() -> dict[str, Any]:
    """Dynamo's global counters (``torch._dynamo.utils.counters``): graphs, graph breaks, frames.

    Read only around compilation (the compile rung's first calls), never on a hot path.
    """
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # moved: the rung then cannot count graphs and says so
        return {}
    return counters


def graph_count() -> int:
    """Unique graphs Dynamo compiled so far in this process (0 when the counter is unknown, or when
    nothing imported Dynamo yet: then it compiled nothing, and counting does not import it).
    Cheap: the measurement session reads it around every timed window."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0
    return int(dynamo_counters().get("stats", {}).get("unique_graphs", 0))


def compile_seconds() -> float:
    """Seconds this process spent compiling so far (Dynamo's own timings,
    ``torch._dynamo.utils.compilation_time_metrics``: each frame's compile, forward, and each backward
    compiled on its first call); 0.0 where nothing imported Dynamo or the timings are gone. Cheap."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0.0
    metrics = getattr(sys.modules["torch._dynamo.utils"], "compilation_time_metrics", None)
    if not isinstance(metrics, dict):
        return 0.0
    return float(sum(sum(metrics.get(k, ())) for k in ("_compile.compile_inner", "backward._backward_impl")))


#: the compiled graphs' cache counters :func:`compile_cache_counts` reads: (Dynamo's counter group, name)
_CACHE_COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
)


def compile_cache_counts(since: dict[str, int] | None = None) -> dict[str, int]:
    """Inductor's FX-graph cache and AOTAutograd's cache hits, misses and bypasses so far in this process
    (``torch._dynamo.utils.counters``; a miss or a bypass compiles that graph from scratch), less
    ``since`` (an earlier reading); {} where nothing imported Dynamo or the counters are gone. Cheap."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return {}
    try:
        now = {name: int(counters[group][name]) for group, name in _CACHE_COUNTERS}
    except (KeyError, TypeError, ValueError):
        return {}
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


def _dynamo_limit_name() -> str | None:
    """The name of Dynamo's per-frame entry limit in its config (``recompile_limit``, called
    ``cache_size_limit`` before torch 2.6); None where neither exists."""
    import torch._dynamo.config as dynamo_config

    return next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(dynamo_config, n)), None)


def dynamo_recompile_limit() -> int | None:
    """Dynamo's limit on compiled entries per code object; None where it has none. Past it Dynamo
    runs that frame eagerly for good."""
    import torch._dynamo.config as dynamo_config

    name = _dynamo_limit_name()
    return int(getattr(dynamo_config, name)) if name else None


def dynamo_skips_as_top_frame(fn: Any) -> bool:
    """Whether ``torch.compile(fn)`` would not trace ``fn``'s own frame: Dynamo skips the files of torch
    itself (``nn.Sequential.forward``, ``nn.TransformerEncoderLayer.forward``) and compiles such a
    function inside a wrapper frame whose code every such compile in the process shares
    (``torch._dynamo.external_utils.wrap_inline``), as it does every ``torch.compile(module)``: its
    compiled entries count against one limit for all of them (``torch._dynamo.trace_rules.check``,
    private; without it, whether ``fn`` is torch's own)."""
    func = getattr(fn, "__func__", fn)
    try:
        from torch._dynamo import trace_rules

        return bool(trace_rules.check(func))
    except Exception:
        return str(getattr(func, "__module__", "")).startswith("torch.")


def set_dynamo_recompile_limit(limit: int) -> None:
    """Set what :func:`dynamo_recompile_limit` reads (where it exists)."""
    import torch._dynamo.config as dynamo_config

    name = _dynamo_limit_name()
    if name:
        setattr(dynamo_config, name, limit)


@contextlib.contextmanager
def static_batch_shapes() -> Iterator[None]:
    """Dynamo compiles each new input shape as its own static graph (``automatic_dynamic_shapes``
    off) inside the block: a batch-size sweep times every size on the kernels a fit at that size
    gets, not the first size on static kernels and the others on one graph made dynamic by the
    second; each size is compiled once and found again in the cache. Put back after."""
    with _dynamo_setting("automatic_dynamic_shapes", False):
        yield


@contextlib.contextmanager
def _dynamo_setting(name: str, value: Any) -> Iterator[None]:
    """Dynamo's config ``name`` at ``value`` inside the block, put back after; where this torch has
    no such setting, nothing changes."""
    import torch._dynamo.config as dynamo_config

    before = getattr(dynamo_config, name, None)
    if before is None:
        yield
        return
    setattr(dynamo_config, name, value)
    try:
        yield
    finally:
        setattr(dynamo_config, name, before)


@contextlib.contextmanager
def floats_as_constants() -> Iterator[None]:
    """Dynamo traces every Python float as a constant inside the block (``specialize_float``), and so
    records none of them in its automatic-dynamic state: a rate set to another value for a while (dropout
    at 0 for parity) and put back is then compiled as another constant when the frame next compiles,
    not marked dynamic by the change. Marked dynamic, a float the backend cannot take as a tensor (a
    dropout rate passed to a fused attention) makes Dynamo trace the frame again from the start with it
    specialized (``TensorifyScalarRestartAnalysis``): on an H200 a GPT-2's forward traced twice, 9.6 s
    of its 29.5 s cached re-check. Put back after; where the setting is missing, nothing changes."""
    with _dynamo_setting("specialize_float", True):
        yield


def dynamo_restarts() -> int:
    """How many times so far in this process Dynamo began tracing a frame again from its start (its
    timed ``compile_attempt_N`` past the first: a graph break found, a float it had to specialize);
    0 where it keeps no such record."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0
    return sum(
        len(times)
        for name, times in compilation_time_metrics.items()
        if name.startswith("compile_attempt_") and name != "compile_attempt_0"
    )


def frames_given_up() -> tuple[int, dict[str, int]]:
    """Frames Dynamo tried to compile and gave up on so far (``counters["frames"]`` total minus ok;
    a frame found in the compile cache is not counted), and the reasons it could not trace
    (``counters["unimplemented"]``, by reason)."""
    counters = dynamo_counters()
    frames = counters.get("frames", {})
    return (
        int(frames.get("total", 0)) - int(frames.get("ok", 0)),
        {str(reason): int(n) for reason, n in counters.get("unimplemented", {}).items()},
    )


def graph_breaks() -> dict[str, int]:
    """Graph breaks so far in this process, by reason (``counters["graph_break"]``)."""
    return {str(reason): int(n) for reason, n in dynamo_counters().get("graph_break", {}).items()}


def dynamo_ignored_logging() -> set[Any] | None:
    """The logging functions Dynamo skips inside compiled code instead of breaking the graph there
    (``torch._dynamo.config.ignore_logging_functions``, a set the caller may add to and remove from,
    through :func:`dynamo_logging_key`); None where this torch has no such setting."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    found = getattr(config, "ignore_logging_functions", None)
    return found if isinstance(found, set) else None


class _LoggingFunctionKey(str):
    """An entry of Dynamo's ignored logging functions equal to one function (same hash, equal to it)
    that reads as the function's name where Dynamo writes its config as JSON.

    torch 2.11 logs its config with every compilation's metrics, ``json.dumps`` of each set sorted,
    and does not leave this set out (torch 2.14 does): a function in it fails that dump, and torch
    prints the TypeError's whole traceback at error level after each compilation. Dynamo only asks
    whether the logger method it meets is ``in`` the set, which this key answers as the function."""

    fn: Callable[..., Any]

    def __new__(cls, fn: Callable[..., Any]) -> _LoggingFunctionKey:
        key = super().__new__(cls, f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}")
        key.fn = fn
        return key

    def __hash__(self) -> int:
        return hash(self.fn)

    def __eq__(self, other: object) -> bool:
        return self.fn == (other.fn if isinstance(other, _LoggingFunctionKey) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles of Dynamo's config keep the function
        return type(self), (self.fn,)

    def __deepcopy__(self, memo: dict[int, Any]) -> _LoggingFunctionKey:
        return self


def dynamo_logging_key(fn: Callable[..., Any]) -> Any:
    """What to add to :func:`dynamo_ignored_logging`'s set for ``fn`` (see :class:`_LoggingFunctionKey`)."""
    return _LoggingFunctionKey(fn)


def is_compiling() -> bool:
    """Whether the caller is being traced by Dynamo (``torch.compiler.is_compiling``)."""
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check()) if check is not None else False


def compile_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's exception classes that mean "torch.compile could not compile this"."""
    try:
        from torch._dynamo import exc
    except ImportError:
        return ()
    names = ("BackendCompilerFailed", "Unsupported", "InternalTorchDynamoError", "TorchRuntimeError")
    return tuple(c for c in (getattr(exc, n, None) for n in names) if isinstance(c, type))


def end_failed_capture(device: torch.device, graph: Any) -> None:
    """Put CUDA's random generators back out of capture mode after a capture that raised.

    ``CUDAGraph.capture_end`` takes the generators registered with a graph out of capture mode only
    after the stream capture ended well; when it raised, they stay in it and the process's next
    random op on the device (dropout, ``torch.randn``) raises "Offset increment outside graph capture
    encountered unexpectedly". Capturing an empty graph runs the generators' capture prologue and
    epilogue once more, which ends it (torch 2.11 to 2.14); the empty graph is then freed."""
    if device.type != "cuda":
        return
    for cleanup in (graph.reset, lambda: torch.cuda.synchronize(device)):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - the failed capture's error may surface here once more
            pass
    empty = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():  # "the CUDA graph is empty": it is meant to be
        warnings.simplefilter("ignore")
        with torch.cuda.stream(torch.cuda.Stream(device)):
            empty.capture_begin()
            empty.capture_end()
    empty.reset()


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """The Inductor settings a ``torch.compile`` mode stands for ({} for "default"), so that a mode
    and extra settings can go to ``torch.compile`` together as ``options``."""
    if mode == "default":
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def unknown_inductor_settings(names: Iterable[str]) -> list[str]:
    """The names that are not Inductor settings of this torch (``torch.compile(options=...)`` keys)."""
    from torch._inductor import config as inductor_config

    known = set(inductor_config.get_config_copy())
    return [n for n in names if n not in known]


def is_compiled_module(module: Any) -> bool:
    """``module`` is the wrapper ``torch.compile(module)`` returns (``OptimizedModule``)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return hasattr(module, "_orig_mod")
    return isinstance(module, OptimizedModule)


def is_compiled_callable(fn: Any) -> bool:
    """``fn`` is a function returned by ``torch.compile(fn)`` (it keeps the original callable)."""
    return hasattr(fn, "_torchdynamo_orig_callable")


def user_compiled(module: nn.Module) -> bool:
    """The user ran ``trainer.fit(torch.compile(model))``: Lightning unwrapped the compiled module
    and keeps how it was compiled on the LightningModule (``_compiler_ctx``)."""
    return bool(getattr(module, "_compiler_ctx", None))


def runs_compiled_code(model: nn.Module) -> bool:
    """Some module of ``model`` runs what ``torch.compile`` compiled: ``nn.Module.compile()`` (its
    ``_compiled_call_impl``), a compiled submodule, a compiled forward set on an instance (speedkit's
    compile rung marks its own ``runs_dynamo`` while it does), or the user's
    ``trainer.fit(torch.compile(model))``."""
    if user_compiled(model):
        return True
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None or is_compiled_module(module):
            return True
        forward = vars(module).get("forward")
        if forward is not None and (is_compiled_callable(forward) or getattr(forward, "runs_dynamo", False)):
            return True
    return False


def inductor_cpu_compiler() -> str | None:
    """The C++ compiler Inductor uses on CPU, or None when none is on PATH."""
    try:
        from torch._inductor import config as inductor_config
    except ImportError:
        return shutil.which("g++") or shutil.which("clang++")
    cxx = inductor_config.cpp.cxx
    names = [c for c in (cxx if isinstance(cxx, tuple) else (cxx,)) if c]
    for name in [*names, "g++", "clang++"]:
        if shutil.which(name):
            return name
    return None


# -- optimizers ----------------------------------------------------------------------------------


#: the attribute an optimizer built with ``fused=True`` sets; GradScaler reads it to let the fused
#: kernel unscale gradients itself instead of calling ``unscale_`` first
AMP_SCALING_FLAG = "_step_supports_amp_scaling"


def step_counter_device(group: dict[str, Any], param: torch.Tensor) -> torch.device:
    """Where ``torch.optim`` keeps ``param``'s step counter under ``group``'s flags: on the parameter's
    device when the group is fused or capturable (the step runs without host reads), else on the CPU.
    (ASGD keeps its own on the device either way; it steps correctly with them on the CPU too.)"""
    return param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def place_step_counters(optimizer: torch.optim.Optimizer, group: dict[str, Any], device_dtype: torch.dtype | None = None) -> None:
    """``group``'s step counters moved where its flags (just switched) keep them
    (:func:`step_counter_device`); on a device, in ``device_dtype`` when given (fused kernels read fp32)."""
    for p in group["params"]:
        state = optimizer.state.get(p)
        step = state.get("step") if state else None
        if isinstance(step, torch.Tensor):
            device = step_counter_device(group, p)
            state["step"] = (
                step.to(device, device_dtype) if device_dtype is not None and device.type != "cpu" else step.to(device)
            )


# -- CPU capabilities ----------------------------------------------------------------------------


#: the environment variable that forces :func:`cpu_has_bf16`'s answer: "1" (has them) or "0" (has none)
CPU_BF16_OVERRIDE = "SPEEDKIT_CPU_BF16"


@functools.cache
def cpu_has_bf16() -> bool:
    """The CPU has bf16 instructions oneDNN uses (AVX512-BF16 / AMX): bf16 pays on it.

    ``$SPEEDKIT_CPU_BF16`` forces the answer: ``1`` says it has them, ``0`` that it has none (unset or
    empty: ask oneDNN); any other value is a :class:`~speedkit.errors.ConfigError`. The tf32 and autocast
    rungs decide on this answer, so CI machines differ in it (an AMD without, a Xeon with AMX); the test
    suite is run with it forced each way, which shows no test's expectation depends on the host. Read
    once per process (``cpu_has_bf16.cache_clear()`` reads the variable again)."""
    forced = os.environ.get(CPU_BF16_OVERRIDE, "")
    if forced:
        if forced not in ("0", "1"):
            raise ConfigError(
                CPU_BF16_OVERRIDE,
                f"expected 1 (the CPU has bf16 instructions) or 0 (it has none), found {forced!r}; unset it to ask the CPU",
            )
        return forced == "1"
    return cpu_bf16_instructions()


def cpu_bf16_instructions() -> bool:
    """What oneDNN says of this CPU's bf16 instructions, whatever ``$SPEEDKIT_CPU_BF16`` forces: what
    a bf16 kernel that only oneDNN's bf16 path runs (a bf16 LSTM) needs in fact."""
    if not torch.backends.mkldnn.is_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:
        return False


# -- modules -------------------------------------------------------------------------------------


def set_metric_update_count(metric: Any, count: int) -> None:
    """Put a torchmetrics ``Metric``'s update count (``update_count``, read-only) back to ``count``
    after ``reset()`` zeroed it, writing its private ``_update_count``; a metric without that
    attribute keeps the count ``reset()`` left (it reads "never updated" until its next update)."""
    if hasattr(metric, "_update_count"):
        metric._update_count = count


def has_hooks(module: nn.Module) -> bool:
    """``module`` (or every module, through global hooks) has forward/backward hooks: a rewrite that
    bypasses its ``forward`` would skip them."""
    from torch.nn.modules import module as module_globals

    local = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    glob = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")
    return any(getattr(module, n, None) for n in local) or any(getattr(module_globals, n, None) for n in glob)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Map ``fn`` over the leaves of nested lists/tuples/dicts (torch's pytree)."""
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


# -- data loaders --------------------------------------------------------------------------------


def trial_loader(loader: Any) -> Any:
    """A loader to iterate during trials without touching the user's: for a ``DataLoader``, a
    shallow copy (same dataset, sampler, collate, workers, generator) without its live iterator.

    Needed because a ``persistent_workers`` DataLoader hands every ``iter()`` the same live iterator,
    and Lightning creates the first epoch's before ``on_train_start``: iterating the user's loader
    in the trials would reset the iterator training is about to read from.
    """
    if not isinstance(loader, torch.utils.data.DataLoader):
        return loader
    clone = copy.copy(loader)
    clone.__dict__["_iterator"] = None  # DataLoader.__setattr__ guards some attributes; not this one
    return clone


def shutdown_workers(loader: Any) -> None:
    """Stop the worker processes of a ``persistent_workers`` DataLoader's live iterator (if any)."""
    it = getattr(loader, "_iterator", None)
    if it is None:
        return
    shutdown_iterator(it)
    loader.__dict__["_iterator"] = None


def has_live_iterator(loader: Any) -> bool:
    """Whether a ``persistent_workers`` DataLoader keeps a live iterator (its workers run; the next
    ``iter()`` resets it instead of starting workers)."""
    return getattr(loader, "_iterator", None) is not None


def set_persistent_workers(loader: Any, value: bool) -> None:
    """Set a DataLoader's ``persistent_workers`` after construction: ``DataLoader.__setattr__``
    refuses it once the loader is initialized, so it is written to the instance dict (the attribute
    is a plain one that ``__iter__`` reads)."""
    loader.__dict__["persistent_workers"] = bool(value)


def set_loader_samplers(loader: Any, sampler: Any, batch_sampler: Any) -> None:
    """Set a DataLoader's ``sampler`` and ``batch_sampler`` after construction (``DataLoader.__setattr__``
    refuses both once it is initialized; ``__iter__`` and ``__len__`` read the plain attributes)."""
    loader.__dict__["sampler"] = sampler
    loader.__dict__["batch_sampler"] = batch_sampler


def shutdown_iterator(iterator: Any) -> None:
    """Stop the worker processes of a DataLoader iterator (``_shutdown_workers``), if it has any."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


#: the environment variable kineto (torch.profiler's library) reads when a profile with CUDA activities
#: stops: unless it is "1", NVIDIA's CUPTI stays attached to the process for good, and every later kernel
#: launch pays its callbacks (pytorch/pytorch#144455: 10-20% on training; bench/cupti_residue.py measured +32% per
#: launch and 1.26x on a launch-bound step, H100). Read with ``getenv`` at the stop, so setting it for the window is enough.
CUPTI_TEARDOWN_VARIABLE = "TEARDOWN_CUPTI"


def cupti_teardown_safe() -> bool:
    """Whether CUPTI may be detached after a profile in a process that captures CUDA graphs: torch's own
    workaround keeps it attached on CUDA before 12.6 (a lazy re-attach after a teardown crashed there)."""
    version = getattr(torch.version, "cuda", None)
    if not version:
        return True  # a CPU build: no CUPTI to detach
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (12, 6)


@contextlib.contextmanager
def cupti_detached_after() -> Iterator[str | None]:
    """For a profile window with CUDA activities: CUPTI is detached when the window stops
    (:data:`CUPTI_TEARDOWN_VARIABLE` set to "1" for the window, the user's environment as it was after
    it). Yields why it is left attached, if it is: the user (or torch, for its own CUDA graphs) set the
    variable already, or this CUDA is one where detaching is unsafe."""
    if CUPTI_TEARDOWN_VARIABLE in os.environ:
        value = os.environ[CUPTI_TEARDOWN_VARIABLE]
        yield None if value == "1" else f"{CUPTI_TEARDOWN_VARIABLE}={value} in the environment"
        return
    if not cupti_teardown_safe():
        yield f"CUDA {torch.version.cuda} (torch detaches CUPTI only from 12.6 on, beside CUDA graphs)"
        return
    os.environ[CUPTI_TEARDOWN_VARIABLE] = "1"
    try:
        yield None
    finally:
        os.environ.pop(CUPTI_TEARDOWN_VARIABLE, None)


#: lines the profiler's C++ library (kineto) writes to the process's stderr on its own at each start and
#: stop, on CPU builds of torch: "USDT:... SyncActivityProfilerHandler.cpp:39] profiler_start", "ERROR:...
#: DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35"
_KINETO_LINE = re.compile(rb"^(USDT|ERROR|WARNING|INFO):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w+\.cpp:\d+\]")


@contextlib.contextmanager
def kineto_lines_dropped() -> Iterator[None]:
    """For the duration, the process's stderr (its file descriptor 2) passes through a filter that drops
    the lines kineto writes itself (:data:`_KINETO_LINE`) and forwards every other line as it comes: a
    profile window's start and stop printed them into the user's console, where they say nothing to
    act on. Where stderr has no descriptor to filter, nothing is changed."""
    import threading

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if not _KINETO_LINE.match(line):
                    os.write(saved, line)

    thread = threading.Thread(target=forward, name="speedkit-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closes: the filter reads to its end and stops
        thread.join(timeout=0.5)
        if not thread.is_alive():  # else a process started meanwhile holds the pipe: the filter forwards on
            os.close(saved)


def quiet_dead_workers() -> int:
    """Stop every live DataLoader iterator one of whose worker processes is dead (killed by a signal sent
    to the process group), first taking its workers out of torch's SIGCHLD check: that check raises
    "DataLoader worker (pid ...) is killed by signal" in the main thread wherever it is when a child
    exits, once per dead worker (in the middle of undoing the trials, or of Lightning's teardown).
    Returns the iterators stopped. Uses torch's private iterator class and worker-pid registry."""
    import gc

    from torch.utils.data._utils import signal_handling
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    # by type, not isinstance: isinstance reads __class__, which a dead weak proxy raises on and some
    # deprecated module attributes warn on
    iterators = [o for o in gc.get_objects() if issubclass(type(o), _MultiProcessingDataLoaderIter)]
    stopped = 0
    for it in iterators:
        if getattr(it, "_shutdown", True):
            continue
        workers = list(getattr(it, "_workers", []) or [])
        if not any(not w.is_alive() for w in workers):
            continue
        if getattr(it, "_worker_pids_set", False):
            with contextlib.suppress(Exception):
                signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        with contextlib.suppress(Exception):
            it._shutdown_workers()
        stopped += 1
    return stopped


@contextlib.contextmanager
def outside_worker() -> Iterator[None]:
    """Inside a DataLoader worker, ``get_worker_info()`` returns None for the duration (torch's
    ``default_collate`` then stacks into ordinary memory instead of a fresh shared-memory block,
    which a batch written into a ring does not need)."""
    from torch.utils.data._utils import worker

    saved = worker._worker_info
    worker._worker_info = None
    try:
        yield
    finally:
        worker._worker_info = saved


def cuda_host_register(memory: torch.Tensor) -> bool:
    """Page-lock ``memory``'s bytes in place for CUDA copies (``cudaHostRegister``); False where this
    build or machine cannot (no CUDA, or the call fails)."""
    if not torch.cuda.is_available() or memory.numel() == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel() * memory.element_size(), 0)
    except (AttributeError, RuntimeError):
        return False
    return int(err) == 0


def cuda_host_unregister(memory: torch.Tensor) -> None:
    """Undo :func:`cuda_host_register`."""
    try:
        torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())
    except (AttributeError, RuntimeError):
        pass


# -- Lightning -----------------------------------------------------------------------------------


def lightning_before_batch_transfer(trainer: Any, module: Any, batch: Any, dataloader_idx: int = 0) -> Any:
    """What Lightning's training loop does to a batch before ``strategy.batch_to_device``: the
    precision plugin's input conversion, then ``on_before_batch_transfer`` (the datamodule's
    override where it has one, which Lightning's private hook selector picks)."""
    batch = trainer.precision_plugin.convert_input(batch)
    hook = getattr(module, "_on_before_batch_transfer", None)
    if hook is not None:
        return hook(batch, dataloader_idx=dataloader_idx)
    return module.on_before_batch_transfer(batch, dataloader_idx)


class TrialLog:
    """Trial steps' ``self.log`` into a scratch result collection (see :func:`lightning_trial_logging`)."""

    def __init__(self, results: Any) -> None:
        self.results = results

    def batch(self, batch: Any) -> None:
        """The batch ``self.log`` infers its batch size from, as the loop sets it."""
        self.results.batch = batch
        self.results.batch_size = None

    def step_done(self) -> None:
        """What Lightning's loop does after every batch: compute the step's metrics (progress-bar
        values become Python floats, a host sync on a GPU)."""
        self.results.metrics(True)
        self.results.batch = None


@contextlib.contextmanager
def lightning_trial_logging(trainer: Any, module: Any) -> Iterator[TrialLog | None]:
    """Let trial steps' ``self.log`` calls run as they do in training, into a scratch result
    collection: trial steps cost what training steps cost, and nothing reaches the user's metrics
    or loggers. Yields None when Lightning's internals moved (trials then make ``self.log`` a no-op
    and the fit check measures what that leaves out)."""
    try:
        from lightning.pytorch.trainer.connectors.logger_connector.result import (
            _ResultCollection,
        )

        loop = trainer.fit_loop.epoch_loop
        previous = loop._results
        previous_fx = module._current_fx_name
    except (ImportError, AttributeError):
        yield None
        return
    scratch = _ResultCollection(training=True)
    loop._results = scratch
    module._current_fx_name = "training_step"  # what Lightning sets while it runs training_step
    try:
        yield TrialLog(scratch)
    finally:
        loop._results = previous
        module._current_fx_name = previous_fx


def lightning_optimizer_progress(trainer: Any) -> Any:
    """The automatic optimization's progress counters (``global_step`` counts their optimizer
    steps), or None where Lightning's loop moved. A captured step must put them back after the
    capture (which runs the Python once without stepping) and count each replay."""
    try:
        return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
    except AttributeError:
        return None


def lightning_count_optimizer_step(trainer: Any) -> None:
    """Count one optimizer step (and its zero-grad) the way Lightning's automatic optimization does,
    for a step Lightning's loop did not run itself (a replayed CUDA graph)."""
    progress = lightning_optimizer_progress(trainer)
    if progress is None:
        return
    for tracker, names in (
        (progress.optimizer.step, ("increment_ready", "increment_completed")),
        (progress.optimizer.zero_grad, ("increment_ready", "increment_started", "increment_completed")),
    ):
        for name in names:
            fn = getattr(tracker, name, None)
            if fn is not None:
                fn()


def lightning_no_optimizer(optimizer: Any) -> bool:
    """``optimizer`` is the stand-in Lightning uses when ``configure_optimizers`` returns None."""
    try:
        from lightning.pytorch.core.optimizer import _MockOptimizer
    except ImportError:  # another Lightning layout: such a stand-in holds no parameter group either
        return not getattr(optimizer, "param_groups", None)
    return isinstance(optimizer, _MockOptimizer)


def lightning_automatic_optimization(trainer: Any) -> Any:
    """The object whose ``run(optimizer, batch_idx, kwargs)`` Lightning's training epoch loop calls
    for every batch under automatic optimization (where a whole-step CUDA graph binds into the fit)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    auto = getattr(loop, "automatic_optimization", None)
    if auto is None or not callable(getattr(auto, "run", None)):
        raise RuntimeError(
            f"this Lightning version ({_lightning_version()}) has no fit_loop.epoch_loop.automatic_optimization.run"
        )
    return auto


def _lightning_version() -> str:
    try:
        import lightning

        return lightning.__version__
    except ImportError:
        return "none"


@contextlib.contextmanager
def recording_logs(module: Any, logs: list[Any]) -> Iterator[None]:
    """``module.log`` (through which ``log_dict`` logs too) records ``(args, kwargs, "file:line")``
    into ``logs`` instead of logging."""
    import traceback

    missing = object()
    previous = module.__dict__.get("log", missing)

    def record(*args: Any, **kwargs: Any) -> None:
        caller = traceback.extract_stack(limit=3)[-2]
        logs.append((args, kwargs, f"{caller.filename}:{caller.lineno}"))

    module.__dict__["log"] = record
    try:
        yield
    finally:
        if previous is missing:
            module.__dict__.pop("log", None)
        else:
            module.__dict__["log"] = previous


def lightning_step_progress_bar(trainer: Any, convert: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[], None]:
    """Make ``trainer``'s training result collection (the fit's, or the trials' scratch one in its
    place) hand its per-step progress-bar values to ``convert`` as tensors (name -> tensor; it
    returns name -> what the bar shows) instead of turning each into a float with ``.item()``;
    returns the function that puts Lightning's way back. Epoch values, other loops (validation) and
    other Trainers keep Lightning's conversion.

    Lightning (2.x) converts inside ``_ResultCollection.metrics`` through the module's
    ``convert_tensors_to_scalars``; while the patched method calls the one it replaced, that name is
    an identity, so the values come out as tensors. Raises AttributeError/ImportError where these
    internals moved."""
    from lightning.pytorch.trainer.connectors.logger_connector import result as lightning_result

    cls = lightning_result._ResultCollection
    replaced = cls.__dict__["metrics"]  # Lightning's, or another Trainer's patch over it
    lightning_convert = lightning_result.convert_tensors_to_scalars
    loop = trainer.fit_loop.epoch_loop
    active = [True]

    @functools.wraps(replaced)
    def metrics(self: Any, on_step: bool) -> Any:
        if not (active[0] and on_step and self.training and self is loop._results):
            return replaced(self, on_step)
        lightning_result.convert_tensors_to_scalars = _as_is
        try:
            out = replaced(self, on_step)
        finally:
            lightning_result.convert_tensors_to_scalars = lightning_convert
        out["pbar"] = convert(out["pbar"])
        return out

    cls.metrics = metrics

    def restore() -> None:
        active[0] = False  # under another Trainer's patch it stays in the chain, passing values through
        if cls.__dict__.get("metrics") is metrics:
            cls.metrics = replaced

    return restore


def _as_is(value: Any) -> Any:
    return value


def lightning_progress_bar_values(trainer: Any) -> dict[str, Any] | None:
    """The dict of progress-bar values a Trainer keeps between steps (``trainer.progress_bar_metrics``
    reads it), or None where Lightning moved it."""
    values = getattr(getattr(trainer, "_logger_connector", None), "_progress_bar_metrics", None)
    return values if isinstance(values, dict) else None


@contextlib.contextmanager
def lightning_logging_as(module: Any, hook: str) -> Iterator[None]:
    """Let ``self.log`` run outside the hook it was written in, as if inside ``hook`` (Lightning
    checks the hook name it is called from)."""
    previous = getattr(module, "_current_fx_name", None)
    module._current_fx_name = hook
    try:
        yield
    finally:
        module._current_fx_name = previous


# -- model libraries' attention switches ----------------------------------------------------------


def hf_pretrained_models(model: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face ``PreTrainedModel`` instances in ``model`` (none when transformers
    was never imported: a model of it would have imported it)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if base is None:
        return []
    found: list[nn.Module] = []
    inner: set[int] = set()
    for module in model.modules():
        if isinstance(module, base) and id(module) not in inner:
            found.append(module)
            inner.update(id(m) for m in module.modules())
    return found


def hf_attn_implementation(model: nn.Module) -> str | None:
    """The attention implementation a Hugging Face model runs (``config._attn_implementation``)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def hf_attention_switchable(model: nn.Module) -> str | None:
    """None when the model's attention implementation can be set after it was built (transformers
    with ``AttentionInterface`` and ``set_attn_implementation``, 4.48+); else why not."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not hasattr(transformers, "AttentionInterface") or not hasattr(model, "set_attn_implementation"):
        version = getattr(transformers, "__version__", "?")
        return f"transformers {version} cannot switch attention after the model is built (needs 4.48 or newer)"
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        return f"{type(model).__name__} does not route its attention through transformers' AttentionInterface"
    if not getattr(model, "_supports_sdpa", False):
        return f"{type(model).__name__} does not support SDPA attention in transformers"
    return None


def timm_attention_modules(model: nn.Module) -> list[nn.Module]:
    """timm attention modules with a fused (SDPA) path, switched by their ``fused_attn`` flag."""
    return [
        m for m in model.modules() if type(m).__module__.startswith("timm.") and isinstance(getattr(m, "fused_attn", None), bool)
    ]


# -- transformers --------------------------------------------------------------------------------

#: where ``model.loss_function = fn`` (the setter of a transformers ``PreTrainedModel``'s
#: ``loss_function`` property) keeps ``fn`` on the instance; while it is absent the property
#: picks the loss from ``model.loss_type``
HF_LOSS_FUNCTION_ATTR = "_loss_function"


def hf_loss_function_settable(model: nn.Module) -> bool:
    """``model.loss_function`` is transformers' property that stores a per-instance loss function
    in :data:`HF_LOSS_FUNCTION_ATTR` and returns it from there (False where that moved or is absent)."""
    import inspect

    prop = inspect.getattr_static(type(model), "loss_function", None)
    if not isinstance(prop, property) or prop.fget is None or prop.fset is None:
        return False
    return all(HF_LOSS_FUNCTION_ATTR in getattr(getattr(f, "__code__", None), "co_names", ()) for f in (prop.fget, prop.fset))


# -- Lightning's fit loop: its train loader and iterator (the data_path rung's binding) -----------


def _fit_loop_module() -> Any:
    try:
        from lightning.pytorch.loops import fit_loop
    except ImportError:
        return None
    return fit_loop if callable(getattr(fit_loop, "_select_data_fetcher", None)) else None


def watch_train_iterator_start(
    trainer: Any, before: Callable[[list[Any]], None], after: Callable[[list[Any]], None]
) -> Callable[[], None] | None:
    """Call ``before(loaders)`` right before ``trainer``'s fit loop creates its train iterator (in
    ``setup_data``, before ``on_train_start``) and ``after(loaders)`` right after; returns the
    function that removes the watch, or None where Lightning's internals moved (nothing watched).

    The fit loop asks ``_select_data_fetcher`` (a global of ``lightning.pytorch.loops.fit_loop``)
    for its fetcher, then calls the fetcher's ``setup(combined_loader)`` and ``iter(fetcher)``,
    whose last act is ``fetcher.reset()``; the watch wraps that global for ``trainer`` only and
    wraps ``setup`` and ``reset`` on the one fetcher it returns (instance attributes, removed once
    they fired).
    """
    module = _fit_loop_module()
    if module is None:
        return None
    original = module._select_data_fetcher

    def select(which: Any, stage: Any) -> Any:
        fetcher = original(which, stage)
        if which is not trainer or str(getattr(stage, "value", stage)) != "train" or not hasattr(fetcher, "setup"):
            return fetcher

        def setup(combined_loader: Any) -> None:
            fetcher.__dict__.pop("setup", None)
            before(list(getattr(combined_loader, "flattened", [])))
            fetcher.setup(combined_loader)

        def reset() -> None:
            if getattr(fetcher, "iterator", None) is None:  # a reset outside iter(): not the creation
                type(fetcher).reset(fetcher)
                return
            fetcher.__dict__.pop("reset", None)
            fetcher.reset()
            after(list(getattr(getattr(fetcher, "_combined_loader", None), "flattened", [])))

        fetcher.setup, fetcher.reset = setup, reset
        return fetcher

    module._select_data_fetcher = select

    def remove() -> None:
        if module._select_data_fetcher is select:
            module._select_data_fetcher = original

    return remove


def lightning_watch_train_reload(trainer: Any, on_reload: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``on_reload()`` each time ``trainer``'s fit loop makes a new train loader and its
    iterator (``reload_dataloaders_every_n_epochs``: ``setup_data`` at an epoch's start, before
    ``on_train_epoch_start``); returns the function that removes the watch, or None where
    Lightning's internals moved. The watch is an instance attribute wrapping ``setup_data``."""
    loop = getattr(trainer, "fit_loop", None)
    if loop is None or not callable(getattr(type(loop), "setup_data", None)) or not hasattr(loop, "_combined_loader"):
        return None

    def setup_data() -> None:
        before = loop._combined_loader
        type(loop).setup_data(loop)
        if before is not None and loop._combined_loader is not before:
            on_reload()

    loop.setup_data = setup_data

    def remove() -> None:
        if loop.__dict__.get("setup_data") is setup_data:
            del loop.setup_data

    return remove


def lightning_train_loaders(trainer: Any) -> list[Any] | None:
    """The train loaders the fit loop iterates (its ``CombinedLoader``'s flattened list), or None
    before ``setup_data`` or where the internals moved."""
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    flattened = getattr(combined, "flattened", None)
    return list(flattened) if flattened is not None else None


def lightning_set_train_loaders(trainer: Any, loaders: list[Any]) -> None:
    """Make the fit loop iterate ``loaders`` (same structure) from its next ``iter()`` on."""
    trainer.fit_loop._combined_loader.flattened = list(loaders)


def lightning_group_train_batches(
    trainer: Any, factor: int, group: Callable[[Iterator[Any]], Iterator[Any]], loader: Callable[[Any], Any]
) -> Callable[[], None]:
    """Make the fit loop take its train batches ``factor`` loader batches at a time, merged: its live
    iterator wrapped in place (``group(iterator)``: the epoch goes on from where it is), its loader
    replaced by ``loader(user_loader)`` for the next epochs, and the counts it keeps in batches
    divided by ``factor`` (``accumulate_grad_batches``, the epoch's batch count and limit, the
    validation interval). Returns the undo. Raises RuntimeError where it cannot: batches fetched
    ahead (a loader without a length: the fetcher holds one), several train loaders, an accumulation
    that ``factor`` does not divide, or internals that moved."""
    loop = trainer.fit_loop
    combined, fetcher = loop._combined_loader, loop._data_fetcher
    if combined is None or fetcher is None or len(combined.flattened) != 1:
        raise RuntimeError("the fit loop has no single train loader set up (several loaders, or Lightning's internals moved)")
    if getattr(fetcher, "batches", None):
        raise RuntimeError("the fit loop holds train batches fetched ahead (a loader without a length)")
    accumulate = int(trainer.accumulate_grad_batches)
    if accumulate % factor:
        raise RuntimeError(f"accumulate_grad_batches={accumulate} is not a multiple of {factor}")
    live = getattr(combined, "_iterator", None)
    iterators = getattr(live, "iterators", None)
    saved = {
        "flattened": list(combined.flattened),
        "limits": combined.limits,
        "max_batches": loop.max_batches,
        "val_check_batch": trainer.val_check_batch,
        "accumulate": trainer.accumulate_grad_batches,
        "iterators": list(iterators) if iterators else None,
    }

    def divided(n: Any) -> Any:
        return n if n is None or n == float("inf") else max(1, -(-int(n) // factor))

    combined.flattened = [loader(saved["flattened"][0])]
    if iterators:
        live.iterators = [group(it) for it in iterators]
    if combined.limits is not None:
        combined.limits = [divided(n) for n in combined.limits]
    loop.max_batches = divided(loop.max_batches)
    if isinstance(trainer.val_check_batch, int) and trainer.val_check_batch > 1:
        trainer.val_check_batch = divided(trainer.val_check_batch)
    trainer.accumulate_grad_batches = accumulate // factor

    def undo() -> None:
        combined.flattened = saved["flattened"]
        combined.limits = saved["limits"]
        loop.max_batches = saved["max_batches"]
        trainer.val_check_batch = saved["val_check_batch"]
        trainer.accumulate_grad_batches = saved["accumulate"]
        if saved["iterators"] is not None and getattr(combined, "_iterator", None) is live:
            live.iterators = saved["iterators"]

    return undo


def lightning_restart_train_iterator(trainer: Any) -> list[Any]:
    """Create the fit loop's train iterator again, as ``setup_data`` did (``iter(data_fetcher)``),
    from the loaders it holds now; returns the iterators it replaced (the caller stops their workers)."""
    fetcher = trainer.fit_loop._data_fetcher
    previous = getattr(getattr(trainer.fit_loop._combined_loader, "_iterator", None), "iterators", None) or []
    iter(fetcher)
    return list(previous)


def lightning_wrap_train_iterators(trainer: Any, wrap: Any) -> bool:
    """Replace each live train iterator of the fit loop (its ``CombinedLoader``'s, made by
    ``setup_data``) by ``wrap(iterator)``, in place: the epoch goes on from where it is. False where
    there is none (before ``setup_data``, or Lightning's internals moved)."""
    live = getattr(getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None), "_iterator", None)
    iterators = getattr(live, "iterators", None)
    if not iterators:
        return False
    live.iterators = [wrap(it) for it in iterators]
    return True


def lightning_first_epoch_pending(trainer: Any) -> bool:
    """The fit has not fetched a train batch yet and runs its first epoch (a resumed fit or a
    restarted loop is not one whose first iterator can be recreated as it was made)."""
    loop = getattr(trainer, "fit_loop", None)
    progress = getattr(getattr(loop, "epoch_loop", None), "batch_progress", None)
    ready = getattr(getattr(progress, "total", None), "ready", None)
    return (
        getattr(loop, "_data_fetcher", None) is not None
        and ready == 0
        and trainer.current_epoch == 0
        and not getattr(loop, "restarting", True)
    )


def lightning_action_label(action: str) -> tuple[str, str]:
    """What one of Lightning's profiler actions is: ``("fetch", ...)`` for the fit loop's fetch of
    the next train batch, ``("transfer", "SingleDeviceStrategy.batch_to_device")`` for the hooks that
    move it to the device, ``("callback", "EMA.on_train_batch_end")``, ``("module", "Net.on_train_batch_end")``,
    ``("strategy" | "datamodule", ...)``, ``("validation", ...)`` for the validation loop's actions and
    hooks and for checkpointing, else ``("other", action)``. The action names are the
    strings ``lightning.pytorch.trainer.call`` and the epoch loop pass to ``trainer.profiler``; a name
    of another shape is labelled as it is."""
    if action.endswith("].train_dataloader_next"):
        return "fetch", "fetching the next batch"
    for prefix, kind in _ACTION_OWNERS.items():
        if action.startswith(prefix):
            owner, _, hook = action[len(prefix) :].rpartition(".")
            name = owner.split("{")[0].rsplit(".", 1)[-1]  # a state_key is a qualname and may carry its arguments: {...}
            if hook in _BATCH_TRANSFER_HOOKS:
                kind = "transfer"
            elif "validation" in hook or "checkpoint" in hook:
                kind = "validation"
            return kind, f"{name or owner}.{hook}" if owner else action
    if action.startswith("[_EvaluationLoop]") or action == "save_checkpoint":
        return "validation", "fetching the next validation batch" if action.endswith("].val_next") else action
    return "other", action


#: the prefixes of Lightning's hook actions, by whose hook it runs
_ACTION_OWNERS = {
    "[Callback]": "callback",
    "[LightningModule]": "module",
    "[Strategy]": "strategy",
    "[LightningDataModule]": "datamodule",
}
#: the hooks that move a batch to the device (the strategy's, and the module's and datamodule's own)
_BATCH_TRANSFER_HOOKS = {"batch_to_device", "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"}


# -- DistributedDataParallel and Lightning's DDPStrategy (the DDP knob rungs) ------------------------


def ddp_comm_hooks(ddp: Any) -> list[tuple[Any, Any]]:
    """The communication hooks registered on a ``DistributedDataParallel``, as ``(hook, state)`` pairs
    (torch keeps them in ``_comm_hooks``; DDP takes one at most); ``[]`` where the list moved."""
    return list(getattr(ddp, "_comm_hooks", []))


def lightning_ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """A copy of the keyword arguments Lightning's ``DDPStrategy`` passes ``DistributedDataParallel`` when
    it wraps the module (``DDPStrategy(**kwargs)``'s extra ones, kept in ``_ddp_kwargs``)."""
    return dict(getattr(strategy, "_ddp_kwargs", {}))


def lightning_set_ddp_kwargs(strategy: Any, kwargs: dict[str, Any]) -> None:
    """Set what ``DDPStrategy`` passes ``DistributedDataParallel`` the next time it wraps (``_setup_model``)."""
    strategy._ddp_kwargs = dict(kwargs)


def lightning_ddp_comm_hook(strategy: Any) -> Any:
    """The communication hook ``DDPStrategy(ddp_comm_hook=...)`` registers on the module it wraps, or None."""
    return getattr(strategy, "_ddp_comm_hook", None)


def lightning_set_ddp_comm_hook(strategy: Any, hook: Any) -> None:
    """Set the communication hook ``DDPStrategy`` registers after it wraps. Lightning registers it on CUDA
    devices only (``_register_ddp_hooks``); :func:`lightning_register_missing_comm_hook` does elsewhere."""
    strategy._ddp_comm_hook = hook


def lightning_register_missing_comm_hook(strategy: Any, ddp: Any) -> None:
    """Register the strategy's communication hook (with its state and wrapper, as Lightning does) on
    ``ddp`` where Lightning did not: it registers none off CUDA, though gloo runs them too."""
    hook = lightning_ddp_comm_hook(strategy)
    if hook is None or ddp_comm_hooks(ddp):
        return
    wrapper = getattr(strategy, "_ddp_comm_wrapper", None)
    ddp.register_comm_hook(getattr(strategy, "_ddp_comm_state", None), wrapper(hook) if wrapper is not None else hook)


def lightning_wrap_ddp(strategy: Any, module: nn.Module, kwargs: dict[str, Any]) -> Any:
    """A new ``DistributedDataParallel`` over ``module``, made the way ``DDPStrategy`` makes its own (its
    device ids, on a side CUDA stream: ``_setup_model``) with ``kwargs``; the strategy's own kwargs are
    left as they were. A collective: every rank calls it (DDP broadcasts the module's state from rank 0)."""
    saved = getattr(strategy, "_ddp_kwargs", {})
    strategy._ddp_kwargs = dict(kwargs)
    try:
        return strategy._setup_model(module)
    finally:
        strategy._ddp_kwargs = saved


#: DDP's reducer times its first iterations (and every ``sample rate``-th after) with CUDA events, read
#: back with host syncs at the next forward (``Reducer::should_collect_runtime_stats``: iterations 1 to 10
#: always); the iteration DDP logs last is one behind the forward that logs it
_DDP_TIMED_FIRST_ITERATIONS = 10
#: a sample rate no fit reaches: DDP times no iteration after its first ten
_DDP_NO_SAMPLING = 2**31 - 1


def ddp_forwards_before_capture(ddp: Any) -> int:
    """How many more forwards ``ddp`` (a ``DistributedDataParallel``) runs with its runtime timing, whose
    event syncs a CUDA graph capture refuses, before a forward runs without it; its later sampling (every
    100th iteration by default) is switched off here, for good on this wrapper (it feeds DDP's own usage
    logging only). 0: the next forward may be captured. PyTorch's note on graphs with DDP says "at least
    11 DDP-enabled eager iterations before capture"."""
    setter = getattr(ddp, "_set_ddp_runtime_logging_sample_rate", None)
    if setter is not None:
        setter(_DDP_NO_SAMPLING)
    return max(0, _DDP_TIMED_FIRST_ITERATIONS - _ddp_logged_iterations(ddp))


def _ddp_logged_iterations(ddp: Any) -> int:
    """The iterations ``ddp``'s reducer has logged (0 where this torch does not log them)."""
    logged = ddp._get_ddp_logging_data().get("iteration", 0) if hasattr(ddp, "_get_ddp_logging_data") else 0
    return int(logged)


def ddp_static_graph_pending(ddp: Any) -> bool:
    """Whether ``ddp`` is a ``DistributedDataParallel`` made with ``static_graph=True`` whose first
    iteration (the one whose autograd hooks it records as the graph) has not run through it yet. A
    backward through its parameters that bypasses its forward before then (speedkit's guarded steps
    call the module beneath it and average gradients by hand) leaves it all-reducing nothing in
    later iterations: every rank then steps on its own gradients (seen with torch 2.14 over gloo).
    Read from DDP's private flag that its first backward sets; where a torch lacks the flag, from
    its logged iteration count."""
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) or not getattr(ddp, "static_graph", False):
        return False
    enqueued = getattr(ddp, "_static_graph_delay_allreduce_enqueued", None)
    if enqueued is not None:
        return not enqueued
    return _ddp_logged_iterations(ddp) == 0


# -- FSDP2 (``fully_shard``) internals --------------------------------------------------------------
# FSDP2's public methods set prefetching and resharding at run time; its mixed-precision policy is fixed
# when ``fully_shard`` runs (a user's ``configure_model``). The entries below read each FSDP module's
# state (``FSDPModule._get_fsdp_state()``: its ``_fsdp_param_groups``, each with ``fsdp_params``) and
# set the policy after the fact the way ``fully_shard`` sets it; where a torch lacks a name they answer
# "not available" and the rungs that need them say why they do not apply.


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` sharded (FSDP2's ``FSDPModule``), in module order."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp2_groups(module: nn.Module) -> list[Any]:
    """The parameter groups of one FSDP2 module (one per ``fully_shard`` call; none where it holds none)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch 2.6-2.8 kept one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def fsdp2_policy_settable(model: nn.Module) -> str | None:
    """Why FSDP2's mixed-precision policy cannot be set after ``fully_shard`` on this torch (None: it can)."""
    for module in fsdp2_modules(model):
        state = module._get_fsdp_state()  # type: ignore[operator]
        if not hasattr(state, "_mp_policy"):
            return "this torch's FSDP2 keeps its mixed-precision policy elsewhere (no FSDPState._mp_policy)"
        for group in _fsdp2_groups(module):
            if not (hasattr(group, "mp_policy") and hasattr(group, "_init_mp_dtypes")):
                return "this torch's FSDP2 parameter groups set their dtypes elsewhere (no _init_mp_dtypes)"
            for param in group.fsdp_params:
                if not (hasattr(param, "all_gather_outputs") and hasattr(param, "init_dtype_attrs")):
                    return "this torch's FSDP2 parameters keep their all-gather buffers elsewhere"
    return None


def fsdp2_policies(model: nn.Module) -> list[Any]:
    """Each FSDP2 module's mixed-precision policy (``MixedPrecisionPolicy``), in module order."""
    return [m._get_fsdp_state()._mp_policy for m in fsdp2_modules(model)]  # type: ignore[operator]


def fsdp2_set_policies(model: nn.Module, policies: list[Any]) -> None:
    """Give each FSDP2 module of ``model`` its policy (``policies`` as :func:`fsdp2_policies` lists them),
    as ``fully_shard(mp_policy=...)`` would have: the state's policy (it casts the root's inputs), each
    parameter group's (its dtypes for the all-gather, the unsharded parameters and the gradient
    reduction), and the unsharded parameters and all-gather buffers dropped, so that the next all-gather
    makes them in the new dtype. Only between steps: every module resharded, no gradient pending."""
    modules = fsdp2_modules(model)
    if len(policies) != len(modules):
        raise ValueError(f"{len(policies)} policies for {len(modules)} FSDP modules")
    for module, policy in zip(modules, policies, strict=True):
        state = module._get_fsdp_state()  # type: ignore[operator]
        state._mp_policy = policy
        for group in _fsdp2_groups(module):
            group.mp_policy = policy
            for param in group.fsdp_params:
                param.mp_policy = policy  # read again by a torch that re-inits the param's dtypes itself
                param.all_gather_outputs = []
                if hasattr(param, "_unsharded_param"):
                    del param._unsharded_param
            group._init_mp_dtypes()


def fsdp2_reshard_after_forward(model: nn.Module) -> list[tuple[list[Any], Any]]:
    """Each FSDP2 module's resharding after forward as it stands: per module, its groups' post-forward
    mesh (None: the parameters stay unsharded until the backward) and its "auto" flag (the root's
    default), for :func:`fsdp2_restore_reshard_after_forward`."""
    saved = []
    for module in fsdp2_modules(model):
        state = module._get_fsdp_state()  # type: ignore[operator]
        meshes = [group.post_forward_mesh_info for group in _fsdp2_groups(module)]
        saved.append((meshes, getattr(state, "_auto_reshard_after_forward", None)))
    return saved


def fsdp2_restore_reshard_after_forward(model: nn.Module, saved: list[tuple[list[Any], Any]]) -> None:
    """Put back what :func:`fsdp2_reshard_after_forward` read (``set_reshard_after_forward`` also clears
    the root's "auto" flag, which no public method sets again)."""
    for module, (meshes, auto) in zip(fsdp2_modules(model), saved, strict=True):
        state = module._get_fsdp_state()  # type: ignore[operator]
        for group, mesh in zip(_fsdp2_groups(module), meshes, strict=True):
            group.post_forward_mesh_info = mesh
        if auto is not None:
            state._auto_reshard_after_forward = auto


def fsdp2_resharded_after_forward(module: nn.Module) -> bool:
    """Whether one FSDP2 module frees its unsharded parameters after its forward (and gathers them
    again in the backward)."""
    return any(group.post_forward_mesh_info is not None for group in _fsdp2_groups(module))


def fsdp2_prefetch(module: nn.Module) -> tuple[list[Any] | None, list[Any] | None]:
    """One FSDP2 module's explicit forward and backward prefetch lists (None: FSDP's implicit order)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    return getattr(state, "_states_to_forward_prefetch", None), getattr(state, "_states_to_backward_prefetch", None)


def fsdp2_set_prefetch(module: nn.Module, forward: list[Any] | None, backward: list[Any] | None) -> None:
    """Put back one FSDP2 module's prefetch lists as :func:`fsdp2_prefetch` read them."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    if forward is not None:
        state._states_to_forward_prefetch = list(forward)
    if backward is not None:
        state._states_to_backward_prefetch = list(backward)


def fsdp2_unsharded_bytes(module: nn.Module) -> int:
    """The bytes one FSDP2 module's parameters take unsharded in the dtype its all-gather makes them
    (the policy's ``param_dtype``, else their own); its own parameters only, not its FSDP submodules'."""
    total = 0
    for group in _fsdp2_groups(module):
        for param in group.fsdp_params:
            # orig_dtype is set at FSDP's lazy init (the first forward): before it, the shard's own dtype
            dtype = getattr(param, "param_dtype", None) or getattr(param, "orig_dtype", None) or param.sharded_param.dtype
            total += param._orig_size.numel() * dtype.itemsize
    return total
