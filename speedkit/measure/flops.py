"""FLOPs per training step, counted by ``torch.utils.flop_counter`` (no user formula), and MFU.

Convention: the FLOPs that FlopCounterMode attributes to one eager forward + backward of the
training step — matrix products, convolutions and attention, 2 FLOPs per multiply-add; element-wise
ops, norms, the optimizer update and the embedding lookup are not counted. For a transformer this is
the usual 6·N + 12·L·T·d per token (attention counted in full, also when causal). The same count is
used for every rung, and MFU is always reported against one peak (by default the GPU's dense bf16
peak), so MFU ratios between rungs equal speed ratios.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from speedkit import config

CONVENTION = (
    "FLOPs per step = those torch.utils.flop_counter counts in one eager forward+backward of the "
    "training step (matmul/conv/attention, 2 per multiply-add; element-wise, norms, optimizer and "
    "embedding lookups not counted; attention counted in full). MFU = FLOPs per step / step time / "
    "dense peak TFLOP/s at {precision} of {source}."
)


def count_step_flops(step: Any, batch: Any, batch_idx: int = 0) -> int | None:
    """FLOPs of one forward + backward of ``batch`` (``step.counted_pass``: ``step.forward_loss(batch)``
    and its backward; a manual-optimization step's whole ``training_step``); gradients are cleared after.

    None when the step cannot be counted (an op FlopCounterMode does not know raises, or the step
    returns no loss for this batch): MFU is then not reported, nothing else changes.
    """
    try:
        with FlopCounterMode(display=False) as counter:
            step.counted_pass(batch, batch_idx)
    except Exception:
        return None
    finally:
        for p in step.model.parameters():
            p.grad = None
    return int(counter.get_total_flops())


def peak_tflops(device: torch.device, precision: str = "bf16", override: float | None = None) -> tuple[float | None, str]:
    """The peak to compute MFU against, and where it came from."""
    if override is not None:
        return float(override), "measure.peak_tflops (recipe override)"
    if device.type != "cuda":
        return None, f"no peak table for {device.type} (MFU not reported)"
    name = torch.cuda.get_device_name(device)
    peak = config.gpu_peak_tflops(name, precision)
    if peak is None:
        return None, f"{name!r} is not in configs/gpu_peaks.yaml (set measure.peak_tflops)"
    return peak, f"{name} datasheet, configs/gpu_peaks.yaml"


def mfu(flops_per_step: int | None, step_seconds: float, peak: float | None) -> tuple[float | None, float | None]:
    """Return ``(mfu as a fraction, achieved TFLOP/s)``; ``None`` where unknown."""
    if not flops_per_step or step_seconds <= 0:
        return None, None
    achieved = flops_per_step / step_seconds / 1e12
    return (achieved / peak if peak else None), achieved
