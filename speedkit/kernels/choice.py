"""Speedkit's kernel or Inductor's code for a norm or a gated product inside a compiled step, decided per
shape by a micro-benchmark that runs once per shape and is remembered.

Inside a region ``torch.compile`` traces, the swapped norms run PyTorch's ops by default and leave the
fusion to Inductor (:mod:`speedkit.kernels.layers`: on an H200, GPT-2 small's norm kernels inside the
compiled graph cost 4.5% of the step against Inductor's code). A norm whose kernel is faster *for its
shape* runs the kernel there too. :func:`choose` decides: the layer alone, forward and backward, at the
input shape and dtype the step gives it and under the autocast in effect, timed both ways on the
device -- PyTorch's module under ``torch.compile`` and speedkit's kernel -- as medians of ``windows``
windows of ``steps`` calls after a warm-up, on CUDA events. The kernel is chosen where it is faster by
``margin`` (3%) or more. A gated product (``act(gate) * up`` with a SiLU ``act``, SwiGLU, or a GELU,
GeGLU, which ``triton_layers`` rewrites into :func:`speedkit.kernels.layers.silu_mul` / ``gelu_mul``) is
timed the same way at its gate's shape and dtype: ``speedkit::swiglu`` / ``speedkit::geglu`` against the
compiled ``F.silu(gate) * up`` / ``F.gelu(gate, approximate=…) * up``.

Timed alone, Inductor's code has no neighbours to fuse with (inside the step it folds the residual add
before a norm into it): the micro-benchmark favours the kernel. So a kernel it picks is still judged by
the ``triton_layers`` rung's whole-step comparison, and one it rejects stays out.

Decisions are kept in ``kernel_choices.json`` in the ladder's decision cache folder (in memory only
with the cache off), keyed by the layer, its shape, dtype and autocast, the device's name and the torch
and Triton versions: a shape is measured once per kind of machine and library versions
(:class:`ChoiceStore`, :func:`store_for`).
"""

from __future__ import annotations

import copy
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedkit.errors import OutputError
from speedkit.files import default_cache_dir, write_text_atomic
from speedkit.kernels.recognise import computes_gelu, computes_silu

#: the store's file in speedkit's cache folder
STORE_NAME = "kernel_choices.json"
#: the key in ``TrainState.notes`` of the run's :class:`ChoiceStore` (:func:`store_for`)
NOTE = "kernel_choices"
#: the kernel must beat Inductor's code by this fraction to be chosen
MARGIN = 0.03
#: a micro-benchmark's warm-up calls, windows and calls per window
WARMUP, WINDOWS, STEPS = 5, 5, 20
#: a timer: ``(what is timed, one call) -> milliseconds per call``
Timer = Callable[[str, Callable[[], None]], float]


@dataclass(frozen=True)
class LayerCase:
    """One layer at one input shape: ``kind`` ("layer_norm", "rms_norm", or a gated product of
    :data:`GATED`), the input's shape and dtype (a gated product's: its gate's), the autocast dtype in
    effect (None: off; a gated product runs in its inputs' dtype under any), and the module's own settings."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    autocast: str | None
    affine: bool = True
    bias: bool = True
    eps: float | None = 1e-5

    def describe(self) -> str:
        where = f", autocast {self.autocast}" if self.autocast else ""
        return f"{self.kind} {tuple(self.shape)} {self.dtype}{where}"


@dataclass
class Choice:
    """What :func:`choose` decided for a case: the two medians (ms per forward and backward), whether
    the kernel runs under compile, whether it was measured now or read from the store, and why."""

    case: LayerCase
    use_kernel: bool
    why: str
    kernel_ms: float | None = None
    compiled_ms: float | None = None
    measured: bool = False


def case_of(module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, autocast: torch.dtype | None) -> LayerCase | None:
    """The :class:`LayerCase` of an exact ``nn.LayerNorm`` / ``nn.RMSNorm`` (or its speedkit class), or of a
    gated product's activation (an ``nn.SiLU`` / ``nn.GELU``, its speedkit class, or a library's module
    computing one), fed ``shape`` in ``dtype``; None for another module."""
    act = (
        "silu"
        if isinstance(module, nn.SiLU) or computes_silu(module)
        else (module.approximate if isinstance(module, nn.GELU) else computes_gelu(module))
    )
    if act is not None:
        # a gated product's activation: the product runs in the gate's dtype (a Linear's output)
        kind = next(k for k, a in GATED.items() if a == act)
        gate_dtype = str(autocast or dtype).removeprefix("torch.")
        return LayerCase(kind, tuple(int(s) for s in shape), gate_dtype, None, affine=False, bias=False, eps=None)
    if isinstance(module, nn.LayerNorm):
        kind, bias = "layer_norm", module.bias is not None
    elif isinstance(module, nn.RMSNorm):
        kind, bias = "rms_norm", False
    else:
        return None
    return LayerCase(
        kind,
        tuple(int(s) for s in shape),
        str(dtype).removeprefix("torch."),
        str(autocast).removeprefix("torch.") if autocast is not None else None,
        affine=module.weight is not None,
        bias=bias,
        eps=module.eps,
    )


def key(case: LayerCase, device: torch.device) -> str:
    """The store's key of ``case`` on ``device``: the case, the device's name, torch's and Triton's versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return json.dumps([asdict(case), name, torch.__version__, triton_version], sort_keys=True)


class ChoiceStore:
    """Decisions by :func:`key`, in memory and, with a ``path``, in a JSON file (read once, written on
    each new decision; a file that cannot be read or written is left alone: decisions are then measured
    again in a later run)."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path is not None and self.path.exists():
            try:
                loaded = json.loads(self.path.read_text())
                self.entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                self.entries = {}

    def get(self, k: str) -> dict[str, Any] | None:
        return self.entries.get(k)

    def put(self, k: str, entry: dict[str, Any]) -> None:
        self.entries[k] = entry
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps(self.entries, indent=1, sort_keys=True))
        except (OSError, OutputError):
            pass


def store_for(notes: dict[str, Any]) -> ChoiceStore:
    """The one store of a run's rungs, kept in ``notes``: the ladder's (beside its decisions, or in memory
    only with its cache off), else one in speedkit's cache folder (:func:`speedkit.files.default_cache_dir`)
    put there by the first call. One object for the run: a case is measured, and the file read, once."""
    store = notes.get(NOTE)
    if store is None:
        store = notes[NOTE] = ChoiceStore(default_cache_dir() / STORE_NAME)
    return store


def cuda_median_ms(call: Callable[[], None], warmup: int = WARMUP, steps: int = STEPS, windows: int = WINDOWS) -> float:
    """Milliseconds per ``call``: the median of ``windows`` windows of ``steps`` calls on CUDA events,
    after ``warmup`` calls (the first compiles and autotunes)."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def cuda_timer(what: str, call: Callable[[], None]) -> float:
    """The micro-benchmark's :data:`Timer` on CUDA: :func:`cuda_median_ms` with its defaults."""
    return cuda_median_ms(call)


def _modules(case: LayerCase, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """(PyTorch's module, the same with speedkit's class) for ``case``, on ``device``."""
    from speedkit.kernels import layers

    n = case.shape[-1]
    if case.kind == "layer_norm":
        torch_module: nn.Module = nn.LayerNorm(n, eps=case.eps or 1e-5, elementwise_affine=case.affine, bias=case.bias)
    else:
        torch_module = nn.RMSNorm(n, eps=case.eps, elementwise_affine=case.affine)
    torch_module = torch_module.to(device)
    kernel_module = copy.deepcopy(torch_module)
    kernel_module.__class__ = layers.SWAPS[type(torch_module)]
    return torch_module, kernel_module


def _pass(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, autocast: torch.dtype | None) -> Callable[[], None]:
    def call() -> None:
        with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            y = module(x)
        y.backward(dy.to(y.dtype))

    return call


#: the gated products' kinds and the activation of each
GATED = {"swiglu": "silu", "geglu": "none", "geglu_tanh": "tanh"}


class _GatedMul(nn.Module):
    """``act(gate) * up`` over one input holding both (``x[0]``, ``x[1]``), ``act`` the SiLU or GELU of
    ``kind`` (:data:`GATED`): speedkit's kernel or PyTorch's ops."""

    def __init__(self, kind: str, kernel: bool) -> None:
        super().__init__()
        self.act, self.kernel = GATED[kind], kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from speedkit import kernels

        if self.act == "silu":
            return kernels.swiglu(x[0], x[1]) if self.kernel else nn.functional.silu(x[0]) * x[1]
        if self.kernel:
            return kernels.geglu(x[0], x[1], self.act)
        return nn.functional.gelu(x[0], approximate=self.act) * x[1]


def measure(case: LayerCase, device: torch.device, timer: Timer) -> tuple[float, float]:
    """(kernel ms, compiled ms) per forward and backward of ``case`` on ``device``, timed by ``timer``."""
    if case.kind in GATED:  # gate and up stacked: one input, each a contiguous half
        dtype = getattr(torch, case.dtype)
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn((2, *case.shape), generator=gen, device=device, dtype=dtype).requires_grad_()
        dy = torch.randn(case.shape, generator=gen, device=device, dtype=dtype)
        kernel_ms = timer("kernel", _pass(_GatedMul(case.kind, kernel=True), x, dy, None))
        compiled_ms = timer("compiled", _pass(torch.compile(_GatedMul(case.kind, kernel=False)), x, dy, None))
        return kernel_ms, compiled_ms
    torch_module, kernel_module = _modules(case, device)
    dtype = getattr(torch, case.dtype)
    autocast = getattr(torch, case.autocast) if case.autocast else None
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(case.shape, generator=gen, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(case.shape, generator=gen, device=device, dtype=dtype)
    compiled = torch.compile(torch_module)
    kernel_ms = timer("kernel", _pass(kernel_module, x, dy, autocast))
    compiled_ms = timer("compiled", _pass(compiled, x, dy, autocast))
    return kernel_ms, compiled_ms


def choose(
    case: LayerCase, device: torch.device, store: ChoiceStore, timer: Timer | None = None, margin: float = MARGIN
) -> Choice:
    """Whether ``case`` runs speedkit's kernel under compile (see the module doc): read from ``store``,
    else measured with ``timer`` (CUDA events on a CUDA device; elsewhere nothing is measured and
    Inductor's code is kept) and stored."""
    if timer is None:
        if device.type != "cuda":
            return Choice(case, False, "the kernels are timed on CUDA only: Inductor's code")
        timer = cuda_timer
    k = key(case, device)
    entry = store.get(k)
    measured = entry is None
    if entry is None:
        try:
            kernel_ms, compiled_ms = measure(case, device, timer)
        except Exception as exc:  # noqa: BLE001 (a case the benchmark cannot run keeps Inductor's code, saying why)
            return Choice(
                case,
                False,
                f"not measured ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}): Inductor's code",
            )
        entry = {"kernel_ms": kernel_ms, "compiled_ms": compiled_ms}
        store.put(k, entry)
    kernel_ms, compiled_ms = float(entry["kernel_ms"]), float(entry["compiled_ms"])
    use = kernel_ms <= (1.0 - margin) * compiled_ms
    why = (
        f"kernel {kernel_ms:.3f} ms against compiled {compiled_ms:.3f} ms"
        + (" (measured)" if measured else " (remembered)")
        + (": the kernel" if use else f": Inductor's code (the kernel must be {margin:.0%} faster)")
    )
    return Choice(case, use, why, kernel_ms, compiled_ms, measured)
