"""The decision cache in the trials: this run's key (:func:`decision_key_of`), the decision the cache
holds for it (:func:`cached_entry`), its re-check (:func:`recheck`: applied, parity against the baseline,
the final configuration timed), its use without timing where the fit is too short for trials
(:func:`apply_cached`), and the storing of a climb's decision (:func:`store_decision`). Verbs of the
ladder's policy, taking the :class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from speedkit import compat, distributed
from speedkit.engine import switches
from speedkit.engine.cache import CachedDecision, batch_signature_of, decision_key, key_parts
from speedkit.engine.comparison import record
from speedkit.engine.stack import RungProblem, agreed_problem
from speedkit.errors import first_line
from speedkit.measure.stats import describe
from speedkit.results import Measurement, PairedResult, RungResult

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials


def decision_key_of(ladder: Trials) -> str:
    """The cache key of this run's decision (:func:`speedkit.engine.cache.key_parts`)."""
    from speedkit import config

    assert ladder.result is not None
    state = ladder.state
    parts = key_parts(
        state.model,
        ladder.optimizers() if state.optimizer is None else state.optimizer,
        batch_signature_of(ladder.parity.batches[0]) if ladder.parity.batches else None,
        ladder.result.environment,
        ladder.settings,
        [(r.name, r.options_dict()) for r in ladder.rungs],
        {
            "min_gain": ladder.cfg.min_gain,
            "detect_gain": ladder.cfg.detect_gain,
            "confidence": ladder.cfg.confidence,
            "switches_floor": ladder.cfg.switches_floor,
            "switches": list(config.switch_rungs()),
        },
    )
    return decision_key(parts)


def cached_entry(ladder: Trials) -> CachedDecision | None:
    """The decision the cache holds for this run's key (None: none; the note says so)."""
    assert ladder.cache is not None and ladder.result is not None
    key = ladder.cache_key = decision_key_of(ladder)
    entry = distributed.broadcast(ladder.cache.load(key) if distributed.rank() == 0 else None)
    ladder.result.run["cache"] = {"key": key, "dir": str(ladder.cache.root), "hit": entry is not None, "held": None}
    if entry is None:
        ladder.on_event(f"cache: no decision for this model and settings (key {key[:8]}): climbing")
    return entry


def _apply_entry(ladder: Trials, entry: CachedDecision, seconds: dict[str, float] | None = None) -> Any:
    """The cached decision's kept rungs applied together at their places, their parity judged (within the
    envelopes the climb calibrated) against their own trajectory in the fit that made the decision where
    this run starts where that one did (:func:`_same_start_parity`), else against the baseline; returns
    the parity. Raises
    :class:`RungProblem` where a rung is not in this ladder, the numerics changed or a rung reports a problem."""
    t0 = ladder.host_clock()
    names = {r.name for r in ladder.rungs}
    unknown = [n for n in entry.kept if n not in names]
    if unknown:
        raise RungProblem(f"the cached rungs {unknown} are not in this ladder")
    by_rung: dict[str, float] = {}
    for rung in [r for r in ladder.rungs if r.name in entry.kept]:
        t_rung = ladder.host_clock()
        if entry.chosen and isinstance(entry.chosen.get(rung.name), dict):  # what it measured then
            rung.reuse(entry.chosen[rung.name])
        ladder.stack.insert_at_place(rung)
        by_rung[rung.name] = round(ladder.host_clock() - t_rung, 2)
    ladder.stack.all_on()
    n = len(ladder.slots)
    if seconds is not None:
        seconds["apply"] = round(ladder.host_clock() - t0, 2)
        ladder.result.run["cache"]["apply_by_rung_s"] = by_rung  # where applying went, rung by rung
    if not n:
        return None
    t0 = ladder.host_clock()
    parity = _same_start_parity(ladder, entry, ladder.result.run["cache"])
    if parity is None:
        # against the baseline; its own trajectory is not needed: where dropout draws differently it is
        # judged with dropout off (and the baseline's reference, with dropout on, is not run at all)
        _, parity = ladder.parity.of([True] * n, [False] * n, own_trajectory=False)
        if not parity.passed:
            raise RungProblem(f"numerics changed: loss differs by {parity.max_rel_diff:.2e} > {parity.tolerance:.0e}")
    if seconds is not None:
        seconds["parity"] = round(ladder.host_clock() - t0, 2)  # its first steps compile and capture
    problem = next((p for p in (agreed_problem(s.handle) for s in ladder.slots) if p), None)
    if problem:
        raise RungProblem(problem)
    return parity


def _then(entry: CachedDecision) -> tuple[PairedResult | None, Measurement | None]:
    """The cached decision's final check (None where its fit had none) and the final configuration's
    measurement then (its final check's windows, else its figure from the chain)."""
    decided = PairedResult.from_dict(entry.final_check) if entry.final_check else None
    then = decided.b if decided is not None else Measurement.from_dict(entry.final) if entry.final else None
    return decided, then


def _record_held(ladder: Trials, entry: CachedDecision, parity: Any, check: PairedResult | None, how: str) -> None:
    """The held decision's rows (one kept row per rung) and its ledger entry: the kept rungs together, their
    figure the final check (``check``: re-timed now, or that fit's) or, without one, that fit's figure."""
    assert ladder.result is not None
    key = entry.key
    group = [s.rung.name for s in ladder.slots]
    against = ladder.result.run["cache"].get("parity_against")
    numerics = f"; numerics judged against {against}" if against else ""
    if check is not None:
        record(ladder, "the cache", group, True, check, how)
    elif entry.speedup is not None:  # that fit's figure, no interval: no comparison of its own
        figure = {"speedup": entry.speedup, "low": None, "high": None, "verdict": None, "power": 1, "label": "the cache"}
        ladder.result.decide("the cache", group, True, [figure], how)
    else:
        ladder.result.decide("the cache", group, True, [], how)
    for slot in ladder.slots:
        ladder.result.rungs.append(
            RungResult(
                slot.rung.name,
                "kept",
                options=slot.rung.options_dict(),
                precision=ladder.state.precision,
                changes=list(slot.handle.changes) + slot.handle.report(),
                parity=parity,
                reason=f"from the decision cache (key {key[:8]}), kept with {', '.join(group)} in an earlier fit; {how}{numerics}",
            )
        )


def recheck(ladder: Trials, entry: CachedDecision) -> bool:
    """Re-check ``entry``, the decision the cache holds for this run's key: its kept rungs applied
    together, their parity against the baseline (within the envelopes the climb calibrated), then the
    final configuration timed alone against its step time in the final check of the fit that made the
    decision. Within that figure's noise (at least ``cache_slack``), the decision holds with that final
    check as its figure; slower, the final configuration is timed against the baseline again, paired,
    and the decision holds where shown faster (the user's switches alone, the floor, where not shown
    slower). Returns whether it held; where it did not, everything is undone, the entry forgotten, and
    the trials climb as without a cache (the report says why)."""
    assert ladder.cache is not None and ladder.result is not None and ladder.timing is not None
    result, key = ladder.result, entry.key
    note = result.run["cache"]
    ladder.on_event(f"cache: re-checking the decision of an earlier fit (key {key[:8]}): {', '.join(entry.kept) or 'none kept'}")
    # the switches that apply on the baseline: asked before the cached rungs go in
    floor_only = ladder.cfg.switches_floor and set(entry.kept) <= {r.name for r in switches.applicable_switches(ladder)[0]}
    compiled_before, caches_before = compat.compile_seconds(), compat.compile_cache_counts()
    restarts_before = compat.dynamo_restarts()
    seconds = note["seconds"] = {}  # where the re-check's time went: applying, parity, timing
    check: PairedResult | None = None
    how = ""
    try:
        parity = _apply_entry(ladder, entry, seconds)
        if ladder.slots:
            t1 = ladder.host_clock()
            ladder.phase = "the final check"
            decided, then = _then(entry)
            if then is not None and retimed_holds(ladder, then, note):
                if decided is not None:
                    decided.measured_in = f"the fit that made the cached decision (key {key[:8]}, {_date(entry.created)})"
                    result.final_check = check = decided
                    how = f"its final check then: {describe(decided)}"
                else:
                    how = (
                        f"the final configuration re-timed within the noise of its figure then ({entry.speedup or math.nan:.3f}x)"
                    )
            else:
                from speedkit.engine.confirm import final_check

                final_check(ladder)
                check = result.final_check
                if check is None:
                    raise RungProblem("re-checked against the baseline: not measured")
                # rungs beyond the user's switches hold where shown faster; the switches alone, the floor,
                # where not shown slower (climbing again would end on them again)
                if check.verdict != "faster" and (not floor_only or check.speedup < 1.0):
                    raise RungProblem(
                        f"re-checked against the baseline: {describe(check)}, "
                        + ("estimated slower" if floor_only else "not faster")
                    )
                how = f"re-checked together against the baseline: {describe(check)}"
            seconds["timing"] = round(ladder.host_clock() - t1, 2)
    except Exception as exc:
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        ladder.stack.undo_all()
        assert ladder.snapshot is not None
        ladder.snapshot.restore()
        result.final_check = None
        note["held"] = False
        note["why"] = str(exc) if isinstance(exc, RungProblem) else f"{type(exc).__name__}: {first_line(exc)}"
        if distributed.rank() == 0:
            ladder.cache.forget(key)
        ladder.on_event(f"cache: the decision did not hold ({note['why']}): climbing again")
        return False
    _record_held(ladder, entry, parity, check, how)
    seconds["compiling"] = round(compat.compile_seconds() - compiled_before, 2)  # within apply, parity and timing
    # the compiled graphs' caches over the re-check (hits, misses: a miss compiles from scratch)
    note["compile_caches"] = compat.compile_cache_counts(since=caches_before)
    # frames Dynamo traced again from their start (at a graph break, or for a float it had to specialize)
    note["traced_again"] = compat.dynamo_restarts() - restarts_before
    note.update(held=True, kept=list(entry.kept), vs_switches=entry.vs_switches, decided_in_s=entry.trials_s)
    spent = ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
    ladder.on_event(
        f"cache: the decision holds: {', '.join(entry.kept) or 'none kept'}" + (f" (re-checked in: {spent})" if spent else "")
    )
    return True


def apply_cached(ladder: Trials, entry: CachedDecision, why: str) -> bool:
    """A fit too short for trials (``why``) takes the cached decision without timing it: its rungs applied,
    their parity judged against the baseline; its figure that fit's. Returns whether it was applied (where
    its parity fails, nothing is: the fit trains as set up)."""
    assert ladder.result is not None
    note = ladder.result.run["cache"]
    try:
        parity = _apply_entry(ladder, entry)
    except Exception as exc:
        ladder.stop.reraise(exc)
        ladder.stack.undo_all()
        assert ladder.snapshot is not None
        ladder.snapshot.restore()
        note.update(held=False, why=str(exc) if isinstance(exc, RungProblem) else f"{type(exc).__name__}: {first_line(exc)}")
        ladder.on_event(f"cache: the cached decision could not be applied ({note['why']}); {why}")
        return False
    decided, _ = _then(entry)
    if decided is not None:
        decided.measured_in = f"the fit that made the cached decision (key {entry.key[:8]}, {_date(entry.created)})"
        ladder.result.final_check = decided
    _record_held(ladder, entry, parity, decided, f"applied without timing ({why})")
    note.update(held=True, kept=list(entry.kept), applied_untimed=True, vs_switches=entry.vs_switches)
    ladder.on_event(
        f"cache: {why}; applying the decision of an earlier fit without timing it: {', '.join(entry.kept) or 'none kept'}"
    )
    return True


def retimed_holds(ladder: Trials, then: Measurement, note: dict[str, Any]) -> bool:
    """The final configuration timed alone (``repeats`` windows of the comparisons' length) against its
    step time in ``then``, its figure in the fit that made the cached decision: whether it is no slower
    than that by more than the two figures' noise (three times the larger spread, at least
    ``cache_slack``, at most half: slower, the paired check decides). Recorded in ``note["retimed"]``."""
    assert ladder.timing is not None
    cfg = ladder.cfg
    with distributed.together():
        now = ladder.timing.alone(ladder.timing.window_steps, cfg.repeats)
    spreads = [x for x in (now.spread, then.spread) if math.isfinite(x)]
    # a noisy host widens it, up to half the step: beyond that only a paired comparison can tell
    slack = max(cfg.cache_slack, min(0.5, 3 * max(spreads, default=0.0)))
    ratio = now.step_ms / then.step_ms if then.step_ms > 0 else math.inf
    holds = ratio <= 1 + slack
    note["retimed"] = {
        "step_ms": now.step_ms,
        "spread": now.spread,
        "decided_step_ms": then.step_ms,
        "ratio": ratio,
        "slack": slack,
        "holds": holds,
    }
    ladder.on_event(
        f"cache: the final configuration at {now.step_ms:.2f} ms per step, {ratio:.3f}x its {then.step_ms:.2f} when decided "
        f"(within {slack:.1%}: " + ("holds)" if holds else "slower: timed against the baseline again)")
    )
    return holds


def store_decision(ladder: Trials) -> None:
    """Keep the decision the climb made (rank 0 writes; a failure to write is a line, never the run's).
    Its figures are the account's (:func:`speedkit.figures.account.account`)."""
    if ladder.cache is None or ladder.cache_key is None:
        return
    trajectory = own_trajectory(ladder)
    trials_s = round(ladder.budget.elapsed(), 1)  # the budget's clock is a collective: read on every rank
    if distributed.rank() != 0:
        return
    result = ladder.result
    assert result is not None
    figures = result.figures()
    check, baseline = result.final_check, result.baseline
    checked = check is not None and check.b is not None
    final = result.final_measurement if ladder.slots and not checked else None
    versus = figures["vs_switches"]
    entry = CachedDecision(
        key=ladder.cache_key,
        kept=[s.rung.name for s in ladder.slots],
        speedup=figures["headline"]["speedup"],
        vs_switches=versus["speedup"] if versus else None,
        trials_s=trials_s,
        speedkit=result.environment.get("speedkit"),
        calibration={p: dict(c) for p, c in ladder.parity.calibration.items()},
        baseline={"measurement": asdict(baseline.measurement), "noise": dict(result.run.get("noise") or {})}
        if baseline is not None and baseline.measurement is not None
        else None,
        final_check=asdict(check) if checked else None,
        final=asdict(final) if final is not None else None,
        chosen={s.rung.name: c for s in ladder.slots if (c := s.rung.chosen()) is not None} or None,
        trajectory=trajectory,
    )
    try:
        path = ladder.cache.store(entry)
        ladder.on_event(f"cache: decision kept in {path}")
    except OSError as exc:
        ladder.on_event(f"cache: could not keep the decision ({type(exc).__name__}: {first_line(exc)})")


def own_trajectory(ladder: Trials) -> dict[str, Any] | None:
    """The final configuration's own loss trajectory (dropout on, as the fit runs it) and the digest of
    where it started, for the cache (:attr:`CachedDecision.trajectory`); None where no rung is kept, the
    start was not digested (several processes) or the trajectory failed (the line says why)."""
    if not ladder.slots or ladder.start_digest is None:
        return None
    try:
        ladder.stack.all_on()
        losses = ladder.parity.trajectory()
    except Exception as exc:
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        ladder.on_event(f"cache: the final configuration's trajectory not recorded ({type(exc).__name__}: {first_line(exc)})")
        return None
    if not all(math.isfinite(x) for x in losses):
        return None
    return {"digest": ladder.start_digest, "losses": losses}


def _same_start_parity(ladder: Trials, entry: CachedDecision, note: dict[str, Any]) -> Any:
    """The cached decision's numerics judged against its own trajectory in the fit that made it, where
    this run starts where that one did (the same digest: weights, optimizer state, random states and
    parity batches): the same configuration from the same start runs the same computation, dropout
    masks included, so its trajectory now stands within the envelope of its precision's rounding. That
    trajectory's configuration was judged against the baseline by the climb. Returns the parity where
    it holds; None where it cannot be judged so or does not hold (the note says which): the baseline
    judges it then."""
    stored = entry.trajectory or {}
    losses = stored.get("losses")
    if ladder.start_digest is None or stored.get("digest") != ladder.start_digest or not isinstance(losses, list):
        note["parity_against"] = "the baseline" + (
            " (this run starts elsewhere than the fit that made the decision)" if losses else ""
        )
        return None
    reference = [float(x) for x in losses]
    if len(reference) != ladder.parity.steps:
        note["parity_against"] = "the baseline (the decision's trajectory has other steps)"
        return None
    parity = ladder.parity.judge(ladder.parity.trajectory(), reference)
    if not parity.passed:
        note["parity_against"] = (
            f"the baseline (its loss moved {parity.max_rel_diff:.2e} from its trajectory in the fit that made it, "
            "from the same start)"
        )
        ladder.on_event(
            f"cache: numerics moved from the decision's trajectory ({parity.max_rel_diff:.1e}): judged against the baseline"
        )
        return None
    note["parity_against"] = "its own trajectory in the fit that made the decision, from the same start"
    ladder.on_event(
        f"cache: numerics as in the fit that made the decision (the same start): loss within {parity.max_rel_diff:.1e} "
        "of its trajectory then"
    )
    return parity


def _date(created: float) -> str:
    """When a cached decision was stored, for the report ("an unknown date" where not recorded)."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created else "an unknown date"
