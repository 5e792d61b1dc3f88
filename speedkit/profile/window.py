"""A short torch.profiler window over a few training steps, and where each step's time went.

:func:`profile_window` runs ``warmup + steps`` optimizer steps under ``torch.profiler`` (a schedule
of ``warmup`` untimed steps, then ``steps`` recorded ones) and returns a :class:`ProfileWindow`:
the wall time per step and its breakdown into :data:`~speedkit.profile.categories.CATEGORIES`
(ms per step), the device's busy fraction, the ops that took longest, and optionally a gzipped
Chrome/Perfetto trace of the window.

* On **CUDA** the breakdown is the device timeline's: kernels, copies and sets grouped by
  :func:`~speedkit.profile.categories.categorize` (kernels launched inside ``optimizer.step()``
  count as optimizer whatever their name); ``data_wait`` is the host time inside the loader's fetch;
  ``host_idle`` is what is left of the step once the device was busy (the union of its kernels'
  intervals over all streams) and the batch was waited for: the GPU idle while the host issued work.
* On **CPU** there is no device timeline: the breakdown is the self CPU time of the ops (each op's
  own time, so nested ops are not counted twice; record_function scopes and the loader's work are
  not ops of the step), ``host_idle`` is 0 and the busy fraction ``None``.

The data wait is read from the profiler's own annotations: the ``enumerate(DataLoader)#...__next__``
scope every DataLoader iterator records, Lightning's ``[_TrainingEpochLoop].train_dataloader_next``
and ``speedkit.data_wait`` (a ``torch.profiler.record_function`` a caller wraps around its fetch);
nested ones are counted once.

The profiler costs time (a few microseconds an op on the host, more with many small ops): a
profiled window says where the time goes, not how fast the step is. Keep these windows short and
apart from timed windows (:class:`~speedkit.measure.session.MeasureSession`); ``step_ms`` here is
the profiled step's, for scaling the breakdown. The device is synchronized only at the window's
two ends.

Profiler trouble (another profiler already running, a build without kineto) raises
:class:`ProfileUnavailable` with one line saying why: callers catch it and go on without the
breakdown. Whatever ``run_one`` itself raises propagates unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import inspect
import os
import re
import shutil
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from speedkit import compat
from speedkit.errors import ConfigError, SpeedkitError, first_line
from speedkit.profile.categories import CATEGORIES, categorize

TOP_OPS = 12
SHORT_NAME_CHARS = 80
DEFAULT_MAX_TRACE_BYTES = 64 * 2**20

#: host scopes that are the step waiting for its batch
_DATA_WAIT = re.compile(r"^enumerate\(dataloader\)|train_dataloader_next|^speedkit\.data_wait")
#: host scopes whose work is the optimizer's, whatever its ops are named
_OPTIMIZER_SCOPE = re.compile(r"^optimizer\.(step|zero_grad)#")
_PROFILER_STEP = re.compile(r"^profilerstep[#*]")


class ProfileUnavailable(SpeedkitError):
    """The profiler could not record the window (another profiler is active, kineto is missing, it
    failed): the message says why, in one line. Callers catch it and report without a breakdown."""


@dataclass
class ProfileWindow:
    """Where a profiled window's step time went (ms per optimizer step)."""

    label: str  # "baseline", a rung's name, "final"
    steps: int  # optimizer steps profiled
    step_ms: float  # wall ms per step (host clock, device synchronized at the ends)
    breakdown_ms: dict[str, float]  # category -> ms per step; every CATEGORIES key
    device: str  # "cuda" | "cpu"
    device_busy_fraction: float | None = None  # union of device busy intervals / window (None on CPU)
    top_ops: list[dict[str, Any]] = field(default_factory=list)  # {"name", "category", "ms"}, largest first
    trace: str | None = None  # the gzipped Chrome/Perfetto trace written, or None
    trace_note: str | None = None  # why there is no trace, or None
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated in the window (None on CPU)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the fields."""
        data = asdict(self)
        data["breakdown_ms"] = {name: float(data["breakdown_ms"].get(name, 0.0)) for name in CATEGORIES}
        data["top_ops"] = [
            {"name": str(op["name"]), "category": str(op["category"]), "ms": float(op["ms"])} for op in self.top_ops
        ]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileWindow:
        """The window :meth:`to_dict` wrote (categories it lacks read as 0.0)."""
        breakdown = {name: float(data.get("breakdown_ms", {}).get(name, 0.0)) for name in CATEGORIES}
        return cls(
            label=str(data["label"]),
            steps=int(data["steps"]),
            step_ms=float(data["step_ms"]),
            breakdown_ms=breakdown,
            device=str(data["device"]),
            device_busy_fraction=_optional_float(data.get("device_busy_fraction")),
            top_ops=[dict(op) for op in data.get("top_ops", [])],
            trace=data.get("trace"),
            trace_note=data.get("trace_note"),
            peak_memory_bytes=_optional_int(data.get("peak_memory_bytes")),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


# -- running the window -----------------------------------------------------------------------------


@dataclass
class _Recorded:
    """What the profiler's ``on_trace_ready`` handed over."""

    events: list[Any] | None = None
    trace: str | None = None
    trace_note: str | None = None
    error: BaseException | None = None
    abandoned: bool = False  # the window failed (run_one raised): write nothing


def profile_window(
    run_one: Callable[[], Any],
    *,
    steps: int = 3,
    warmup: int = 1,
    label: str,
    device: torch.device | str,
    trace_path: Path | str | None = None,
    max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES,
) -> ProfileWindow:
    """Profile ``steps`` calls of ``run_one`` (one optimizer step each) after ``warmup`` unrecorded
    ones, and break the recorded steps' time down by category.

    ``trace_path``: where to write the window's Chrome/Perfetto trace, gzipped (``*.json.gz``); a
    trace over ``max_trace_bytes`` (gzipped) is not kept and ``trace_note`` says so.
    Raises :class:`ProfileUnavailable` when the profiler cannot run; ``run_one``'s own errors propagate.
    """
    if steps < 1:
        raise ConfigError("profile.steps", f"expected at least 1 step to profile, found {steps}")
    if warmup < 0:
        raise ConfigError("profile.warmup", f"expected 0 or more warm-up steps, found {warmup}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    recorded = _Recorded()
    profiler = _new_profiler(cuda, steps, warmup, _trace_handler(recorded, trace_path, max_trace_bytes))
    # CUPTI detached at the stop: left attached, it slows every kernel launch after the window (the
    # trials' later comparisons and the fit), launch-bound steps most
    with compat.kineto_lines_dropped(), compat.cupti_detached_after() if cuda else contextlib.nullcontext() as attached:
        if attached:
            _warn_cupti_left_attached(attached)
        _start(profiler)
        try:
            started, ended = _run_steps(run_one, profiler, steps=steps, warmup=warmup, device=device)
        except BaseException:
            recorded.abandoned = True
            with contextlib.suppress(Exception):
                profiler.stop()
            raise
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        _stop(profiler)
    if recorded.error is not None:
        reason = first_line(recorded.error, type(recorded.error).__name__)
        raise ProfileUnavailable(f"the profiler's results could not be read: {reason}") from recorded.error
    if recorded.events is None:
        raise ProfileUnavailable("the profiler recorded no window (its schedule never reached the recorded steps)")
    step_ms = (ended - started) * 1e3 / steps
    breakdown, busy_fraction, top = (
        _device_breakdown(recorded.events, steps, step_ms) if cuda else _host_breakdown(recorded.events, steps)
    )
    return ProfileWindow(
        label=label,
        steps=steps,
        step_ms=step_ms,
        breakdown_ms=breakdown,
        device=device.type,
        device_busy_fraction=busy_fraction,
        top_ops=top,
        trace=recorded.trace,
        trace_note=recorded.trace_note,
        peak_memory_bytes=peak,
    )


@functools.cache
def _warn_cupti_left_attached(why: str) -> None:
    """Once a process: CUPTI stays attached after this window, and launches after it run slower."""
    warnings.warn(
        f"speedkit's profile window leaves NVIDIA's CUPTI attached ({why}): every kernel launch after it pays "
        "CUPTI's callbacks, so steps timed after it (and the fit) run slower than they would; unset it, or set "
        f"{compat.CUPTI_TEARDOWN_VARIABLE}=1, for figures free of it",
        RuntimeWarning,
        stacklevel=3,
    )


def _new_profiler(cuda: bool, steps: int, warmup: int, on_trace_ready: Callable[[Any], None]) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*won't be using warmup.*")  # warmup=0 is the caller's choice
            schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=steps, repeat=1)
        # one cycle (repeat=1): keeping its events across cycles changes nothing and silences the
        # profiler's warning that it clears them at each cycle's end
        quiet = {"acc_events": True} if "acc_events" in inspect.signature(torch.profiler.profile).parameters else {}
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            record_shapes=False,
            with_stack=False,
            profile_memory=False,
            on_trace_ready=on_trace_ready,
            **quiet,
        )
    except Exception as error:
        raise ProfileUnavailable(f"torch.profiler cannot be set up: {first_line(error, type(error).__name__)}") from error


def _start(profiler: torch.profiler.profile) -> None:
    if torch.autograd._profiler_enabled():
        raise ProfileUnavailable("another torch profiler is already running; a window needs the profiler to itself")
    try:
        profiler.start()
    except Exception as error:
        raise ProfileUnavailable(f"torch.profiler did not start: {first_line(error, type(error).__name__)}") from error


def _stop(profiler: torch.profiler.profile) -> None:
    try:
        profiler.stop()
    except Exception as error:
        raise ProfileUnavailable(f"torch.profiler did not stop cleanly: {first_line(error, type(error).__name__)}") from error


def _run_steps(
    run_one: Callable[[], Any], profiler: torch.profiler.profile, *, steps: int, warmup: int, device: torch.device
) -> tuple[float, float]:
    """Run the window's steps; the host clock's reading at the recorded steps' start and end (the
    device waited for at both, and nowhere else)."""
    total = warmup + steps
    started = ended = 0.0
    if warmup == 0:
        started = _window_start(device)
    for index in range(total):
        run_one()
        if index in (warmup - 1, total - 1):
            _synchronize(device)  # before profiler.step(): the recorded steps' kernels end inside the window
        if index == total - 1:
            ended = time.perf_counter()
        _advance(profiler)
        if index == warmup - 1:
            started = _window_start(device)
    return started, ended


def _window_start(device: torch.device) -> float:
    """The recorded steps begin (the device already waited for): the peak memory restarts here."""
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return time.perf_counter()


def _advance(profiler: torch.profiler.profile) -> None:
    """``profiler.step()``, its failures (reading or exporting the results) as :class:`ProfileUnavailable`."""
    try:
        profiler.step()
    except Exception as error:
        raise ProfileUnavailable(f"torch.profiler failed between steps: {first_line(error, type(error).__name__)}") from error


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trace_handler(recorded: _Recorded, trace_path: Path | str | None, max_trace_bytes: int) -> Callable[[Any], None]:
    """The profiler's ``on_trace_ready``: keeps the events and writes the trace (never raises: the
    profiler would swallow or mangle it; :func:`profile_window` reports ``recorded.error``)."""

    def on_trace_ready(profiler: torch.profiler.profile) -> None:
        if recorded.abandoned:
            return
        try:
            recorded.events = list(profiler.events())
        except Exception as error:
            recorded.error = error
            return
        if trace_path is None:
            recorded.trace_note = "no trace asked"
            return
        recorded.trace, recorded.trace_note = _write_trace(profiler, Path(trace_path), max_trace_bytes)

    return on_trace_ready


def _write_trace(profiler: torch.profiler.profile, path: Path, max_trace_bytes: int) -> tuple[str | None, str | None]:
    """Export the Chrome trace, gzipped, to ``path``: (the path written, None) or (None, why not).

    The plain trace is exported to the system's temporary folder (not beside the report) and the
    gzip written under a hidden name, renamed into place once whole: a full disk leaves no part of
    it (the profiler's export writes ``<name>.tmp`` and may stop short of the end, saying so only
    on its log)."""
    plain = None
    partial = path.with_name(f".{path.name}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, plain = tempfile.mkstemp(suffix=".json", prefix="speedkit-trace-")
        os.close(handle)
        profiler.export_chrome_trace(plain)
        if not _whole_json(plain):
            raise OSError("the profiler's export stopped short (a full disk?)")
        with open(plain, "rb") as source, gzip.open(partial, "wb", compresslevel=6) as target:
            shutil.copyfileobj(source, target)
        os.replace(partial, path)
    except Exception as error:
        with contextlib.suppress(OSError):
            partial.unlink()
        return None, f"trace not written: {first_line(error, type(error).__name__)}"
    finally:
        if plain is not None:
            for leftover in (plain, plain + ".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
    size = path.stat().st_size
    if size > max_trace_bytes:
        path.unlink()
        return None, f"trace of {_megabytes(size)} MB over the {_megabytes(max_trace_bytes)} MB bound: not kept"
    return str(path), None


def _whole_json(path: str) -> bool:
    """Whether the exported trace ends as a JSON document does (its last byte a closing brace)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return False
        f.seek(max(0, size - 64))
        return f.read().rstrip().endswith(b"}")


def _megabytes(size: int) -> str:
    return f"{size / 2**20:.3g}"


# -- reading the events -------------------------------------------------------------------------------


def _host_breakdown(events: list[Any], steps: int) -> tuple[dict[str, float], None, list[dict[str, Any]]]:
    """CPU: each op's self time, by category; the loader's time as data wait."""
    scopes = _ScopeFinder(events)
    charges: dict[tuple[str, str], float] = defaultdict(float)  # (name, category) -> us
    for event in events:
        if not _is_host_op(event):
            continue
        scope = scopes.of(event.cpu_parent, float(event.time_range.start))
        if scope == "data_wait":
            continue
        category = "optimizer" if scope == "optimizer" else categorize(event.name)
        charges[(event.name, category)] += float(event.self_cpu_time_total)
    breakdown = _per_step_by_category(charges, steps)
    breakdown["data_wait"] = _data_wait_us(events) / steps / 1e3
    return breakdown, None, _top_ops(charges, steps)


def _device_breakdown(
    events: list[Any], steps: int, step_ms: float
) -> tuple[dict[str, float], float | None, list[dict[str, Any]]]:
    """CUDA: kernels, copies and sets by category; the device's idle time the host's."""
    launches_in_optimizer = _optimizer_launches(events)
    charges: dict[tuple[str, str], float] = defaultdict(float)
    intervals: list[tuple[float, float]] = []
    for event in events:
        if not _is_device_work(event):
            continue
        category = "optimizer" if event.id in launches_in_optimizer else categorize(event.name)
        charges[(event.name, category)] += float(event.time_range.end - event.time_range.start)
        intervals.append((float(event.time_range.start), float(event.time_range.end)))
    breakdown = _per_step_by_category(charges, steps)
    window = _window_span(events)
    busy_us = _union_length(intervals, window)
    data_wait_ms = _data_wait_us(events) / steps / 1e3
    breakdown["data_wait"] = data_wait_ms
    breakdown["host_idle"] = max(0.0, step_ms - busy_us / steps / 1e3 - data_wait_ms)
    span = (window[1] - window[0]) if window is not None else step_ms * steps * 1e3
    fraction = min(1.0, busy_us / span) if span > 0 else None
    return breakdown, fraction, _top_ops(charges, steps)


def _is_host_op(event: Any) -> bool:
    """A CPU op of the step (not a scope, the profiler's step marker, or a Python frame)."""
    if event.device_type != DeviceType.CPU or getattr(event, "is_async", False):
        return False
    if getattr(event, "is_user_annotation", False) or getattr(event, "is_python_function", False):
        return False
    name = event.name.lower()
    return not (_PROFILER_STEP.match(name) or _DATA_WAIT.search(name) or _OPTIMIZER_SCOPE.match(name))


def _is_device_work(event: Any) -> bool:
    """A kernel, copy or set on the GPU (not a user annotation drawn on the GPU's timeline)."""
    if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
        return False
    return "annotation" not in str(getattr(event, "activity_type", "") or "")


class _ScopeFinder:
    """The host scope an event runs in: "data_wait", "optimizer" or "" (memoized over the tree).

    An ``optimizer.step()`` given a closure (Lightning's automatic optimization) runs the forward and
    backward inside its scope: only what starts after the scope's last backward work (the update, and
    clipping before it) is the optimizer's; the closure's ops keep their own categories."""

    def __init__(self, events: list[Any] | None = None) -> None:
        self._known: dict[int, tuple[str, Any]] = {}
        self._backward_ends = sorted(
            (float(e.time_range.start), float(e.time_range.end))
            for e in events or ()
            if e.device_type == DeviceType.CPU and "backward" in e.name.lower()
        )
        self._closure_end: dict[int, float] = {}

    def of(self, event: Any, start: float | None = None) -> str:
        """The scope ``event`` runs in; ``start``: when the op asked about (a child of ``event``) began."""
        if start is None:
            start = float(event.time_range.start) if event is not None else 0.0
        chain = []
        found: tuple[str, Any] = ("", None)
        while event is not None:
            known = self._known.get(id(event))
            if known is not None:
                found = known
                break
            own = _own_scope(event.name)
            if own:
                found = (own, event)
                break
            chain.append(event)
            event = event.cpu_parent
        for member in chain:
            self._known[id(member)] = found
        scope, where = found
        if scope == "optimizer" and start < self._closure_ends(where):
            return ""  # the closure's forward or backward, run inside optimizer.step()
        return scope

    def _closure_ends(self, scope: Any) -> float:
        """When the last backward work inside ``scope``'s time ends (its start where there is none)."""
        key = id(scope)
        if key not in self._closure_end:
            lo, hi = float(scope.time_range.start), float(scope.time_range.end)
            ends = [end for start, end in self._backward_ends if lo <= start <= hi]
            self._closure_end[key] = max(ends) if ends else lo
        return self._closure_end[key]


def _own_scope(name: str) -> str:
    lowered = name.lower()
    if _DATA_WAIT.search(lowered):
        return "data_wait"
    if _OPTIMIZER_SCOPE.match(lowered):
        return "optimizer"
    return ""


def _optimizer_launches(events: list[Any]) -> set[int]:
    """Correlation ids of the device work launched inside ``optimizer.step()``/``zero_grad()``: the
    runtime calls (``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaMemcpyAsync``...) are host events in
    the op tree, sharing their id with the kernel they launched."""
    scopes = _ScopeFinder(events)
    ids: set[int] = set()
    for event in events:
        if event.device_type != DeviceType.CPU or not event.name.startswith("cu"):
            continue
        if scopes.of(event.cpu_parent, float(event.time_range.start)) == "optimizer":
            ids.add(event.id)
    return ids


def _data_wait_us(events: Iterable[Any]) -> float:
    """Host time inside the loader's fetch scopes (their union: nested scopes count once)."""
    intervals = [
        (float(event.time_range.start), float(event.time_range.end))
        for event in events
        if event.device_type == DeviceType.CPU and _DATA_WAIT.search(event.name.lower())
    ]
    return _union_length(intervals, None)


def _window_span(events: Iterable[Any]) -> tuple[float, float] | None:
    """The recorded steps' span on the profiler's clock: from the first ``ProfilerStep#`` to the last's end."""
    marks = [
        event.time_range for event in events if event.device_type == DeviceType.CPU and _PROFILER_STEP.match(event.name.lower())
    ]
    if not marks:
        return None
    return min(float(mark.start) for mark in marks), max(float(mark.end) for mark in marks)


def _union_length(intervals: list[tuple[float, float]], within: tuple[float, float] | None) -> float:
    """Total length covered by ``intervals`` (overlaps merged), clipped to ``within`` when given."""
    if within is not None:
        intervals = [(max(start, within[0]), min(end, within[1])) for start, end in intervals]
    total = 0.0
    current_start = current_end = None
    for start, end in sorted(interval for interval in intervals if interval[1] > interval[0]):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def _per_step_by_category(charges: dict[tuple[str, str], float], steps: int) -> dict[str, float]:
    breakdown = dict.fromkeys(CATEGORIES, 0.0)
    for (_, category), micros in charges.items():
        breakdown[category] += micros / steps / 1e3
    return breakdown


def _top_ops(charges: dict[tuple[str, str], float], steps: int) -> list[dict[str, Any]]:
    largest = sorted(charges.items(), key=lambda item: item[1], reverse=True)[:TOP_OPS]
    return [
        {"name": short_name(name), "category": category, "ms": micros / steps / 1e3}
        for (name, category), micros in largest
        if micros > 0
    ]


def short_name(name: str) -> str:
    """A kernel's or op's name cut to at most 80 characters (no ``void `` prefix, an ellipsis where cut)."""
    name = " ".join(name.split())
    if name.startswith("void "):
        name = name[len("void ") :]
    return name if len(name) <= SHORT_NAME_CHARS else name[: SHORT_NAME_CHARS - 1] + "…"
