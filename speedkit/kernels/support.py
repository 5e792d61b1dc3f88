"""Where the kernels can run, and the launch-size helpers shared by them."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``): kernels run on CPU tensors, slowly."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_available(device: torch.device | str | None = None) -> str | None:
    """``None`` if speedkit's Triton kernels can run on ``device``, else the reason they cannot."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    if device.type == "cuda":
        if torch.version.hip is not None:
            return "speedkit's kernels are tuned for NVIDIA GPUs; this is a ROCm build"
        major, _ = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"speedkit's kernels need compute capability >= 8.0 (bf16); this GPU is {major}.x"
        return None
    if device.type == "cpu" and interpreting():
        return None
    return f"Triton kernels do not run on {device.type} (set TRITON_INTERPRET=1 to test them on the CPU)"


def runs_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter: a few programs are enough to exercise the persistent loops


@functools.cache
def _cuda_sms(index: int) -> int:  # cached: launchers run every step, and the host's time counts
    return torch.cuda.get_device_properties(index).multi_processor_count


# -- launching with less host work ----------------------------------------------------------------------
#
# ``kernel[grid](...)`` costs tens of microseconds of host time per call (argument binding, the
# cache lookup, launch-hook metadata, stream lookup): as much as the kernel itself for activations
# of a few MB, and it adds up over the norms of a model run eagerly. ``launch`` keeps the compiled
# kernel of each specialization and calls its launcher directly. The cache key is finer than
# Triton's own specialization (dtypes, 16-byte alignment of every pointer, ints equal to 0 or 1,
# divisible by 16, and their integer width; constexpr values; num_warps), so a hit always names
# the kernel Triton itself would have chosen; a miss, a profiler's launch hook, the interpreter, or
# an argument of another type take Triton's ordinary path. ``SPEEDKIT_FAST_LAUNCH=0`` turns it off.

_COMPILED: dict[tuple, object] = {}


def _fast_launch_enabled() -> bool:
    if interpreting() or os.environ.get("SPEEDKIT_FAST_LAUNCH", "1") == "0":
        return False
    try:
        from triton.compiler.compiler import CompiledKernel

        return all(hasattr(CompiledKernel, a) for a in ("launch_metadata",)) and hasattr(torch._C, "_cuda_getCurrentRawStream")
    except Exception:  # noqa: BLE001 - any surprise in Triton's internals: the ordinary path
        return False


_FAST: bool | None = None


def _hooks_idle() -> bool:
    """No launch hook is installed (a profiler such as Proton installs them; then Triton must launch)."""
    try:
        from triton import knobs
    except ImportError:  # older Triton: its own path
        return False
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _arg_key(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "b", a
    if isinstance(a, int):
        return "i", a == 0, a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), 0 <= a < (1 << 63)
    if isinstance(a, float):
        return "f"
    if a is None:
        return "n"
    raise TypeError  # anything else: Triton's ordinary path


@functools.cache
def _all_constexpr(kernel, n_args: int) -> bool:
    """The parameters after the first ``n_args`` are all constexprs."""
    return all(p.is_constexpr for p in kernel.params[n_args:])


def launch(kernel, grid: tuple[int, ...], *args: object, num_warps: int, **constexprs: object) -> None:
    """``kernel[grid](*args, num_warps=num_warps, **constexprs)``, with less host work on a cache hit.

    ``args`` are the kernel's leading (runtime) parameters in order; ``constexprs`` name the rest.
    """
    global _FAST
    if _FAST is None:
        _FAST = _fast_launch_enabled()
    if not _FAST or not _hooks_idle():
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    names = kernel.arg_names
    if not _all_constexpr(kernel, len(args)):  # a runtime argument passed by keyword: the ordinary path
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    try:
        cvals = tuple(constexprs[n] for n in names[len(args):])
        device = torch.cuda.current_device()
        key = (kernel, device, num_warps, cvals, tuple(_arg_key(a) for a in args))
    except (KeyError, TypeError):
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, num_warps=num_warps, **constexprs)  # compiles if needed, and launches
        if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            _COMPILED[key] = compiled
        return
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), compiled.function,
                  compiled.packed_metadata, None, None, None, *args, *cvals)
