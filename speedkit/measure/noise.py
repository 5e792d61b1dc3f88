"""Readings of a configuration's measurement: whether the host sets its step's pace, and the likely
source of its windows' noise (the ladder orders its trials and sizes its windows by them)."""

from __future__ import annotations

from speedkit.results import Measurement


def host_bound(m: Measurement, host_bound_share: float, busy_util: float) -> bool:
    """Whether the host's time issuing the step is what sets it: its host time ``host_bound_share`` of
    the step or more, and, where NVML saw the GPU, the GPU busy less than ``busy_util`` percent of the
    time. A step that syncs (Lightning's progress bar reads the loss every step) holds the host until
    the device is done, so its host time is the step's either way; the GPU's utilization tells which:
    99% on GPT-2 in fp32 (device-bound, host 339.5 of 340.2 ms), 32% on Lightning's demo Transformer."""
    if m.host_ms is None or not m.step_ms or m.host_ms < host_bound_share * m.step_ms:
        return False
    util = (m.telemetry or {}).get("util_mean")
    return util is None or util < busy_util


def noise_source(m: Measurement, host_bound_share: float, busy_util: float) -> str:
    """The likely source of a configuration's window-to-window noise, from what its windows show
    (host-bound: see :func:`host_bound`)."""
    telemetry = m.telemetry or {}
    if telemetry.get("slowdown_reasons"):
        return f"the GPU's clocks ({', '.join(telemetry['slowdown_reasons'])})"
    if m.data_wait_ms is not None and m.step_ms and m.data_wait_ms > 0.2 * m.step_ms:
        return f"waiting for batches ({m.data_wait_ms:.1f} of {m.step_ms:.1f} ms per step)"
    if m.clock == "perf_counter":
        return "the host (a CPU step is all host time: other processes, frequency scaling)"
    if host_bound(m, host_bound_share, busy_util):
        return (
            f"the host: the step is host-bound ({m.host_ms:.1f} of {m.step_ms:.1f} ms issuing it), so Python's and "
            "the CPU's jitter (scheduling, frequency, other threads) is the step's"
        )
    return "the device (no host, loader or clock cause seen)"
