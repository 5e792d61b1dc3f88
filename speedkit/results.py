"""What a ladder run produces: plain dataclasses, turned into the report's JSON by ``to_dict``.

The JSON schema (``SCHEMA_VERSION``) is documented field by field in ``speedkit/report/__init__.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

SCHEMA_VERSION = 4

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
    comparison: PairedResult | None = None  # its last comparison (raw: its figure is the account's, ``figures``)
    seconds: float = 0.0  # wall time spent trying this rung (compile included)
    #: what a source-rewriting rung rewrote and left alone (``RewriteReport.as_dict``); None for other rungs
    rewrite: dict[str, Any] | None = None


def comparison_figure(paired: PairedResult, power: int = 1, label: str = "") -> dict[str, Any]:
    """What a decision records of a paired comparison: its speedup (B over A), interval, blocks and
    verdict; ``power`` -1 where it measured the opposite direction of the figure it enters (a member
    left out of its group: the group without it over the group)."""
    return {
        "speedup": paired.speedup,
        "low": paired.low,
        "high": paired.high,
        "confidence": paired.confidence,
        "blocks": paired.blocks,
        "verdict": paired.verdict,
        "min_gain": paired.min_gain,
        "power": power,
        "label": label,
    }


@dataclass
class Decision:
    """One decision of the trials, as recorded in the ledger (``LadderResult.ledger``): appended, never
    edited. ``names`` were kept (``kept``) or dropped together by ``phase``; ``comparisons`` (each
    :func:`comparison_figure`) are the paired comparisons whose product is their figure, none where the
    decision stands on an earlier one's (a member that stays within its group) or was not timed; ``why``
    says it in a line. :func:`speedkit.figures.account.account` derives every printed figure from these."""

    phase: str
    names: list[str]
    kept: bool
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    why: str = ""


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
    #: every decision of the trials, in the order taken (:class:`Decision`): what the figures are derived from
    ledger: list[Decision] = field(default_factory=list)
    #: the kept rungs in the final configuration's order (bottom first)
    final_order: list[str] = field(default_factory=list)
    #: the user's switches kept as the floor every other rung was judged on (empty: no floor)
    floor: list[str] = field(default_factory=list)
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
        """The row of the user's switches (None: the ladder had none)."""
        return next((r for r in self.rungs if r.status == "switches"), None)

    def decide(self, phase: str, names: Any, kept: bool, comparisons: list[dict[str, Any]] | None = None, why: str = "") -> None:
        """Append a decision to the ledger (:class:`Decision`)."""
        self.ledger.append(Decision(phase, list(names), kept, list(comparisons or []), why))

    def figures(self) -> dict[str, Any]:
        """Every figure of the run, from the ledger (:func:`speedkit.figures.account.account`)."""
        from speedkit.figures.account import account

        return account(dataclasses.asdict(self))

    @property
    def attribution(self) -> dict[str, Any] | None:
        """What each kept rung bought, from the profile windows at the chain's figures (the account's)."""
        return self.figures().get("attribution")

    def vs_switches(self) -> tuple[float, float | None, float | None] | None:
        """The final configuration's speedup over the user's switches and its interval, from the chain (None
        where the floor was not kept, or nothing went on top of it)."""
        v = self.figures()["vs_switches"]
        return (v["speedup"], v["low"], v["high"]) if v and v.get("speedup") is not None else None

    @property
    def final(self) -> RungResult:
        """The last kept rung's row (the baseline's where none was kept)."""
        kept = {r.name: r for r in self.kept}
        for name in reversed(self.final_order):
            if name in kept:
                return kept[name]
        return self.kept[-1] if self.kept else self.baseline

    @property
    def final_measurement(self) -> Measurement | None:
        """The ladder's figure for the final configuration: the account's step time (the baseline's over
        the headline's: the final check's where one was made, else the chain's product), with the host's split of it (data wait, host time) and the peak memory from
        its measured windows (the final check's where there was one, else its last kept rung's)."""
        base = self.baseline.measurement
        if base is None:
            return None
        if not self.kept:
            return base
        measured = self.final_check.b if self.final_check is not None and self.final_check.b is not None else None
        measured = measured or self.final.measurement or base
        headline = self.figures()["headline"]
        step = headline.get("step_ms")
        if not step:
            return measured
        return dataclasses.replace(
            measured,
            step_ms=step,
            throughput=headline.get("throughput") or measured.throughput,
            mfu=headline.get("mfu"),
            items_per_step=base.items_per_step,
            throughput_unit=base.throughput_unit,
        )

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON: the record, and the figures derived from it (``figures``, ``summary`` and
        ``attribution``, all :func:`speedkit.figures.account.account`'s; each row's ``figure`` its one figure)."""
        from speedkit.figures.account import account

        d = dataclasses.asdict(self)
        figures = d["figures"] = account(d)
        d["attribution"] = figures.get("attribution")
        for row in d["rungs"]:
            f = figures["rungs"].get(row["name"]) if row["status"] in ("kept", "reverted", "failed", "skipped") else None
            row["figure"] = f["text"] if f else None
        base, head, versus, check = figures["baseline"], figures["headline"], figures["vs_switches"], figures["check"]
        d["summary"] = {
            "baseline_step_ms": base["step_ms"],
            "final_step_ms": head["step_ms"],
            "speedup": head["speedup"],
            "speedup_ci": [head["low"], head["high"]] if head["low"] is not None else None,
            "shown": head["shown"],
            "kept": list(self.final_order) or [r.name for r in self.kept],
            "throughput_unit": figures["unit"],
            "baseline_throughput": base["throughput"],
            "final_throughput": head["throughput"],
            "figures_from": head["from"],
            "vs_switches": [versus["speedup"], versus["low"], versus["high"]] if versus else None,
            "switches_are_final": figures["switches_are_final"],
            "check": check,
            "interrupted": self.interrupted,
        }
        return d
