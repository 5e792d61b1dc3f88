"""Where the kernels can run, and the launch-size helpers shared by them."""

from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``): kernels run on CPU tensors, slowly."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_available(device: torch.device | str | None = None) -> str | None:
    """``None`` if speedkit's Triton kernels can run on ``device``, else the reason they cannot."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not triton_installed():
        return "Triton is not installed (torch's CUDA builds bring it; pip install triton for the CPU interpreter)"
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
