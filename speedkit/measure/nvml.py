"""NVML telemetry sampled in the background while steps are timed.

A daemon thread reads, every ``interval_s``, the GPU's utilization, memory used, power draw, SM
clock and clock-event (throttle) reasons through ``pynvml`` (the ``nvidia-ml-py`` package), and
``stop()`` returns a summary dict. It explains a slow measurement (power cap, thermal slowdown,
an idle GPU waiting on the host) without changing it: NVML reads are cheap and run off the
training thread.

Telemetry is optional and silently absent: :meth:`NvmlSampler.create` returns ``None`` on a
non-CUDA device, without ``pynvml`` or when NVML cannot start (no driver, a container without the
NVML library). Once started, sampling never raises into the caller: an error inside the thread
ends sampling and is recorded as ``error`` in the summary.

Example::

    sampler = NvmlSampler.create(torch.device("cuda"))
    if sampler is not None:
        with sampler:
            run_timed_steps()
        telemetry = sampler.summary   # {"samples": 42, "util_mean": 97.6, ...}
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from statistics import fmean
from typing import Any

import torch

from speedkit import config

# Clock-event reason bits: (name, pynvml constant (new name), pynvml constant (old name), value).
# The values are NVML's (nvml.h, nvmlClocksEventReason*); they are the fallback when a pynvml
# version lacks both names.
_REASONS: tuple[tuple[str, str, str, int], ...] = (
    ("gpu_idle", "nvmlClocksEventReasonGpuIdle", "nvmlClocksThrottleReasonGpuIdle", 0x1),
    (
        "applications_clocks_setting",
        "nvmlClocksEventReasonApplicationsClocksSetting",
        "nvmlClocksThrottleReasonApplicationsClocksSetting",
        0x2,
    ),
    ("sw_power_cap", "nvmlClocksEventReasonSwPowerCap", "nvmlClocksThrottleReasonSwPowerCap", 0x4),
    ("hw_slowdown", "nvmlClocksEventReasonHwSlowdown", "nvmlClocksThrottleReasonHwSlowdown", 0x8),
    ("sync_boost", "nvmlClocksEventReasonSyncBoost", "nvmlClocksThrottleReasonSyncBoost", 0x10),
    ("sw_thermal_slowdown", "nvmlClocksEventReasonSwThermalSlowdown", "nvmlClocksThrottleReasonSwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "nvmlClocksEventReasonHwThermalSlowdown", "nvmlClocksThrottleReasonHwThermalSlowdown", 0x40),
    ("hw_power_brake", "nvmlClocksEventReasonHwPowerBrakeSlowdown", "nvmlClocksThrottleReasonHwPowerBrakeSlowdown", 0x80),
    ("display_clocks_setting", "nvmlClocksEventReasonDisplayClockSetting", "nvmlClocksThrottleReasonDisplayClockSetting", 0x100),
)

#: reasons that mean the GPU ran slower than it could have (the others are idle or a setting)
SLOWDOWN_REASONS = frozenset({"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake"})

_NVML_CLOCK_SM = 1  # nvmlClockType_t NVML_CLOCK_SM
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_FUNCTION_NOT_FOUND = 13


def init_nvml() -> Any:
    """``pynvml`` after a successful ``nvmlInit()``, or ``None`` where NVML is not there.

    The caller owns the init and must end it with ``nvmlShutdown()``.
    """
    try:
        import pynvml
    except (ImportError, OSError):
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError):
        return None
    return pynvml


def decode_clock_event_reasons(mask: int, pynvml: Any = None) -> list[str]:
    """Names of the reason bits set in ``mask``; unknown bits come back as ``"0x..."``."""
    names = []
    known = 0
    for name, new, old, value in _REASONS:
        bit = getattr(pynvml, new, getattr(pynvml, old, value)) if pynvml is not None else value
        known |= bit
        if mask & bit:
            names.append(name)
    if mask & ~known:
        names.append(hex(mask & ~known))
    return names


def nvml_index(cuda_index: int, pynvml: Any, visible: str | None = None, uuid: str | None = None) -> int | None:
    """The NVML index of the GPU that CUDA calls ``cuda_index`` in this process, or ``None``.

    NVML enumerates every GPU of the machine; CUDA only those in ``CUDA_VISIBLE_DEVICES``, in that
    order. When torch knows the device's ``uuid`` it is matched against ``nvmlDeviceGetUUID``
    (exact, whatever ``CUDA_DEVICE_ORDER`` says). Otherwise ``CUDA_VISIBLE_DEVICES`` is read:
    integer entries are taken as NVML indices, ``GPU-...`` entries as UUIDs or UUID prefixes;
    MIG entries are not mapped (``None``). Call with NVML initialized.
    """
    if uuid:
        found = _index_of_uuid(pynvml, "GPU-" + uuid.removeprefix("GPU-"))
        if found is not None:
            return found
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return cuda_index  # unset: CUDA sees every GPU, in NVML's (PCI bus) order
    # CUDA stops reading the list at its first invalid entry; later entries are not visible.
    entries: list[str] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    if cuda_index >= len(entries):
        return None
    entry = entries[cuda_index]
    if entry.isdigit():
        return int(entry)
    return _index_of_uuid(pynvml, entry) if entry.startswith("GPU-") else None


def _index_of_uuid(pynvml: Any, prefix: str) -> int | None:
    for index in range(pynvml.nvmlDeviceGetCount()):
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        if isinstance(uuid, bytes):  # pynvml < 11.5 returned bytes
            uuid = uuid.decode()
        if uuid.startswith(prefix):
            return index
    return None


class NvmlSampler:
    """Sample one GPU's NVML counters in a daemon thread between ``start()`` and ``stop()``.

    Args:
        device_index: the GPU's NVML index (use :meth:`create` to map a torch device to it).
        interval_s: seconds between samples (None: ``nvml.interval_s`` of configs/defaults.yaml); the
            first sample is taken at once.
        clock: monotonic clock for ``duration_s`` (tests pass a fake one).

    Raises:
        ValueError: ``interval_s`` is not positive or ``device_index`` is negative.
    """

    def __init__(
        self, device_index: int = 0, interval_s: float | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval_s is None:
            interval_s = float(config.defaults("nvml")["interval_s"])
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if device_index < 0:
            raise ValueError(f"device_index must be >= 0, got {device_index}")
        self.device_index = device_index
        self.interval_s = interval_s
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._samples: list[dict[str, Any]] = []
        self._error: str | None = None
        self._started_at = 0.0
        self._started_mono = 0.0
        self.summary: dict[str, Any] | None = None

    @classmethod
    def create(cls, device: torch.device | str, interval_s: float | None = None) -> NvmlSampler | None:
        """A sampler for the GPU behind ``device``, or ``None`` where NVML cannot watch it."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        pynvml = init_nvml()
        if pynvml is None:
            return None
        try:
            cuda_index = device.index if device.index is not None else _current_cuda_index()
            index = nvml_index(cuda_index, pynvml, uuid=_torch_uuid(cuda_index))
            if index is None or index >= pynvml.nvmlDeviceGetCount():
                return None
        except pynvml.NVMLError:
            return None
        finally:
            _shutdown(pynvml)
        return cls(index, interval_s)

    # -- start / stop -------------------------------------------------------------------------

    def start(self) -> NvmlSampler:
        """Start sampling in the background; a running sampler is stopped and restarted."""
        if self._thread is not None:
            self.stop()
        self._stop_event.clear()
        self._samples = []
        self._error = None
        self.summary = None
        self._started_at = self._clock()
        self._started_mono = time.monotonic()  # the samples' times (the injected clock times the summary only)
        self._thread = threading.Thread(target=self._run, name="speedkit-nvml", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any] | None:
        """Stop sampling and return the summary (``None`` if never started)."""
        if self._thread is None:
            return self.summary
        self._stop_event.set()
        self._thread.join()
        self._thread = None
        self.summary = summarize_samples(self._samples, duration_s=self._clock() - self._started_at, error=self._error)
        return self.summary

    @property
    def samples(self) -> list[dict[str, Any]]:
        """The samples so far, oldest first (each a dict of the quantities read; a copy)."""
        return [dict(s) for s in self._samples]

    def latest(self) -> dict[str, Any] | None:
        """The newest sample, or None before the first (read without waiting for the thread)."""
        return dict(self._samples[-1]) if self._samples else None

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the sampling thread ------------------------------------------------------------------

    def _run(self) -> None:
        # Everything NVML happens here, so that start() never blocks and no error reaches the
        # caller. NVML's init/shutdown are reference-counted, so this pairs with other users.
        try:
            import pynvml
        except (ImportError, OSError) as exc:
            self._error = f"import pynvml: {exc}"
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - must never escape the thread
            self._error = f"nvmlInit: {type(exc).__name__}: {exc}"
            return
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            reads = _reads(pynvml, handle)
            while True:
                sample = {}
                for key, read in list(reads.items()):
                    try:
                        sample[key] = read()
                    except pynvml.NVMLError as exc:
                        if getattr(exc, "value", None) != getattr(pynvml, "NVML_ERROR_NOT_SUPPORTED", _NVML_ERROR_NOT_SUPPORTED):
                            raise
                        del reads[key]  # this GPU does not report it: stop asking
                sample["t"] = time.monotonic() - self._started_mono  # when, from start(): reads take time
                self._samples.append(sample)
                if self._stop_event.wait(self.interval_s):
                    break
        except Exception as exc:  # noqa: BLE001 - must never escape the thread
            self._error = f"{type(exc).__name__}: {exc}"
        finally:
            _shutdown(pynvml)


def _reads(pynvml: Any, handle: Any) -> dict[str, Callable[[], Any]]:
    """One zero-argument reader per sampled quantity."""
    sm = getattr(pynvml, "NVML_CLOCK_SM", _NVML_CLOCK_SM)
    # Renamed in NVML 12.2 ("throttle" -> "clocks event"); a driver older than that lacks the
    # new symbol, so fall back to the old name once and keep it.
    getters = [
        getattr(pynvml, name)
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        if hasattr(pynvml, name)
    ]

    def reasons(handle: Any) -> int:
        while True:
            try:
                return getters[0](handle)
            except pynvml.NVMLError as exc:
                not_found = getattr(pynvml, "NVML_ERROR_FUNCTION_NOT_FOUND", _NVML_ERROR_FUNCTION_NOT_FOUND)
                if getattr(exc, "value", None) != not_found or len(getters) == 1:
                    raise
                getters.pop(0)

    reads: dict[str, Callable[[], Any]] = {
        "util": lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "mem_used": lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
        "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # milliwatts
        "sm_clock": lambda: float(pynvml.nvmlDeviceGetClockInfo(handle, sm)),
    }
    if hasattr(pynvml, "nvmlDeviceGetEnforcedPowerLimit"):  # the limit the power draw is held under
        reads["power_limit_w"] = lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    if getters:
        reads["reasons"] = lambda: decode_clock_event_reasons(int(reasons(handle)), pynvml)
    return reads


def timeline(
    samples: list[dict[str, Any]], interval_s: float, marks: list[tuple[float, str]] | None = None
) -> dict[str, Any] | None:
    """The samples as a plot-ready series for the report: ``t_s`` (seconds from the sampler's start,
    as each sample was taken; by the interval for samples without a time), ``util`` (%), ``power_w``, ``power_limit_w``, ``sm_clock_mhz``, ``reasons``
    (clock-event reasons: confounders of a comparison), and ``marks`` (seconds, label: where each
    configuration's window began); None without samples."""
    if not samples:
        return None
    series = [
        {
            "t_s": round(s.get("t", i * interval_s), 3),
            "util": s.get("util"),
            "power_w": s.get("power_w"),
            "power_limit_w": s.get("power_limit_w"),
            "sm_clock_mhz": s.get("sm_clock"),
            "reasons": list(s.get("reasons") or []),
        }
        for i, s in enumerate(samples)
    ]
    return {
        "interval_s": interval_s,
        "samples": series,
        "marks": [{"t_s": round(t, 3), "label": label} for t, label in (marks or [])],
    }


def summarize_samples(samples: list[dict[str, Any]], *, duration_s: float, error: str | None = None) -> dict[str, Any]:
    """The summary dict of a list of samples; a quantity never read is ``None``.

    ``clock_event_reasons`` lists every reason seen (``gpu_idle`` and settings included);
    ``slowdown_reasons`` only those in :data:`SLOWDOWN_REASONS`, and ``slowdown_fraction`` the
    share of samples that had one.
    """

    def values(key: str) -> list[Any]:
        return [s[key] for s in samples if key in s]

    util, mem, power, clock = values("util"), values("mem_used"), values("power_w"), values("sm_clock")
    reason_lists = values("reasons")
    seen = sorted({name for names in reason_lists for name in names})
    slowed = [names for names in reason_lists if SLOWDOWN_REASONS.intersection(names)]
    return {
        "samples": len(samples),
        "util_mean": fmean(util) if util else None,
        "util_max": max(util) if util else None,
        "mem_used_max_bytes": max(mem) if mem else None,
        "power_mean_w": fmean(power) if power else None,
        "power_max_w": max(power) if power else None,
        "sm_clock_mean_mhz": fmean(clock) if clock else None,
        "sm_clock_min_mhz": min(clock) if clock else None,
        "clock_event_reasons": seen,
        "slowdown_reasons": [name for name in seen if name in SLOWDOWN_REASONS],
        "slowdown_fraction": len(slowed) / len(reason_lists) if reason_lists else None,
        "duration_s": duration_s,
        "error": error,
    }


def _torch_uuid(cuda_index: int) -> str | None:
    """torch's UUID of a CUDA device (no "GPU-" prefix), or ``None`` where torch cannot say."""
    try:
        if not torch.cuda.is_available():
            return None
        uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    except (RuntimeError, AssertionError):
        return None
    return str(uuid) if uuid is not None else None


def _current_cuda_index() -> int:
    try:
        return torch.cuda.current_device() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


def _shutdown(pynvml: Any) -> None:
    try:
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - nothing to do about a failed shutdown
        pass
