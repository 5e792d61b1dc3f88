"""What a report needs to say about the machine and the library versions that produced it.

Every key is always present (``None`` where it does not apply or cannot be known), so two reports
can be compared key by key. Works without a GPU, without ``pynvml`` and without ``triton``; nothing
here imports Lightning or Triton just to read a version.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from typing import Any

import torch


def collect_environment(device: torch.device | str) -> dict[str, Any]:
    """Versions, CPU and (on CUDA) GPU facts for the report's ``environment`` section."""
    device = torch.device(device)
    env: dict[str, Any] = {
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "speedkit": _speedkit_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _triton_version(),
        "lightning": _distribution_version("lightning", "pytorch-lightning"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu_name": None,
        "gpu_compute_capability": None,
        "gpu_memory_bytes": None,
        "gpu_count": None,
        "gpu_driver": None,
        "cudnn": None,
    }
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        env.update(
            gpu_name=props.name,
            gpu_compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_bytes=int(props.total_memory),
            gpu_count=torch.cuda.device_count(),
            gpu_driver=_driver_version(),
            cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        )
    return env


def _speedkit_version() -> str:
    try:
        return importlib.metadata.version("speedkit")
    except importlib.metadata.PackageNotFoundError:
        pass
    import speedkit  # a source checkout that was never installed

    return str(getattr(speedkit, "__version__", "0+unknown"))


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    # Nightly torch ships triton as "pytorch-triton"; read metadata before paying for an import.
    version = _distribution_version("triton", "pytorch-triton", "pytorch-triton-rocm")
    if version is not None:
        return version
    try:
        import triton
    except ImportError:
        return None
    return str(getattr(triton, "__version__", "0+unknown"))


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                # x86: "model name"; some ARM kernels only give "Model" or "Hardware".
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _driver_version() -> str | None:
    from speedkit.measure.nvml import init_nvml

    pynvml = init_nvml()
    if pynvml is None:
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except pynvml.NVMLError:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
