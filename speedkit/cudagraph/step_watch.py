"""What one real step of training does that a CUDA graph would replay wrong, found by running it:
:func:`find_syncs` runs the step under ``torch.cuda.set_sync_debug_mode`` and names every
synchronizing call it made (library code included), with its file and line; :func:`find_host_draws`
watches the same step for random numbers drawn on the host (timm's Mixup, LayerDrop). The static
reading of the step's own source is :mod:`speedkit.cudagraph.safety`.
"""

from __future__ import annotations

import contextlib
import linecache
import random
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from speedkit.cudagraph.safety_visitor import Blocker
from speedkit.rewrite.source import is_callers_file, is_users_own_file


def find_syncs(run_step: Callable[[], Any], unique: bool = True) -> tuple[Any, list[Blocker]]:
    """Run ``run_step()`` once with CUDA's sync debug mode warning on every synchronizing call; return
    its result and the calls found (file and line of the Python code that made each; with ``unique``
    each once, else every call, in order: a line reached N times in the step is there N times)."""
    found: list[Blocker] = []
    previous_mode = torch.cuda.get_sync_debug_mode()
    previous_show = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "called a synchronizing" not in str(message):  # (set_sync_debug_mode itself warns it is a prototype)
            previous_show(message, category, filename, lineno, file, line)
            return
        full = traceback.extract_stack()[:-1]
        if while_compiling(full):  # torch.compile's own work on a first call: once, not in the step replayed
            return
        stack = [f for f in full if not _is_machinery(f.filename)]
        frame = stack[-1] if stack else None
        where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else f"{filename}:{lineno}"
        user = next((f for f in reversed(stack) if is_callers_file(f.filename)), None)
        reason = "a synchronizing CUDA call" + (
            f" (reached from {user.filename}:{user.lineno} in {user.name})" if user is not None and user is not frame else ""
        )
        found.append(Blocker("host sync", reason, where, (frame.line or "").strip() if frame else ""))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run_step()
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
    return result, list(dict.fromkeys(found)) if unique else found


# -- dynamic: random numbers drawn on the host during one real step --------------------------------

#: torch functions that draw from a generator; one of them advancing the CPU generator draws on the host
_TORCH_DRAWS = {
    "rand",
    "randn",
    "randint",
    "randperm",
    "rand_like",
    "randn_like",
    "randint_like",
    "bernoulli",
    "multinomial",
    "normal",
    "poisson",
    "uniform_",
    "normal_",
    "random_",
    "bernoulli_",
    "exponential_",
    "geometric_",
    "cauchy_",
    "log_normal_",
}
_STATE_CALLS = {"getstate", "setstate", "get_state", "set_state", "__getstate__", "__setstate__"}


@dataclass(frozen=True)
class _HostGenerators:
    """The states of the host's global random generators: torch's CPU generator, NumPy's global
    ``RandomState``, Python's ``random``."""

    torch_cpu: torch.Tensor
    numpy: Any
    python: Any

    @classmethod
    def now(cls) -> _HostGenerators:
        np = sys.modules.get("numpy")
        return cls(torch.random.get_rng_state(), np.random.get_state() if np is not None else None, random.getstate())

    def advanced(self, before: _HostGenerators) -> list[str]:
        """The generators that drew since ``before``."""
        moved = []
        if not torch.equal(self.torch_cpu, before.torch_cpu):
            moved.append("torch's CPU generator")
        if self.numpy is not None and before.numpy is not None and not _same_numpy_state(self.numpy, before.numpy):
            moved.append("NumPy's global generator")
        if self.python != before.python:
            moved.append("Python's random module")
        return moved


def _same_numpy_state(a: Any, b: Any) -> bool:
    np = sys.modules["numpy"]
    return a[0] == b[0] and bool(np.array_equal(a[1], b[1])) and tuple(a[2:]) == tuple(b[2:])


def find_host_draws(run_step: Callable[[], Any], *, locate: bool = True) -> tuple[Any, list[Blocker]]:
    """Run ``run_step()`` once and find the random numbers it drew on the host (timm's Mixup/CutMix
    drawing with NumPy, Hugging Face's LayerDrop with ``torch.rand([])``, an augmentation deciding in
    Python): a graph replays the capture's draw every step, the same mix, crop or dropped layer.

    Which global generator advanced tells whether the step drew; ``locate`` also names the call, its
    file and line (through ``sys.setprofile`` for this one step: leave it off where ``torch.compile``
    runs, whose frames a profile function makes it compile again)."""
    before = _HostGenerators.now()
    calls: list[Blocker] = []
    pending: list[tuple[Any, torch.Tensor]] = []  # a torch draw under way, with the CPU generator before it

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            owner, name = getattr(arg, "__self__", None), getattr(arg, "__name__", "")
            if name in _STATE_CALLS:
                return
            if _is_host_generator(owner):
                calls.append(_draw_blocker(frame, f"{type(owner).__name__}.{name}"))
            elif name in _TORCH_DRAWS and _is_torch(arg, owner):
                pending.append((arg, torch.random.get_rng_state()))
        elif event in ("c_return", "c_exception") and pending and pending[-1][0] is arg:
            _, state = pending.pop()
            if not torch.equal(state, torch.random.get_rng_state()):
                calls.append(_draw_blocker(frame, f"torch.{getattr(arg, '__name__', 'rand')} on the CPU"))

    previous = sys.getprofile()
    with _numpy_draws_named(calls) if locate else contextlib.nullcontext():
        if locate:
            sys.setprofile(profile)
        try:
            result = run_step()
        finally:
            if locate:
                sys.setprofile(previous)
    moved = _HostGenerators.now().advanced(before)
    if not moved and not calls:
        return result, []
    if calls:
        return result, list(dict.fromkeys(calls))
    return result, [
        Blocker(
            "host work",
            f"{' and '.join(moved)} drew during the step (a random number decided on the host, drawn once at capture)",
            "a call not located (where torch.compile runs the step the call is not traced: tracing would make it compile again)",
            "",
        )
    ]


@contextlib.contextmanager
def _numpy_draws_named(calls: list[Blocker]) -> Iterator[None]:
    """NumPy's global draws (``np.random.beta``: methods of its global ``RandomState``, compiled by
    Cython) raise no profile event: for one step each is called through a function that names its
    caller, put back after it."""
    np = sys.modules.get("numpy")
    if np is None:
        yield
        return
    module, saved = np.random, {}
    for name in dir(module):
        fn = getattr(module, name, None)
        if getattr(fn, "__self__", None) is module.mtrand._rand or name == "default_rng":
            saved[name] = fn

    def naming(name: str, fn: Any) -> Callable[..., Any]:
        def draw(*args: Any, **kwargs: Any) -> Any:
            calls.append(_draw_blocker(sys._getframe(1), f"numpy.random.{name}"))
            return fn(*args, **kwargs)

        return draw

    for name, fn in saved.items():
        setattr(module, name, naming(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _is_host_generator(owner: Any) -> bool:
    if isinstance(owner, random.Random):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(owner, (np.random.RandomState, np.random.Generator))


def _is_torch(fn: Any, owner: Any) -> bool:
    if isinstance(owner, torch.Tensor):
        return owner.device.type == "cpu"
    return (getattr(fn, "__module__", None) or "").startswith("torch")


def _draw_blocker(frame: Any, call: str) -> Blocker:
    """The call ``call`` made from ``frame``, named at the first frame outside the generators' own modules."""
    while frame is not None and (frame.f_code.co_filename.endswith("/random.py") or "/numpy/random/" in frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return Blocker("host work", f"draws a random number on the host ({call}), drawn once at capture", "?", "")
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    user = frame.f_back
    while user is not None and not is_users_own_file(user.f_code.co_filename):
        user = user.f_back
    reached = (
        f" (reached from {user.f_code.co_filename}:{user.f_lineno} in {user.f_code.co_name})"
        if user is not None and not is_users_own_file(frame.f_code.co_filename)
        else ""
    )
    return Blocker(
        "host work",
        f"draws a random number on the host ({call}), drawn once at capture and replayed every step{reached}",
        where,
        linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip(),
    )


#: frames on the stack only while torch.compile compiles (Dynamo's frame conversion on a cache miss,
#: Inductor's compilation), never while compiled code runs
_COMPILING = ("/torch/_dynamo/convert_frame.py", "/torch/_inductor/compile_fx.py")


def while_compiling(stack: list[traceback.FrameSummary]) -> bool:
    """Whether a call was made by torch.compile compiling (Inductor folding a constant reads it with
    ``.item()``: a sync once, at the first call of a configuration, not in the step a graph replays)."""
    return any(f.filename.replace("\\", "/").endswith(_COMPILING) for f in stack)


def _is_machinery(filename: str) -> bool:
    """Frames of the warning machinery and of torch's tensor and CUDA wrappers, skipped when naming a sync."""
    return any(part in filename for part in ("/warnings.py", "/torch/_tensor.py", "/torch/cuda/"))
