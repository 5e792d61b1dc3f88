"""The diagnosis of a training step: what sets its pace, read from the baseline's step clock and one
short profile window, before any rung is tried.

:func:`diagnose` takes the baseline's :class:`~speedkit.results.Measurement` (step time, data wait,
host time, NVML's utilization, peak memory, the windows' spread), and where they were taken a profile
window (:class:`~speedkit.profile.window.ProfileWindow`: ms per step by category, the device's busy
fraction) and the step's host syncs (:func:`~speedkit.profile.syncs.find_host_syncs`). It returns a
:class:`Diagnosis`: those figures, the share of the step each target a rung can cut takes
(:meth:`Diagnosis.shares`, by which :mod:`speedkit.engine.plan` bounds a rung's gain), and a class.

The classes and their rules (the thresholds: ``diagnosis:`` in ``configs/defaults.yaml``; shares are
of the step's time):

* **data-bound**: the step waits for its batch ``data_bound_share`` (30%) of it or more;
* **memory-bound** (GPU): the peak memory is ``memory_bound_share`` (90%) of the device's or more;
* **sync-bound** (GPU): the step makes host syncs, and the device is both idle behind the host and
  busy ``sync_share`` (20%) of the step or more: with the syncs gone the host would run ahead and the
  two could overlap;
* **host-bound** (GPU): the host's time issuing the step is ``host_bound_share`` (80%) of it or more
  and the device busy less than ``busy_fraction`` (90%) of the time
  (:func:`speedkit.measure.noise.host_bound`, and the profile's busy fraction where there is one);
* **device-bound** otherwise, naming its largest device categories. On a CPU the "device" is the CPU:
  the breakdown is its ops' time, and the classes that need a device apart from the host (sync-,
  host-, memory-bound) do not arise.

Where several rules hold, the first in that order is the step's class (the others are kept in
``Diagnosis.also``): data-bound first, since nothing else shows while the device waits for batches;
memory-bound next, since a step near the device's memory pays in allocator retries and has no room for
what costs memory (a CUDA graph's pool, compile's autotuning); sync-bound before host-bound, since a
step that syncs holds the host until the device is done, so its host time is the step's whether the
host or the device sets the pace (the host-bound reading cannot tell them apart while the syncs are
there). A sync-bound step whose device is busy less than ``sync_share`` is host-bound: the host's own
issuing sets its pace with or without the syncs.

Plain data in, plain data out: nothing here runs a step, a profiler or Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from speedkit import config
from speedkit.errors import ConfigError
from speedkit.measure.noise import host_bound
from speedkit.profile.categories import CATEGORIES, CATEGORY_LABELS

if TYPE_CHECKING:
    from speedkit.profile.window import ProfileWindow
    from speedkit.results import Measurement

Kind = Literal["data-bound", "memory-bound", "sync-bound", "host-bound", "device-bound"]
#: the classes in their precedence: where several rules hold, the first is the step's
KINDS: tuple[str, ...] = ("data-bound", "memory-bound", "sync-bound", "host-bound", "device-bound")
#: the categories of device work (or, on a CPU, of its ops): every category but the two host-side ones
DEVICE_CATEGORIES: tuple[str, ...] = tuple(c for c in CATEGORIES if c not in ("data_wait", "host_idle"))


@dataclass
class Diagnosis:
    """What sets a step's pace, with the figures that show it (ms per optimizer step)."""

    kind: Kind
    device: str  # "cuda" | "cpu"
    step_ms: float  # the baseline's timed step (median of its windows)
    data_wait_ms: float | None = None  # the step waiting for its batch (the timed one's, else the profile's)
    host_ms: float | None = None  # the host's time issuing the step (the timed one's)
    device_busy_fraction: float | None = None  # the profile's: device busy / window (None on a CPU, or unprofiled)
    util_percent: float | None = None  # NVML's mean utilization over the baseline's windows (None without it)
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # the profile's, by CATEGORIES ({} unprofiled)
    profile_step_ms: float | None = None  # the profiled step's wall time (the profiler lengthens it)
    #: {"where", "code", "count"} per synchronizing line; [] where looked for and none found, None not looked for
    syncs: list[dict[str, Any]] | None = None
    peak_memory_bytes: int | None = None
    memory_capacity_bytes: int | None = None
    noise: float | None = None  # the baseline's window spread (robust relative std)
    top_categories: list[dict[str, Any]] = field(default_factory=list)  # {"category", "share"}, largest first
    rule: str = ""  # the rule that gave the class, with its figures
    also: list[str] = field(default_factory=list)  # the other classes whose rules held, in precedence
    thresholds: dict[str, float] = field(default_factory=dict)  # those the rules used

    @property
    def sync_count(self) -> int:
        """Host syncs per step (0 where none were found or none looked for)."""
        return sum(int(s.get("count", 1)) for s in self.syncs or ())

    def shares(self) -> dict[str, float]:
        """The share of the step (0..1) each target a rung can cut takes, for those the figures show:
        ``data_wait``; with a profile each device category, ``host`` (on a GPU the device's idle time
        behind the host; on a CPU the step's time outside its ops) and ``syncs`` (the idle time they
        cause at most: all of it; 0 where none were found). Memory is not a share of the step: not here.

        Each share is an upper estimate, for bounding gains: a profile's figures are taken against the
        shorter of the timed and the profiled step (the profiler lengthens the step with its own cost,
        and a share of a lengthened step would understate what a rung can remove)."""
        out: dict[str, float] = {}
        if self.data_wait_ms is not None and self.step_ms > 0:
            out["data_wait"] = _fraction(self.data_wait_ms / self.step_ms)
        if self.breakdown_ms and self.profile_step_ms:
            step = min(self.step_ms, self.profile_step_ms) if self.step_ms > 0 else self.profile_step_ms
            for category in DEVICE_CATEGORIES:
                out[category] = _fraction(self.breakdown_ms.get(category, 0.0) / step)
            if self.device == "cuda":
                host = self.breakdown_ms.get("host_idle", 0.0)
            else:  # the profiled step less its ops and its data wait: the interpreter, the loop, the collector
                ops = sum(self.breakdown_ms.get(c, 0.0) for c in DEVICE_CATEGORIES)
                host = self.profile_step_ms - ops - self.breakdown_ms.get("data_wait", 0.0)
            out["host"] = _fraction(host / step)
            out.setdefault("data_wait", _fraction(self.breakdown_ms.get("data_wait", 0.0) / step))
        if self.syncs is not None:
            if self.sync_count == 0:
                out["syncs"] = 0.0
            elif "host" in out and self.device == "cuda":
                out["syncs"] = out["host"]  # the syncs cost at most the device's idle time behind the host
        return out

    def summary(self) -> str:
        """One line with the class and its figures, for the console and the top of the report."""
        step = self.step_ms
        if self.kind == "data-bound":
            wait = self.data_wait_ms or 0.0
            return f"data-bound: {wait:.1f} of {step:.1f} ms per step waiting for batches ({percent(wait / step)})"
        if self.kind == "memory-bound":
            peak, capacity = self.peak_memory_bytes or 0, self.memory_capacity_bytes or 1
            return f"memory-bound: peak {peak / 1e9:.1f} of {capacity / 1e9:.1f} GB of device memory ({percent(peak / capacity)})"
        if self.kind == "sync-bound":
            idle, busy = self._idle_and_busy()
            lines = self.syncs or [{"where": "?"}]
            others = len(lines) - 1
            more = f" and {others} other line{'s' if others > 1 else ''}" if others else ""
            count = self.sync_count
            return (
                f"sync-bound: {count} host sync{'s' if count != 1 else ''} per step ({lines[0]['where']}{more}); "
                f"the GPU idle {percent(idle)} and busy {percent(busy)} of the {step:.1f} ms step"
            )
        if self.kind == "host-bound":
            _, busy = self._idle_and_busy()
            pace = f", the GPU busy {percent(busy)}" if busy is not None else ""
            return f"host-bound: {self.host_ms or 0.0:.1f} of {step:.1f} ms per step issuing work{pace}"
        where = "device-bound" if self.device == "cuda" else "device-bound (the CPU's ops)"
        if not self.top_categories:
            return f"{where}: {step:.1f} ms per step (no profile: its categories are not known)"
        named = ", ".join(f"{CATEGORY_LABELS[t['category']]} {percent(t['share'])}" for t in self.top_categories)
        return f"{where}: {named}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the fields, and the summary line."""
        data = asdict(self)
        data["summary"] = self.summary()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Diagnosis:
        """The diagnosis :meth:`to_dict` wrote (fields it lacks take their defaults; the summary is made anew)."""
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def _idle_and_busy(self) -> tuple[float | None, float | None]:
        """The device's idle-behind-the-host and busy shares of the step: the profile's, else NVML's."""
        return _idle_and_busy(self)


def diagnose(
    measurement: Measurement,
    profile: ProfileWindow | None = None,
    syncs: list[dict[str, Any]] | None = None,
    memory_capacity_bytes: int | None = None,
    thresholds: Mapping[str, float] | None = None,
) -> Diagnosis:
    """Diagnose the step timed in ``measurement`` (the baseline's), with ``profile`` (a short profile
    window of the same step), ``syncs`` (its host syncs; ``[]``: looked for, none) and the device's
    memory capacity where known. ``thresholds`` override those of ``diagnosis:`` in the defaults.

    Raises:
        ConfigError: a threshold that is not one of the defaults'.
    """
    limits = _thresholds(thresholds)
    m = measurement
    device = "cuda" if m.clock == "cuda_events" or (profile is not None and profile.device == "cuda") else "cpu"
    data_wait = m.data_wait_ms
    if data_wait is None and profile is not None:
        data_wait = float(profile.breakdown_ms.get("data_wait", 0.0))  # host time: the profiler adds little to it
    peaks = [p for p in (m.peak_memory_bytes, profile.peak_memory_bytes if profile is not None else None) if p is not None]
    found = Diagnosis(
        kind="device-bound",
        device=device,
        step_ms=float(m.step_ms),
        data_wait_ms=data_wait,
        host_ms=m.host_ms,
        device_busy_fraction=profile.device_busy_fraction if profile is not None else None,
        util_percent=(m.telemetry or {}).get("util_mean"),
        breakdown_ms={c: float(profile.breakdown_ms.get(c, 0.0)) for c in CATEGORIES} if profile is not None else {},
        profile_step_ms=float(profile.step_ms) if profile is not None else None,
        syncs=[{"where": s["where"], "code": s.get("code", ""), "count": int(s.get("count", 1))} for s in syncs]
        if syncs is not None
        else None,
        peak_memory_bytes=max(peaks) if peaks else None,
        memory_capacity_bytes=memory_capacity_bytes,
        noise=m.spread,
        thresholds=limits,
    )
    found.top_categories = _top_categories(found, limits)
    held = [(kind, why) for kind, why in _rules(found, m, limits) if why is not None]
    found.kind, found.rule = held[0]  # type: ignore[assignment]  # device-bound always holds
    found.also = [kind for kind, _ in held[1:] if kind != "device-bound"]
    return found


# -- the rules, in precedence ---------------------------------------------------------------------------


def _rules(d: Diagnosis, m: Measurement, limits: Mapping[str, float]) -> list[tuple[str, str | None]]:
    """Each class with the reason its rule holds (None where it does not), in precedence."""
    return [
        ("data-bound", _data_bound(d, limits)),
        ("memory-bound", _memory_bound(d, limits)),
        ("sync-bound", _sync_bound(d, limits)),
        ("host-bound", _host_bound(d, m, limits)),
        ("device-bound", _device_bound(d)),
    ]


def _data_bound(d: Diagnosis, limits: Mapping[str, float]) -> str | None:
    if d.data_wait_ms is None or d.step_ms <= 0:
        return None
    share = d.data_wait_ms / d.step_ms
    if share < limits["data_bound_share"]:
        return None
    return f"waiting for batches {d.data_wait_ms:.1f} of {d.step_ms:.1f} ms per step ({percent(share)}; data-bound from {percent(limits['data_bound_share'])})"


def _memory_bound(d: Diagnosis, limits: Mapping[str, float]) -> str | None:
    if d.device != "cuda" or not d.peak_memory_bytes or not d.memory_capacity_bytes:
        return None
    share = d.peak_memory_bytes / d.memory_capacity_bytes
    if share < limits["memory_bound_share"]:
        return None
    return f"peak memory {percent(share)} of the device's (memory-bound from {percent(limits['memory_bound_share'])})"


def _sync_bound(d: Diagnosis, limits: Mapping[str, float]) -> str | None:
    if d.device != "cuda" or d.sync_count == 0:
        return None
    idle, busy = _idle_and_busy(d)
    floor = limits["sync_share"]
    if idle is None or busy is None or idle < floor or busy < floor:
        return None
    return (
        f"{d.sync_count} host sync(s) per step, the device idle behind the host {percent(idle)} and busy {percent(busy)} "
        f"of the step (sync-bound where both are {percent(floor)} or more)"
    )


def _host_bound(d: Diagnosis, m: Measurement, limits: Mapping[str, float]) -> str | None:
    if d.device != "cuda":
        return None
    if d.device_busy_fraction is not None:
        # the profile's busy fraction rather than NVML's utilization, which counts a sample busy where any
        # kernel ran in it
        m = replace(m, telemetry={**(m.telemetry or {}), "util_mean": 100.0 * d.device_busy_fraction})
    if not host_bound(m, limits["host_bound_share"], 100.0 * limits["busy_fraction"]):
        return None
    _, busy = _idle_and_busy(d)
    seen = f", the device busy {percent(busy)}" if busy is not None else ""
    return (
        f"the host issuing the step {d.host_ms:.1f} of {d.step_ms:.1f} ms{seen} (host-bound from "
        f"{percent(limits['host_bound_share'])} of the step with the device busy under {percent(limits['busy_fraction'])})"
    )


def _device_bound(d: Diagnosis) -> str:
    if not d.top_categories:
        return "no other rule held (no profile: the device's categories are not known)"
    named = ", ".join(f"{t['category']} {percent(t['share'])}" for t in d.top_categories)
    return f"no other rule held; the largest device categories: {named}"


# -- figures ----------------------------------------------------------------------------------------------


def _idle_and_busy(d: Diagnosis) -> tuple[float | None, float | None]:
    """The device's share of the step idle behind the host, and busy: the profile's window where there
    is one (both against the profiled step), else NVML's utilization (its complement as the idle share,
    less any data wait); (None, None) on a CPU or without either."""
    if d.device != "cuda":
        return None, None
    if d.breakdown_ms and d.profile_step_ms and d.device_busy_fraction is not None:
        return _fraction(d.breakdown_ms.get("host_idle", 0.0) / d.profile_step_ms), d.device_busy_fraction
    if d.util_percent is not None:
        busy = _fraction(d.util_percent / 100.0)
        wait = (d.data_wait_ms or 0.0) / d.step_ms if d.step_ms > 0 else 0.0
        return _fraction(1.0 - busy - wait), busy
    return None, None


def _top_categories(d: Diagnosis, limits: Mapping[str, float]) -> list[dict[str, Any]]:
    """The largest device categories with their shares of the step: those of ``top_share`` or more, at
    most ``top_count``; the largest alone where none reaches ``top_share`` ([] unprofiled)."""
    shares = d.shares()
    ranked = sorted(((c, shares[c]) for c in DEVICE_CATEGORIES if shares.get(c, 0.0) > 0), key=lambda item: item[1], reverse=True)
    top = [(c, s) for c, s in ranked if s >= limits["top_share"]][: int(limits["top_count"])] or ranked[:1]
    return [{"category": c, "share": s} for c, s in top]


def _thresholds(given: Mapping[str, float] | None) -> dict[str, float]:
    limits = {k: float(v) for k, v in config.diagnosis_thresholds().items()}
    for key, value in (given or {}).items():
        if key not in limits:
            raise ConfigError(f"diagnosis.{key}", f"unknown threshold; the known ones: {', '.join(sorted(limits))}")
        limits[key] = float(value)
    return limits


def _fraction(x: float) -> float:
    return 0.0 if not math.isfinite(x) else min(1.0, max(0.0, x))


def percent(share: float | None) -> str:
    """A share as the report writes it: whole percents, one decimal under 1% ("0.4%")."""
    if share is None:
        return "?"
    return f"{share:.1%}" if 0 < share < 0.01 else f"{share:.0%}"
