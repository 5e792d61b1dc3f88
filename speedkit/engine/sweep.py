"""The batch-size sweep: the micro-batch of highest measured throughput, not the largest that fits.

:func:`sweep` asks a ``measure(size)`` function (a short timed run at that micro-batch; it reports
throughput, peak memory, or an out-of-memory error) for as few sizes as it can:

1. **grow** geometrically from the user's size (the next candidate four times as large at first and
   while each step gains half again or more, then twice) while
   the run fits, with ``margin`` of the device's memory left free (later steps add optimizer state,
   autotuning workspaces, compile and CUDA-graph pools), and throughput rises by ``min_gain`` or
   more; the first size that fails, leaves less than the margin, or is not faster ends the growth
   (one step down is tried when the user's own size was already past the best);
2. **refine** between the best size and its measured neighbours (the first worse or failed size
   above, the last one below): the candidate nearest their geometric mean, while one lies strictly
   between and the trial budget (``max_trials``) lasts.

Candidates keep the user's effective batch by default: the micro-batch divides it and gradient
accumulation makes up the rest (``effective``), so the optimizer sees the same batch and needs no
new learning rate. Without ``effective`` they are the user's size times powers of two, up to
``max_size``, with the sizes between them for refinement. The chosen size is the fastest that fit
(ties to the smaller: less memory) where it is shown faster than the user's, else the user's.
:class:`SweepResult` holds every trial as a table row and a plot-ready series for the report.

**Checkpointed where it must be.** With :func:`checkpointing_where_needed` a size that does not fit is
measured again with the model's repeated blocks checkpointed (the activation_checkpointing rung),
and the larger sizes after it so: the memory checkpointing frees is judged by the micro-batch it
lets fit and that size's throughput, against the fastest size without it.

**Decided, or yours.** A size other than the user's is chosen only where it is *shown* faster by
``min_gain`` (:func:`compare_sizes`): the fastest size the search measured is compared with the
user's from their timed windows' throughputs (one-sided Welch t-test on their logarithms at
``CONFIDENCE``), the user's size measured a second time after the search so that its two
measurements bracket the others in time (a host whose load drifts, a first fit of the process, do
not decide alone). Undecided goes to the user's size, and the result says so; a trial without two
windows' figures cannot show a gain. Each trial's windows come after its compile and warm-up
(the measure function's part: ``speedkit.frontend.sweep_runner.SettledStepTimer``).

This module measures nothing itself: ``speedkit sweep`` (``speedkit.frontend.sweep_runner.sweep_recipe``) gives it a
measure function that fits the recipe at each size with speedkit's step clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from speedkit.errors import ConfigError
from speedkit.measure.clock import summarize
from speedkit.measure.stats import one_sided_alpha, t_quantile

#: defaults of the sweep (also ``speedkit sweep``'s)
MARGIN = 0.10
MIN_GAIN = 0.02
MAX_TRIALS = 8
MAX_SIZE = 4096
#: two-sided confidence of the comparison of the chosen size with the user's
CONFIDENCE = 0.95


@dataclass(frozen=True)
class SweepTrial:
    """One size measured."""

    size: int  # samples per micro-batch
    accumulate: int  # micro-batches per optimizer step
    throughput: float | None  # items per second (None: it did not run)
    unit: str  # "tokens/s" or "samples/s"
    peak_memory_bytes: int | None  # the device's peak in the timed steps (None on a CPU)
    fits: bool  # ran, with the memory margin left free
    reason: str = ""  # why it does not fit ("out of memory: ...", "leaves 4% free, under the 10% margin")
    seconds: float = 0.0  # wall time of the trial
    optimizer: str = ""  # the optimizer's class, as the trial's fit built it (for the learning-rate rule)
    input: str = ""  # what the trial was fed (the loader's batches, or the worst-case input)
    #: each timed window's throughput (items per second); ``throughput`` is their median
    window_rates: tuple[float, ...] = ()
    #: optimizer steps run before the first timed window: those that compiled (each starts the
    #: warm-up again) and the warm-up after the last of them
    untimed_steps: int = 0
    compiled_steps: int = 0  # optimizer steps in which torch.compile compiled a graph (none of them timed)
    measured: int = 1  # times this size was measured (the user's: twice where a size is compared with it)
    #: measured with the model's repeated blocks checkpointed (activation_checkpointing): the size did
    #: not fit without (:func:`checkpointing_where_needed`)
    checkpointed: bool = False
    #: it does not fit for want of device memory: it ran out, or left less than the margin free
    short_of_memory: bool = False

    @property
    def spread(self) -> float | None:
        """The windows' noise: robust relative standard deviation (None under two windows)."""
        return summarize(self.window_rates)[1] if len(self.window_rates) >= 2 else None


@dataclass(frozen=True)
class SizeComparison:
    """A size's throughput over the user's, from both sizes' timed windows (:func:`compare_sizes`)."""

    size: int
    speedup: float  # exp(mean log rate of the size - that of the user's size): > 1 faster
    low: float  # the interval's ends, at ``confidence``
    high: float
    confidence: float
    verdict: str  # "faster" (by min_gain), "not_faster", or "undecided"
    min_gain: float
    windows: tuple[int, int]  # windows of the user's size, of this size

    def line(self) -> str:
        ci = f"{self.speedup:.3f}x yours, {self.confidence:.0%} CI [{self.low:.3f}, {self.high:.3f}] over {self.windows[0]}+{self.windows[1]} windows"
        if self.verdict == "faster":
            return f"micro-batch {self.size}: {ci}: faster by more than the {1 + self.min_gain:.2f}x minimum"
        if self.verdict == "not_faster":
            return f"micro-batch {self.size}: {ci}: not faster by the {1 + self.min_gain:.2f}x minimum; yours stays"
        return f"micro-batch {self.size}: {ci}: undecided (not shown faster by the {1 + self.min_gain:.2f}x minimum); yours stays"


def compare_sizes(
    yours: SweepTrial, other: SweepTrial, *, min_gain: float = MIN_GAIN, confidence: float = CONFIDENCE
) -> SizeComparison:
    """Whether ``other`` is faster than ``yours`` by ``min_gain``: a one-sided Welch t-test on the log
    window throughputs (error ``(1 - confidence) / 2``; the interval is two-sided at ``confidence``).
    Each size is its own fit, so the windows are compared unpaired; under two windows on either side
    nothing is known of the noise and the verdict is undecided. Windows with the same figure (a
    stand-in measure) give a zero-width interval."""
    a = [math.log(r) for r in yours.window_rates if r > 0]
    b = [math.log(r) for r in other.window_rates if r > 0]
    windows = (len(a), len(b))
    if len(a) < 2 or len(b) < 2:
        speedup = (other.throughput or 0.0) / yours.throughput if yours.throughput else math.nan
        return SizeComparison(other.size, speedup, 0.0, math.inf, confidence, "undecided", min_gain, windows)
    diff = statistics.fmean(b) - statistics.fmean(a)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se > 0:
        df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))  # Welch-Satterthwaite
        half = t_quantile(1 - one_sided_alpha(confidence), max(1, math.floor(df))) * se
    else:
        half = 0.0
    low, high, threshold = diff - half, diff + half, math.log1p(min_gain)
    verdict = "faster" if low > threshold else "not_faster" if high < threshold else "undecided"
    return SizeComparison(other.size, math.exp(diff), math.exp(low), math.exp(high), confidence, verdict, min_gain, windows)


@dataclass
class SweepResult:
    start: int  # the user's micro-batch
    effective: int | None  # the effective batch kept (None: the effective batch changes with the size)
    chosen: int  # the fastest size that fit
    trials: list[SweepTrial] = field(default_factory=list)
    memory_bytes: int | None = None
    margin: float = MARGIN
    rule: str = ""
    #: the fastest other size measured, against the user's (None: no other size fit, or the user's did not)
    comparison: SizeComparison | None = None

    def trial(self, size: int) -> SweepTrial | None:
        return next((t for t in self.trials if t.size == size), None)

    @property
    def gain(self) -> float | None:
        """The chosen size's throughput over the user's: the comparison's where a size other than the
        user's was chosen (it was shown faster), 1.0 where the user's stays."""
        if self.comparison is not None and self.comparison.size == self.chosen:
            return self.comparison.speedup
        a, b = self.trial(self.start), self.trial(self.chosen)
        if a is None or b is None or not a.throughput or not b.throughput:
            return None
        return b.throughput / a.throughput

    def series(self) -> dict[str, list[Any]]:
        """Plot-ready columns, sorted by size."""
        rows = sorted(self.trials, key=lambda t: t.size)
        return {
            "size": [t.size for t in rows],
            "throughput": [t.throughput for t in rows],
            "peak_memory_gb": [t.peak_memory_bytes / 1e9 if t.peak_memory_bytes is not None else None for t in rows],
            "fits": [t.fits for t in rows],
            "checkpointed": [t.checkpointed for t in rows],
        }

    def table(self) -> list[str]:
        """The trials as Markdown table lines, in the order they ran."""
        unit = next((t.unit for t in self.trials if t.throughput), "items/s")
        lines = [f"| micro-batch | accumulate | throughput ({unit}) | peak memory | fits |", "|---|---|---|---|---|"]
        for t in self.trials:
            mark = " (chosen)" if t.size == self.chosen else " (yours)" if t.size == self.start else ""
            peak = f"{t.peak_memory_bytes / 1e9:.2f} GB" if t.peak_memory_bytes is not None else "-"
            rate = f"{t.throughput:,.0f}" if t.throughput else "-"
            if t.throughput and t.spread is not None:
                rate += f" ±{t.spread:.0%}" + (f" ({t.measured} fits)" if t.measured > 1 else "")
            fits = ("yes" if t.fits else "no: " + t.reason) + (", blocks checkpointed" if t.checkpointed else "")
            lines.append(f"| {t.size}{mark} | {t.accumulate} | {rate} | {peak} | {fits} |")
        return lines

    def lr_scaling(self, accumulate: int = 1) -> dict[str, Any] | None:
        """Where the effective batch changes (``effective`` None) and the chosen size is not the user's:
        the learning-rate scaling that goes with it (:func:`lr_scaling`), from the user's effective
        batch (``start`` x ``accumulate``) to the chosen one (accumulation 1); None otherwise."""
        if self.effective is not None or self.chosen == self.start * accumulate:
            return None
        optimizer = next((t.optimizer for t in self.trials if t.optimizer), "")
        return lr_scaling(optimizer, self.chosen / (self.start * accumulate))

    def to_dict(self, accumulate: int = 1) -> dict[str, Any]:
        return {
            "start": self.start,
            "effective": self.effective,
            "chosen": self.chosen,
            "gain": self.gain,
            "memory_bytes": self.memory_bytes,
            "margin": self.margin,
            "rule": self.rule,
            "lr_scaling": self.lr_scaling(accumulate),
            "comparison": (
                {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self.comparison).items()}
                if self.comparison is not None
                else None
            ),  # an unknown interval's ends as null (JSON has no infinity)
            "trials": [asdict(t) for t in self.trials],
            "series": self.series(),
        }


#: optimizers whose step is normalised per coordinate (Adam's family): the square-root rule
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Adafactor", "LAMB", "Lion")


def lr_scaling(optimizer: str, ratio: float) -> dict[str, Any]:
    """The learning-rate scaling for an effective batch ``ratio`` times the user's: the linear rule for
    SGD (Goyal et al. 2017: the learning rate times the ratio, with warm-up), the square-root rule for
    Adam-family optimizers (Malladi et al. 2022: times its square root); unknown optimizers get the
    square-root rule, the more cautious where the batch grows. A statement for the user: the sweep
    measures throughput, which the learning rate does not change, and changes no recipe."""
    linear = optimizer.startswith("SGD")
    adaptive = optimizer.startswith(ADAPTIVE)
    factor = ratio if linear else math.sqrt(ratio)
    rule = (
        "linear (SGD: Goyal et al. 2017)"
        if linear
        else "square root (Adam family: Malladi et al. 2022)"
        if adaptive
        else "square root (optimizer not known to the rule table; the more cautious of the two)"
    )
    return {
        "optimizer": optimizer or "unknown",
        "effective_batch_ratio": ratio,
        "rule": rule,
        "factor": factor,
        "line": (
            f"effective batch x{ratio:g}: scale the learning rate by x{factor:.3g} ({rule}) and keep a warm-up; "
            "the sweep applies it to no recipe"
        ),
    }


def candidates(start: int, *, effective: int | None = None, max_size: int = MAX_SIZE) -> list[int]:
    """The sizes the sweep may try, ascending: the divisors of ``effective`` (the effective batch kept),
    else ``start`` times and over powers of two (and 1.5 times them, for refinement) within [1, max_size]."""
    if effective is not None:
        return [d for d in range(1, effective + 1) if effective % d == 0]
    sizes = {start}
    k = start
    while k * 2 <= max_size:
        sizes.update((k * 2, k * 3 // 2))
        k *= 2
    k = start
    while k > 1:
        sizes.update((k // 2, (k * 3) // 4))
        k //= 2
    return sorted(s for s in sizes if 1 <= s <= max_size)


def fits_in_memory(trial: SweepTrial, memory_bytes: int | None, margin: float) -> SweepTrial:
    """``trial`` as :func:`sweep` judges it: one that ran but leaves less than ``margin`` of
    ``memory_bytes`` free does not fit (where both are known)."""
    if trial.fits and memory_bytes and trial.peak_memory_bytes is not None:
        free = 1 - trial.peak_memory_bytes / memory_bytes
        if free < margin:
            return replace(
                trial,
                fits=False,
                short_of_memory=True,
                reason=f"leaves {free:.0%} of device memory free, under the {margin:.0%} margin",
            )
    return trial


def checkpointing_where_needed(
    measure: Callable[[int, bool], SweepTrial],
    *,
    memory_bytes: int | None = None,
    margin: float = MARGIN,
    on_event: Callable[[str], None] = lambda line: None,
) -> Callable[[int], SweepTrial]:
    """A ``measure(size)`` for :func:`sweep` from ``measure(size, checkpointed)``: each size as it
    fits, without activation checkpointing where it fits so (checkpointing only costs a second forward
    of the blocks), with it where only the memory it frees makes the size fit (out of memory, or less
    than ``margin`` left free); from the first size that needed it on, larger sizes are measured with it
    directly. The sweep's choice is then the fastest size with or without (the trial says which)."""
    needed_from: list[int] = []

    def checkpointed(size: int) -> SweepTrial:
        return replace(measure(size, True), checkpointed=True)

    def measure_size(size: int) -> SweepTrial:
        if needed_from and size >= needed_from[0]:
            return checkpointed(size)
        plain = fits_in_memory(measure(size, False), memory_bytes, margin)
        if not plain.short_of_memory:
            return plain
        on_event(f"sweep: micro-batch {size} does not fit ({plain.reason}); measuring it with the blocks checkpointed")
        checked = fits_in_memory(checkpointed(size), memory_bytes, margin)
        if checked.fits:
            needed_from[:] = [size]
            return checked
        return replace(checked, reason=f"{checked.reason} (without checkpointing: {plain.reason})")

    return measure_size


def sweep(
    measure: Callable[[int], SweepTrial],
    start: int,
    *,
    effective: int | None = None,
    max_size: int = MAX_SIZE,
    memory_bytes: int | None = None,
    margin: float = MARGIN,
    min_gain: float = MIN_GAIN,
    max_trials: int = MAX_TRIALS,
    confidence: float = CONFIDENCE,
    on_event: Callable[[str], None] = lambda line: None,
    on_progress: Callable[[int, int, str], None] = lambda done, total, label: None,
) -> SweepResult:
    """Find the micro-batch of highest throughput (module docstring). ``measure(size)`` runs a trial;
    its ``fits`` is re-judged here against ``margin`` of ``memory_bytes`` where both are known.
    ``on_progress(done, total, label)``: sizes measured of at most ``max_trials`` (a progress bar).
    Beyond ``max_trials``, the user's size is measured once more where the fastest other size
    measured could be shown faster than it (both with windows' figures, the point gain at least
    ``min_gain``): the size chosen is that one only where :func:`compare_sizes` says "faster"."""
    if isinstance(start, bool) or not isinstance(start, int) or start < 1:
        raise ConfigError("batch size", f"expected a whole number of samples >= 1, found {start!r}")
    if effective is not None and effective % start:
        raise ConfigError("effective batch", f"{effective} is not a multiple of the micro-batch {start}")
    if not 0 <= margin < 1:
        raise ConfigError("margin", f"expected a share of device memory in [0, 1), found {margin!r}")
    grid = candidates(start, effective=effective, max_size=max_size)
    result = SweepResult(
        start,
        effective,
        start,
        memory_bytes=memory_bytes,
        margin=margin,
        rule=(
            f"grow x4 (x2 once a step gains under 50%) from {start} while it fits with {margin:.0%} of device memory free and "
            f"throughput rises by {min_gain:.0%}; refine between the best and its neighbours; "
            f"at most {max_trials} trials; a size other than yours only where shown faster by {min_gain:.0%} "
            f"({confidence:.0%} confidence; yours measured again to compare); "
            + (
                f"the effective batch {effective} kept (micro-batch x accumulation)"
                if effective
                else "the effective batch changes with the micro-batch"
            )
        ),
    )

    def run(size: int) -> SweepTrial:
        on_progress(len(result.trials), max_trials, f"micro-batch {size}")
        trial = fits_in_memory(measure(size), memory_bytes, margin)
        result.trials.append(trial)
        on_progress(len(result.trials), max_trials, f"micro-batch {size} measured")
        timed = f"{trial.throughput:,.0f} {trial.unit}" if trial.fits and trial.throughput else ""
        if timed and trial.spread is not None:
            timed += f" ±{trial.spread:.0%} over {len(trial.window_rates)} windows"
        if timed and trial.compiled_steps:
            timed += f", its first {trial.untimed_steps} steps untimed ({trial.compiled_steps} compiled a graph)"
        on_event(f"sweep: micro-batch {size}: " + (timed or f"does not fit ({trial.reason})"))
        return trial

    def rate(size: int) -> float:
        t = result.trial(size)
        return t.throughput if t is not None and t.fits and t.throughput else 0.0

    first = run(start)
    if not first.fits:  # the user's own size does not fit: look below it
        below = [s for s in grid if s < start]
        while below and len(result.trials) < max_trials:
            size = below[len(below) // 2] if len(below) > 2 else below[-1]
            if run(size).fits:
                break
            below = [s for s in below if s < size]
    best = max((t.size for t in result.trials if t.fits), key=rate, default=None)
    if best is None:
        result.chosen = start
        result.rule += "; nothing fit"
        return result
    # 1. grow: x4 at first and while each step pays at least half again (the gaps are refined after), then x2
    size, factor = best, 4
    while len(result.trials) < max_trials:
        bigger = [s for s in grid if s >= factor * size] or [s for s in grid if s > size]
        if not bigger:
            break
        size = bigger[0]
        if not run(size).fits or rate(size) < rate(best) * (1 + min_gain):
            break
        factor = 4 if rate(size) >= 1.5 * rate(best) else 2
        best = size
    if best == start and rate(start) > 0 and len(result.trials) < max_trials:  # maybe past the best already: one step down
        smaller = [s for s in grid if s <= start // 2] or [s for s in grid if s < start]
        if smaller and result.trial(smaller[-1]) is None and run(smaller[-1]).fits and rate(smaller[-1]) > rate(start):
            best = smaller[-1]
    # 2. refine between the best and its measured neighbours
    while len(result.trials) < max_trials:
        best = max((t.size for t in result.trials if t.fits), key=rate)
        measured = sorted(t.size for t in result.trials)
        above = [s for s in measured if s > best]
        below = [s for s in measured if s < best]
        gaps = []
        for other in ([above[0]] if above else []) + ([below[-1]] if below else []):
            lo, hi = sorted((best, other))
            inside = [s for s in grid if lo < s < hi and result.trial(s) is None]
            if inside:
                mid = math.sqrt(lo * hi)
                gaps.append(min(inside, key=lambda s: abs(math.log(s / mid))))
        if not gaps:
            break
        run(gaps[0])
    fitting = [t for t in result.trials if t.fits and t.throughput]
    fastest = max(fitting, key=lambda t: (t.throughput, -t.size))
    result.chosen = fastest.size
    if not first.fits or fastest.size == start:
        return result
    # the fastest other size against the user's: shown faster, or the user's stays
    yours = result.trial(start)
    assert yours is not None
    if len(yours.window_rates) >= 2 and len(fastest.window_rates) >= 2 and fastest.throughput >= rate(start) * (1 + min_gain):
        on_progress(len(result.trials), max_trials, f"micro-batch {start} again, to compare")
        again = measure(start)  # after the others: its two measurements bracket them in time
        on_event(
            f"sweep: micro-batch {start} again, to compare: "
            + (f"{again.throughput:,.0f} {again.unit}" if again.fits and again.throughput else f"not timed ({again.reason})")
        )
        if again.fits and len(again.window_rates) >= 2:
            pooled = yours.window_rates + again.window_rates
            yours = SweepTrial(
                **{
                    **asdict(yours),
                    "throughput": statistics.median(pooled),
                    "window_rates": pooled,
                    "seconds": yours.seconds + again.seconds,
                    "measured": yours.measured + 1,
                }
            )
            result.trials[result.trials.index(first)] = yours
    result.comparison = compare_sizes(yours, fastest, min_gain=min_gain, confidence=confidence)
    on_event(f"sweep: {result.comparison.line()}")
    if result.comparison.verdict != "faster":
        result.chosen = start  # not shown faster than the user's own size by the minimum: theirs stays
    return result
