"""The ladder: baseline, then rung by rung — apply, check numerics, measure, keep or revert.

For every rung, in the recipe's order:

1. ``check`` — does it apply to the run in front of it? If not, say why and go on.
2. ``apply`` — on top of the rungs kept so far.
3. parity — from the same initial weights, with the same K batches and the same RNG seed, the
   loss trajectory must stay within the tolerance of the numerics now in effect
   (``configs/tolerances.yaml``) of the trajectory before the rung.
4. measure — warm-up, then ``repeats`` windows of ``steps`` steps on the step clock.
5. keep if faster by more than max(min_gain, 2 x noise) (or leaner in memory without being
   slower beyond noise); else undo.

Every trial starts from the snapshot taken before the ladder and the snapshot is restored at the
end, so none of the trial steps leak into the user's training. A rung that raises is undone and
reported as failed; the ladder goes on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from speedkit import config
from speedkit.measure import StepClock, count_step_flops, mfu, peak_tflops, summarize
from speedkit.measure.flops import CONVENTION
from speedkit.measure.timing import time_windows
from speedkit.results import SCHEMA_VERSION, LadderResult, Measurement, Parity, RungResult
from speedkit.rungs.base import Handle, Rung
from speedkit.snapshot import Snapshot
from speedkit.state import TrainState, train_step


@dataclass
class MeasureConfig:
    """How the ladder measures; defaults from ``configs/defaults.yaml``."""

    warmup: int = 3
    steps: int = 10
    repeats: int = 5
    parity_steps: int = 3
    min_gain: float = 0.02
    memory_gain: float = 0.05
    throughput_unit: str = "auto"
    mfu_precision: str = "bf16"
    peak_tflops: float | None = None
    telemetry: bool = True

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None = None) -> MeasureConfig:
        merged = {**config.measure_defaults(), **(values or {})}
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in merged.items() if k in names})


def count_items(batch: Any, unit: str = "auto") -> tuple[int, str]:
    """Tokens or samples in a batch: integer (B, T, ...) inputs count tokens, anything else samples."""
    first = batch
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(first, dict):
        first = next(iter(first.values()))
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 1, "samples/s"
    is_tokens = not torch.is_floating_point(first) and first.dim() >= 2
    if unit == "tokens" or (unit == "auto" and is_tokens):
        return first.numel(), "tokens/s"
    return first.shape[0], "samples/s"


def _rel_diff(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


class Ladder:
    """Climb ``rungs`` on ``state``, measuring each.

    Args:
        state: the training objects (model, optimizer, loader, device).
        rungs: the rungs to try, in order.
        measure: a :class:`MeasureConfig` or a dict of its fields.
        seed: RNG seed set before every trial run, so trials see the same dropout masks.
        recipe: the recipe path, recorded in the report.
        on_event: called with progress lines (the CLI prints them).

    After :meth:`run`, the kept rungs stay applied (``handles``) on the restored initial state;
    :meth:`revert` undoes them.
    """

    def __init__(self, state: TrainState, rungs: list[Rung], measure: MeasureConfig | dict[str, Any] | None = None, *,
                 seed: int = 0, recipe: str | None = None, on_event: Callable[[str], None] | None = None) -> None:
        self.state = state
        self.rungs = list(rungs)
        self.cfg = measure if isinstance(measure, MeasureConfig) else MeasureConfig.from_dict(measure)
        self.seed = seed
        self.recipe = recipe
        self.on_event = on_event or (lambda line: None)
        self.handles: list[Handle] = []
        self.clock = StepClock(state.device)
        self._batches: Iterator[Any] | None = None
        self._parity_batches: list[Any] = []
        self._flops: int | None = None
        self._peak: float | None = None

    # -- the run -------------------------------------------------------------------------
    def run(self) -> LadderResult:
        from speedkit.report.environment import collect_environment

        state, cfg = self.state, self.cfg
        state.model.train()
        # the snapshot comes first: even starting a DataLoader iterator draws from the RNG
        snapshot = Snapshot(state.model, state.optimizer)
        self._snapshot = snapshot
        self._batches = state.batches()
        self._parity_batches = [next(self._batches) for _ in range(cfg.parity_steps)]
        results: list[RungResult] = []
        try:
            self._flops = count_step_flops(state.model, self._parity_batches[0], state.loss_fn)
            snapshot.restore()
            self._peak, peak_source = peak_tflops(state.device, cfg.mfu_precision, cfg.peak_tflops)

            self.on_event("baseline: parity reference")
            t0 = time.perf_counter()
            reference = self._trajectory()
            self.on_event("baseline: measuring")
            base_m = self._measure()
            baseline = RungResult("baseline", "baseline", precision=state.precision, measurement=base_m,
                                  parity=Parity(len(reference), 0.0, state.precision, reference, reference, 0.0, True),
                                  gain_vs_previous=1.0, gain_vs_baseline=1.0, seconds=time.perf_counter() - t0)
            results.append(baseline)
            previous = base_m
            kept: list[tuple[Rung, RungResult]] = []  # parallel to self.handles
            for i, rung in enumerate(self.rungs, 1):
                self.on_event(f"[{i}/{len(self.rungs)}] {rung.name}")
                result, handle, losses = self._try(rung, reference, previous, base_m)
                results.append(result)
                if result.status == "kept":
                    self.handles.append(handle)
                    kept.append((rung, result))
                    reference, previous = losses, result.measurement
                self.on_event(f"[{i}/{len(self.rungs)}] {rung.name}: {result.status}" + (f" ({result.reason})" if result.reason else ""))
            results += self._closing_check(kept, reference, previous, base_m)
        finally:
            snapshot.restore()  # trial steps never leak into the user's training
        return LadderResult(
            schema_version=SCHEMA_VERSION, recipe=self.recipe, environment=collect_environment(state.device),
            device=str(state.device),
            flops={"per_step": self._flops, "convention": CONVENTION.format(precision=cfg.mfu_precision, source=peak_source),
                   "peak_tflops": self._peak, "peak_source": peak_source, "precision": cfg.mfu_precision},
            measure=asdict(cfg), rungs=results)

    # -- closing check -----------------------------------------------------------------------------
    def _closing_check(self, kept: list[tuple[Rung, RungResult]], reference: list[float], current: Measurement,
                       base: Measurement) -> list[RungResult]:
        """Re-test each kept rung that asks for it (``Rung.recheck``) and has kept rungs after it:
        undo it and the rungs above it, re-apply those above, and measure. Faster without it beyond
        noise: it is reverted (its entry says by how much it lost) and a "closing" entry records
        the final configuration; otherwise it is put back as it was.
        """
        out: list[RungResult] = []
        j = 0
        while j < len(kept) - 1:
            rung, entry = kept[j]
            if not rung.recheck:
                j += 1
                continue
            above = [r for r, _ in kept[j + 1:]]
            names = ", ".join(r.name for r in above)
            self.on_event(f"closing check: {rung.name} with {names} on top")
            t0 = time.perf_counter()
            closing = RungResult(f"closing check: without {rung.name}", "closing", changes=[f"reverted {rung.name}"])
            try:
                self._unwind(j)
                self.handles += [self._reapply(r) for r in above]
                closing.precision = self.state.precision
                losses = self._trajectory()
                closing.parity = self._parity(losses, reference)
                m = self._measure() if closing.parity.passed else None
                status, why = self._decide(m, current) if m is not None else ("reverted", "numerics differ")
            except Exception as exc:  # put the configuration back as it was and say why the check failed
                status, why, m = "failed", f"{type(exc).__name__}: {str(exc).strip()[:200]}", None
            finally:
                self._snapshot.restore()
            if status == "kept":  # faster (or leaner at the same speed) without the rung: it stays reverted
                entry.status = "reverted"
                entry.reason = (f"reverted by the closing check: with {names} on top it no longer pays: step "
                                f"{current.step_ms:.2f} ms{_gb(current)} with it, {m.step_ms:.2f} ms{_gb(m)} without "
                                f"({m.step_ms / current.step_ms - 1:+.1%} step time without it; {why}); "
                                f"before {names}: {entry.reason}")
                closing.reason = f"final configuration without {rung.name}: {why}"
                closing.measurement = m
                closing.gain_vs_previous = current.step_ms / m.step_ms
                closing.gain_vs_baseline = base.step_ms / m.step_ms
                closing.seconds = time.perf_counter() - t0
                out.append(closing)
                kept.pop(j)
                reference, current = losses, m
                self.on_event(f"closing check: {rung.name} reverted ({why})")
                continue
            try:  # not faster without it (or the check failed): put it back under the rungs above
                self._unwind(j)
                self.handles += [self._reapply(r) for r in [rung, *above]]
            except Exception as exc:
                entry.reason = f"{entry.reason}; closing check could not restore it: {type(exc).__name__}: {exc}"
                raise
            finally:
                self._snapshot.restore()
            note = (f"closing check with {names} on top: step {current.step_ms:.2f} ms{_gb(current)} with it, {m.step_ms:.2f} ms"
                    f"{_gb(m)} without ({m.step_ms / current.step_ms:.3f}x with it, noise {math.hypot(m.spread, current.spread):.1%}), kept"
                    if m is not None else f"closing check with {names} on top did not complete ({why}), kept")
            entry.reason = f"{entry.reason}; {note}" if entry.reason else note
            self.on_event(f"closing check: {rung.name} kept")
            j += 1
        return out

    def _unwind(self, j: int) -> None:
        """Undo the kept handles from the last down to index ``j``."""
        while len(self.handles) > j:
            self.handles.pop().undo()

    def _reapply(self, rung: Rung) -> Handle:
        reason = rung.check(self.state)
        if reason is not None:
            raise RuntimeError(f"{rung.name} no longer applies: {reason}")
        handle = rung.apply(self.state)
        if handle.problem():
            handle.undo()
            raise RuntimeError(f"{rung.name}: {handle.problem()}")
        return handle

    def revert(self) -> None:
        """Undo every kept rung, last first."""
        while self.handles:
            self.handles.pop().undo()

    # -- one rung --------------------------------------------------------------------------
    def _try(self, rung: Rung, reference: list[float], previous: Measurement, base: Measurement
             ) -> tuple[RungResult, Handle | None, list[float]]:
        state = self.state
        t0 = time.perf_counter()
        result = RungResult(rung.name, "not_applicable", options=rung.options_dict(), precision=state.precision)
        try:
            reason = rung.check(state)
        except Exception as exc:  # a check that crashes is a failed rung, not a failed ladder
            result.status, result.reason = "failed", f"check raised {type(exc).__name__}: {exc}"
            return result, None, reference
        if reason is not None:
            result.reason = reason
            return result, None, reference

        handle: Handle | None = None
        losses: list[float] = reference
        result_precision_before = state.precision
        try:
            handle = rung.apply(state)
            result.changes = list(handle.changes)
            result.precision = state.precision
            self.on_event(f"  {rung.name}: parity over {self.cfg.parity_steps} steps")
            losses = self._trajectory()
            result.parity = self._parity(losses, reference)
            worst, tol = result.parity.max_rel_diff, result.parity.tolerance
            if worst == 0.0 and state.precision != result_precision_before:
                result.changes.append("note: applied but had no numerical effect here (loss trajectory bit-identical)")
            if handle.problem():
                raise _RungProblem(handle.problem())
            if not result.parity.passed:
                result.status = "reverted"
                result.reason = f"numerics changed: loss differs by {worst:.2e} (relative) > tolerance {tol:.0e} for {state.precision}"
            else:
                self.on_event(f"  {rung.name}: measuring")
                m = self._measure()
                result.measurement = m
                result.gain_vs_previous = previous.step_ms / m.step_ms
                result.gain_vs_baseline = base.step_ms / m.step_ms
                if handle.problem():
                    raise _RungProblem(handle.problem())
                result.status, result.reason = self._decide(m, previous)
        except Exception as exc:
            result.status = "failed"
            if isinstance(exc, torch.OutOfMemoryError):
                result.reason = "out of memory while trying this rung"
            elif isinstance(exc, _RungProblem):
                result.reason = str(exc)
            else:
                result.reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        finally:
            self._snapshot.restore()
            if state.device.type == "cuda":
                torch.cuda.empty_cache()
        if result.status != "kept" and handle is not None:
            try:
                handle.undo()
            except Exception as exc:  # an undo that fails leaves the run in an unknown state: say so loudly
                result.status = "failed"
                result.reason = f"{result.reason}; undo raised {type(exc).__name__}: {exc}"
            result.precision = state.precision
        result.seconds = time.perf_counter() - t0
        return result, handle, losses

    def _decide(self, m: Measurement, previous: Measurement) -> tuple[str, str]:
        cfg = self.cfg
        # noise of the difference of two independent measurements
        noise = math.hypot(m.spread, previous.spread)
        speedup = previous.step_ms / m.step_ms
        if noise >= 0.5:
            return "reverted", (f"measurement too noisy to decide ({noise:.0%} noise, {speedup:.2f}x): "
                                "run on a quiet machine or raise measure.repeats/steps")
        # faster beyond noise = by more than two standard deviations of the difference, and by
        # at least min_gain (a sub-percent "win" is not worth a change to the user's run)
        needed = max(cfg.min_gain, 2 * noise)
        if m.step_ms < previous.step_ms * (1 - needed):
            return "kept", f"{speedup:.3f}x faster (needed > {1 / (1 - needed):.3f}x: min gain {cfg.min_gain:.0%}, 2x noise {2 * noise:.1%})"
        if (m.peak_memory_bytes is not None and previous.peak_memory_bytes
                and m.peak_memory_bytes < previous.peak_memory_bytes * (1 - cfg.memory_gain)
                and m.step_ms <= previous.step_ms * (1 + noise)):
            saved = 1 - m.peak_memory_bytes / previous.peak_memory_bytes
            return "kept", f"{saved:.0%} less peak memory at the same speed ({speedup:.2f}x, noise {noise:.1%})"
        return "reverted", f"not faster beyond noise: {speedup:.3f}x (needed > {1 / (1 - needed):.3f}x: min gain {cfg.min_gain:.0%}, 2x noise {2 * noise:.1%})"

    # -- trials ------------------------------------------------------------------------------
    def _seed(self) -> None:
        torch.manual_seed(self.seed)

    def _parity(self, losses: list[float], reference: list[float]) -> Parity:
        """The loss trajectory against the reference, within the tolerance of the numerics in effect."""
        state = self.state
        tol = config.tolerance(state.precision, state.device.type)
        worst = max((_rel_diff(a, b) for a, b in zip(losses, reference)), default=0.0)
        return Parity(len(losses), tol, state.precision, reference, losses, worst, worst <= tol)

    def _trajectory(self) -> list[float]:
        """Losses of K steps from the initial snapshot on the parity batches (one sync at the end)."""
        self._snapshot.restore(rng=False)
        self._seed()
        losses = [train_step(self.state, batch, i) for i, batch in enumerate(self._parity_batches)]
        return [float(x) for x in torch.stack(losses).float().cpu()]

    def _measure(self) -> Measurement:
        from speedkit.measure.nvml import NvmlSampler

        state, cfg, clock = self.state, self.cfg, self.clock
        assert self._batches is not None
        self._snapshot.restore(rng=False)
        self._seed()
        cuda = state.device.type == "cuda"
        counter = iter(range(1 << 62))

        def run_step() -> None:
            train_step(state, next(self._batches), next(counter))

        if cuda:
            torch.cuda.reset_peak_memory_stats(state.device)
        sampler = NvmlSampler.create(state.device) if cfg.telemetry else None
        if sampler is not None:
            sampler.start()
        items, unit = count_items(self._parity_batches[0], cfg.throughput_unit)
        try:
            windows = time_windows(run_step, clock, warmup=cfg.warmup, steps=cfg.steps, repeats=cfg.repeats)
        finally:
            telemetry = sampler.stop() if sampler is not None else None
        median, spread = summarize(windows)
        util, achieved = mfu(self._flops, median / 1e3, self._peak)
        return Measurement(step_ms=median, spread=spread, window_ms=windows, warmup=cfg.warmup, steps=cfg.steps,
                           throughput=items / (median / 1e3), throughput_unit=unit, items_per_step=items, mfu=util,
                           tflops=achieved, peak_memory_bytes=torch.cuda.max_memory_allocated(state.device) if cuda else None,
                           telemetry=telemetry, clock=clock.name)


def _gb(m: Measurement) -> str:
    return f", peak {m.peak_memory_bytes / 1e9:.2f} GB" if m.peak_memory_bytes else ""


class _RungProblem(Exception):
    """A rung's own report that its change stopped working (e.g. compile fell back to eager)."""
