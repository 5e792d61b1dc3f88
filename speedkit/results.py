"""What a ladder run produces: plain dataclasses, turned into the report's JSON by ``to_dict``.

The JSON schema (``SCHEMA_VERSION``) is documented field by field in ``speedkit/report/__init__.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

SCHEMA_VERSION = 1

#: "closing": the final configuration re-measured by the ladder's closing check after it reverted a
#: kept rung that no longer paid with the later rungs on top of it
Status = Literal["baseline", "kept", "reverted", "not_applicable", "failed", "closing"]


@dataclass
class Measurement:
    """Timing of one configuration: ``repeats`` windows of ``steps`` steps after ``warmup`` steps."""

    step_ms: float                     # median over windows of the mean step time in a window
    spread: float                      # noise: 1.4826 * MAD / median of the window means (robust relative std)
    window_ms: list[float]             # each window's mean step time
    warmup: int
    steps: int
    throughput: float                  # units per second at the median step time
    throughput_unit: str               # "tokens/s" or "samples/s"
    items_per_step: int                # tokens or samples per step
    mfu: float | None = None           # model FLOPs utilization, 0..1 (None without a known peak)
    tflops: float | None = None        # achieved model TFLOP/s
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated over the timed steps
    telemetry: dict[str, Any] | None = None  # NVML summary over the timed windows (None without a GPU)
    clock: str = "perf_counter"        # "cuda_events" or "perf_counter"


@dataclass
class Parity:
    """Loss trajectory of a rung against the state before it, same weights, batches and RNG."""

    steps: int
    tolerance: float
    precision: str                     # the numerics class whose tolerance was used
    reference_losses: list[float]
    losses: list[float]
    max_rel_diff: float
    passed: bool


@dataclass
class RungResult:
    name: str
    status: Status
    options: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None          # why not applicable / reverted / failed; why kept
    changes: list[str] = field(default_factory=list)
    precision: str = "fp32"            # effective numerics with this rung applied
    measurement: Measurement | None = None
    parity: Parity | None = None
    gain_vs_previous: float | None = None  # previous kept step time / this step time
    gain_vs_baseline: float | None = None  # baseline step time / this step time
    seconds: float = 0.0               # wall time spent trying this rung (compile included)


@dataclass
class LadderResult:
    schema_version: int
    recipe: str | None
    environment: dict[str, Any]
    device: str
    flops: dict[str, Any]              # {"per_step": int|None, "convention": str, "peak_tflops": float|None, "peak_source": str}
    measure: dict[str, Any]            # the measurement settings used
    rungs: list[RungResult]            # the baseline first, then one entry per ladder rung, in order
    title: str | None = None           # the report's heading (recipe report.title)

    @property
    def baseline(self) -> RungResult:
        return self.rungs[0]

    @property
    def kept(self) -> list[RungResult]:
        return [r for r in self.rungs if r.status == "kept"]

    @property
    def final(self) -> RungResult:
        """The configuration that stayed: the closing check's re-measurement if it changed it, else
        the last kept rung, else the baseline."""
        for r in reversed(self.rungs):
            if r.status in ("kept", "closing"):
                return r
        return self.baseline

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        final = self.final
        d["summary"] = {
            "baseline_step_ms": self.baseline.measurement.step_ms if self.baseline.measurement else None,
            "final_step_ms": final.measurement.step_ms if final.measurement else None,
            "speedup": final.gain_vs_baseline if final is not self.baseline else 1.0,
            "kept": [r.name for r in self.kept],
            "throughput_unit": self.baseline.measurement.throughput_unit if self.baseline.measurement else None,
            "baseline_throughput": self.baseline.measurement.throughput if self.baseline.measurement else None,
            "final_throughput": final.measurement.throughput if final.measurement else None,
        }
        return d
