"""What a ladder run produces: plain dataclasses, turned into the report's JSON by ``to_dict``.

The JSON schema (``SCHEMA_VERSION``) is documented field by field in ``speedkit/report/__init__.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

SCHEMA_VERSION = 3
#: how far the headline's paired speedup and the ratio of its two median step times may differ
#: before the headline says so (their windows are the same; they differ only through noise)
HEADLINE_AGREEMENT = 0.03

#: "closing": the final configuration re-measured after the rungs changed it: by the closing check,
#: which reverted a kept rung that no longer paid with the later rungs on top of it, or by a second
#: look, which kept a rung beneath them that was undecided on its own; "interrupted": the rung the
#: ladder was trying when it was interrupted (undone)
Status = Literal["baseline", "kept", "reverted", "not_applicable", "skipped", "failed", "closing", "interrupted", "switches"]


@dataclass
class Measurement:
    """Timing of one configuration: windows of ``steps`` optimizer steps after ``warmup`` steps."""

    step_ms: float  # median over windows of the mean step time in a window
    spread: float  # noise: 1.4826 * MAD / median of the window means (robust relative std)
    window_ms: list[float]  # each window's mean step time
    warmup: int
    steps: int
    throughput: float  # units per second at the median step time
    throughput_unit: str  # "tokens/s" or "samples/s"
    items_per_step: int  # tokens or samples per optimizer step
    mfu: float | None = None  # model FLOPs utilization, 0..1 (None without a known peak)
    tflops: float | None = None  # achieved model TFLOP/s
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated over the timed steps
    telemetry: dict[str, Any] | None = None  # NVML summary over the timed windows (None without a GPU)
    clock: str = "perf_counter"  # "cuda_events" or "perf_counter"
    data_wait_ms: float | None = (
        None  # median per-step host time between steps: the next batch (fetch, collate, copy) and, in Lightning's loop, its per-batch bookkeeping
    )
    host_ms: float | None = None  # median per-step host time issuing the step
    #: under DDP: each rank's medians (rank, step_ms, data_wait_ms, host_ms, peak_memory_bytes); the
    #: figures above are the slowest rank's, and throughput counts every rank's items
    ranks: list[dict[str, Any]] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        """A measurement from its fields (``dataclasses.asdict``: a decision cache's entry); unknown keys ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Parity:
    """Loss trajectory of a rung against the state before it, same weights, batches and RNG."""

    steps: int
    tolerance: float
    precision: str  # the numerics class whose tolerance was used
    reference_losses: list[float]
    losses: list[float]
    max_rel_diff: float
    passed: bool
    #: per step, the tolerance the step was judged against (the calibrated envelope of the numerics in effect)
    envelope: list[float] | None = None


@dataclass
class PairedResult:
    """Candidate (B) against the configuration before it (A), timed in interleaved A B B A blocks."""

    speedup: float  # B over A, exp of the mean per-block log ratio
    low: float  # confidence interval of the speedup
    high: float
    confidence: float
    blocks: int
    verdict: str  # "faster", "not_faster" or "undecided"
    min_gain: float
    a: Measurement | None = None  # A's windows in this comparison
    b: Measurement | None = None  # B's windows in this comparison
    seconds: float = 0.0
    #: the blocks its design planned for its final look (sized from the diagnosed noise; None: not recorded)
    planned_blocks: int | None = None
    #: its final look came before the planned blocks: the next block would have overrun its budget
    stopped_by_budget: bool = False
    #: where it was measured, when not in this run: the fit that made a cached decision (its key and date)
    measured_in: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PairedResult:
        """A paired result from its fields (``dataclasses.asdict``: a decision cache's entry); unknown keys ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        for side in ("a", "b"):
            if isinstance(fields.get(side), dict):
                fields[side] = Measurement.from_dict(fields[side])
        return cls(**fields)


@dataclass
class RungResult:
    name: str
    status: Status
    options: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None  # why not applicable / reverted / failed; why kept
    changes: list[str] = field(default_factory=list)
    precision: str = "fp32"  # effective numerics with this rung applied
    measurement: Measurement | None = None  # this configuration (B's windows of its comparison)
    parity: Parity | None = None
    comparison: PairedResult | None = None
    gain_vs_previous: float | None = None  # paired speedup over the configuration before it
    gain_vs_baseline: float | None = None  # product of the paired speedups of the kept rungs up to here
    seconds: float = 0.0  # wall time spent trying this rung (compile included)
    #: what a source-rewriting rung rewrote and left alone (``RewriteReport.as_dict``); None for other rungs
    rewrite: dict[str, Any] | None = None


@dataclass
class Holds:
    """Does the ladder's figure hold in training? The final configuration in the ladder against the
    steps of the fit that followed, same Trainer and loader."""

    ladder: Measurement | None
    fit: Measurement | None
    gap: float | None  # fit step time / ladder step time - 1
    flagged: bool  # gap above the threshold
    threshold: float
    cause: str | None  # the likely cause of a flagged gap
    note: str | None = None  # why it was not measured, where it was not
    between_ms: dict[str, float] = field(default_factory=dict)  # ms/step of each Lightning action between the fit's steps


@dataclass
class LadderResult:
    schema_version: int
    recipe: str | None
    environment: dict[str, Any]
    device: str
    flops: dict[str, Any]  # {"per_step": int|None, "convention": str, "peak_tflops": float|None, "peak_source": str}
    measure: dict[str, Any]  # the measurement settings used
    rungs: list[RungResult]  # the baseline first, then one entry per ladder rung, in order
    title: str | None = None  # the report's heading (recipe report.title)
    run: dict[str, Any] = field(default_factory=dict)  # the run's settings: precision, accumulation, clipping...
    final_check: PairedResult | None = None  # the final configuration against the baseline, interleaved
    holds: Holds | None = None
    interrupted: str | None = None  # None, or what was interrupted ("KeyboardInterrupt during sdpa")
    #: per precision: epsilon, seeds, envelope (per step, the worst relative loss move so far under that
    #: rounding), sensitivity (its worst), safety, floor, tolerance, per_step (tolerance per step), kernels
    parity_calibration: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: where the step's time goes: torch.profiler windows of the baseline, of each kept rung added in
    #: the final order and of the final configuration, and host syncs (speedkit.profile); None: not profiled
    profile: dict[str, Any] | None = None
    #: each kept rung's share of the total and the categories it moved (speedkit.engine.attribution)
    attribution: dict[str, Any] | None = None
    #: NVML samples over the profile windows (utilization, power against its limit, SM clock, reasons)
    telemetry_timeline: dict[str, Any] | None = None
    #: SpeedProfiler's figures of the fit so far, where one watched it (speedkit.measure.monitor)
    fit_monitor: dict[str, Any] | None = None

    @property
    def baseline(self) -> RungResult:
        return self.rungs[0] if self.rungs else RungResult("baseline", "baseline")

    @property
    def kept(self) -> list[RungResult]:
        return [r for r in self.rungs if r.status == "kept"]

    @property
    def switches(self) -> RungResult | None:
        """The user's switches measured against the final configuration (None: not measured)."""
        return next((r for r in self.rungs if r.status == "switches"), None)

    def vs_switches(self) -> tuple[float, float, float] | None:
        """The final configuration's speedup over the switches and its interval, from their paired
        comparison (A the switches, B the final configuration; None where the switches were not timed
        against it)."""
        row = self.switches
        if row is None:
            return None
        if row.comparison is None:  # the final configuration is the switches, or they were not timed
            return (1.0, 1.0, 1.0) if row.gain_vs_previous == 1.0 else None
        c = row.comparison
        return c.speedup, c.low, c.high

    @property
    def final(self) -> RungResult:
        """The configuration that stayed: the closing check's re-measurement if it changed it, else
        the last kept rung, else the baseline."""
        for r in reversed(self.rungs):
            if r.status in ("kept", "closing"):
                return r
        return self.baseline

    @property
    def final_measurement(self) -> Measurement | None:
        """The ladder's figure for the final configuration: its windows in the final check when
        there was one, else its last comparison's."""
        if self.final_check is not None and self.final_check.b is not None:
            return self.final_check.b
        return self.final.measurement

    def headline(self) -> tuple[Measurement | None, Measurement | None, float, str, str | None]:
        """The run's headline: the baseline's and the final configuration's measurements, the speedup,
        where they come from, and a note where they disagree.

        With a final check, all three come from it: the baseline's and the final configuration's
        windows of the same interleaved blocks, and the paired speedup over those blocks, so the
        throughputs, step times and speedup describe one measurement (the baseline timed alone at the
        start, minutes earlier, is the table's first row, not the headline's). Where the ratio of the
        two median step times and the paired speedup still differ by more than
        :data:`HEADLINE_AGREEMENT`, the note says so: the windows varied or drifted within the blocks."""
        check = self.final_check
        if check is not None and check.a is not None and check.b is not None:
            base, final, speedup, source = check.a, check.b, check.speedup, "the final check (interleaved A B B A blocks)"
            if check.measured_in:
                source = f"the final check of {check.measured_in} (interleaved A B B A blocks)"
        else:
            base, final = self.baseline.measurement, self.final_measurement
            speedup = self.final.gain_vs_baseline or 1.0
            source = (
                "the baseline timed alone and the kept rungs' comparisons (no final check)"
                if self.kept
                else "the baseline timed alone"
            )
            if not self.kept:
                final = base
            elif (self.run.get("cache") or {}).get("held"):  # a re-checked decision: that fit's figures
                source = f"the fit that made the cached decision: {source}"
        note = None
        if base is not None and final is not None and final.step_ms > 0 and speedup > 0:
            ratio = base.step_ms / final.step_ms
            if abs(math.log(ratio / speedup)) > math.log1p(HEADLINE_AGREEMENT):
                note = (
                    f"the paired speedup ({speedup:.2f}x, per block) and the ratio of the median step times "
                    f"({ratio:.2f}x) differ by more than {HEADLINE_AGREEMENT:.0%}: the step time varied or drifted "
                    "while they were timed; the paired figure is the one decisions use"
                )
        return base, final, speedup, source, note

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        base, final, speedup, source, note = self.headline()
        switches, versus = self.switches, self.vs_switches()
        d["summary"] = {
            "baseline_step_ms": base.step_ms if base else None,
            "final_step_ms": final.step_ms if final else None,
            "speedup": speedup,
            "speedup_ci": [self.final_check.low, self.final_check.high] if self.final_check is not None else None,
            "kept": [r.name for r in self.kept],
            "throughput_unit": base.throughput_unit if base else None,
            "baseline_throughput": base.throughput if base else None,
            "final_throughput": final.throughput if final else None,
            "figures_from": source,
            "note": note,
            "vs_switches": list(versus) if versus else None,
            "switches_throughput": switches.measurement.throughput if switches is not None and switches.measurement else None,
            "interrupted": self.interrupted,
        }
        return d
