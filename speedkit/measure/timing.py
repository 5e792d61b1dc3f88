"""Timing a step function in windows on the step clock: the one loop the ladder and bench share."""

from __future__ import annotations

from collections.abc import Callable

import torch

from speedkit.measure.clock import StepClock


def time_windows(run_step: Callable[[], object], clock: StepClock, *, warmup: int, steps: int, repeats: int) -> list[float]:
    """Run ``warmup`` untimed steps, then ``repeats`` windows of ``steps``; return each window's mean ms.

    The clock marks every step without waiting; it waits for the device once per window.
    """
    for _ in range(warmup):
        run_step()
    device = getattr(clock.backend, "device", None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)  # warm-up work must not bleed into the first window
    windows = []
    for _ in range(repeats):
        clock.start()
        for _ in range(steps):
            run_step()
            clock.step()
        times = clock.stop()
        windows.append(sum(times) / len(times))
    return windows
