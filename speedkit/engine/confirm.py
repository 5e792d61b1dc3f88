"""The confirm phase: the final configuration held to the bottom line, what the user runs without speedkit.

After the climb and its second looks, :func:`confirm` times the final configuration against the user's
switches (:func:`speedkit.engine.switches.confirm_floor`: anything but a decided gain ends on them), then
against the baseline (:func:`final_check`). A final check that is not faster ends on the better of the
baseline and the floor as measured (:func:`fall_back`): the floor where its own comparison with the
baseline puts it above 1.0 (timed there and then where it could not be timed at the start: a data-bound
step), else the baseline. No configuration decided or estimated slower than the baseline is kept. Every
decision goes in the ledger. Then the scaling across ranks and the profile (:func:`scaling_and_profile`).
Verbs of the ladder's policy, taking the :class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from speedkit.engine import comparison, switches
from speedkit.engine.comparison import compare, link_of, record, revert
from speedkit.engine.profile_run import profile_configurations
from speedkit.errors import first_line
from speedkit.measure.stats import describe
from speedkit.results import PairedResult

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials


def confirm(ladder: Trials, base_ms: float, pace_ms: float) -> None:
    """The final configuration against the switches, then against the baseline, ending on the better of
    the baseline and the floor where it is not shown faster (module docstring). ``base_ms``, ``pace_ms``:
    the baseline's and the floor's step (what the closing comparisons' cost is estimated from)."""
    cfg, result = ladder.cfg, ladder.result
    assert result is not None
    ladder.budget.begin_closing()  # what was held back for the closing phases is theirs from here
    floor_row = ladder.floor_row
    if cfg.switches_floor and floor_row is not None and ladder.floor:
        ladder.phase = "the switches"
        on_top = any(s.rung.name not in ladder.floor for s in ladder.slots)
        # the final check goes first where the budget left holds one of the two: it times the final
        # configuration directly, against the bottom line, and its figure is the headline
        after = ladder.budget.comparison_s(base_ms, pace_ms) if on_top and cfg.final_check else 0.0
        if not on_top or affordable(ladder, "the final configuration against the switches", pace_ms, pace_ms, also_s=after):
            switches.confirm_floor(ladder, floor_row)
        else:  # not timed against the floor: the rungs on top stand on their own decided gains
            floor_row.reason = (
                f"{floor_row.reason}; the final configuration against them not measured within the budget: "
                "the rungs on top stand on their own decided gains"
            )
    if not ladder.slots:
        return
    check = floor_comparison(ladder)
    if check is not None:  # the final configuration is the floor, timed against the baseline already
        result.final_check = check
        ladder.on_event(f"final check: the final configuration is the user's switches alone, {describe(check)}")
    elif cfg.final_check or _untimed_floor(ladder):
        # an untimed floor is timed here whatever the settings: it is kept only if it does not lose
        if affordable(ladder, "the final check", base_ms, pace_ms):
            ladder.phase = "the final check"
            try:
                final_check(ladder)
            except Exception as exc:  # the rungs were judged already; the bottom line is checked below
                ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
                ladder.on_event(f"final check failed ({type(exc).__name__}: {first_line(exc)})")
    check = result.final_check
    if check is None:
        _without_a_check(ladder)
    elif comparison.decide(ladder.cfg, check)[0] != "kept":
        fall_back(ladder, check)
    elif _untimed_floor(ladder):
        _floor_from_the_check(ladder, check)


def final_check(ladder: Trials) -> None:
    """The final configuration (B) against the baseline (A), interleaved: ``result.final_check``."""
    assert ladder.result is not None and ladder.snapshot is not None
    n = len(ladder.slots)
    ladder.on_event(f"final check: {', '.join(s.rung.name for s in ladder.slots)} against the baseline")
    try:
        ladder.result.final_check = compare(
            ladder, lambda on: ladder.stack.configure([on] * n), "final", shared_batches=ladder.stack.shares_batches()
        )
    finally:
        ladder.stack.configure([True] * n)
        ladder.snapshot.restore()


def floor_comparison(ladder: Trials) -> PairedResult | None:
    """Where the final configuration is the user's switches alone (every kept rung is of the floor), the
    floor's comparison against the baseline, made at the start of the climb: the same two configurations,
    interleaved, so the final check itself (not timed again). None otherwise, or where it was not timed."""
    if not ladder.slots or any(s.rung.name not in ladder.floor for s in ladder.slots):
        return None
    row = ladder.entry(ladder.slots[0].rung.name)  # a switch's row: the floor's comparison against the baseline
    paired = row.comparison if row is not None else None
    if paired is None or paired.a is None or paired.b is None:
        return None
    return replace(
        paired,
        measured_in="the floor's comparison against the baseline at the start of the climb (the final configuration is the user's switches alone)",
    )


def fall_back(ladder: Trials, check: PairedResult) -> None:
    """The final check did not show the final configuration faster than the baseline: end on the better
    of the baseline and the floor as measured. With rungs on top of the floor, the floor stays where its
    own comparison with the baseline (timed now where the climb could not) estimates it faster; the
    final configuration that is the floor alone stays only where the check itself does. Else the
    baseline: every rung is undone."""
    result = ladder.result
    assert result is not None
    floor = [s.rung.name for s in ladder.slots if s.rung.name in ladder.floor]
    on_top = [s.rung.name for s in ladder.slots if s.rung.name not in ladder.floor]
    result.run["final_check_not_faster"] = asdict(check)
    said = f"the final configuration against the baseline: {describe(check)}"
    if floor and on_top:
        floor_check = _floor_against_the_baseline(ladder)
        if floor_check is not None and floor_check.speedup > 1.0:
            revert(ladder, on_top, "the final check", f"{said}; the floor alone is estimated faster than the baseline", None)
            result.final_check = replace(floor_check, measured_in=floor_check.measured_in or "the floor against the baseline")
            ladder.on_event(f"final check: not faster ({describe(check)}): ending on the user's switches")
            return
        why = f"{said}; the floor alone " + (
            f"is not faster either ({describe(floor_check)})" if floor_check is not None else "could not be timed against it"
        )
    elif floor:
        if check.speedup > 1.0:  # the floor, estimated faster: the tie goes to it
            if _untimed_floor(ladder):
                _floor_from_the_check(ladder, check)
            ladder.on_event(f"final check: the user's switches {describe(check)}: estimated faster, they stay as the floor")
            return
        why = f"{said}: the user's switches alone are estimated slower than the baseline"
    else:
        why = f"{said}: not faster"
    revert(ladder, floor + on_top, "the final check", f"{why}; ending on the baseline, what the user runs", None)
    result.final_check = None
    ladder.on_event(f"final check: {why}: ending on the baseline, every rung undone")


def _untimed_floor(ladder: Trials) -> bool:
    """The floor is kept and its figure stands on no comparison (not timed against the baseline)."""
    floor = [s.rung.name for s in ladder.slots if s.rung.name in ladder.floor]
    link = link_of(ladder, floor[0]) if floor else None
    return link is not None and link.get("speedup") is None


def _floor_from_the_check(ladder: Trials, check: PairedResult) -> None:
    """An untimed floor's figure from the final check: the check less the links on top (their comparisons
    with power -1), so that the chain multiplies to the check."""
    assert ladder.result is not None
    floor = [s.rung.name for s in ladder.slots if s.rung.name in ladder.floor]
    less = [
        {**c, "power": -c.get("power", 1)}
        for link in ladder.result.figures()["links"]
        if not link["floor"]
        for c in link["comparisons"]
    ]
    record(
        ladder,
        "the final check",
        floor,
        True,
        check,
        "the floor, untimed at the start, timed in the final check" + (" (less the rungs on top)" if less else ""),
        also=less,
    )


def _floor_against_the_baseline(ladder: Trials) -> PairedResult | None:
    """The floor's comparison with the baseline: the one made at the start where it decided the floor
    faster, else timed now (the rungs on top off: an untimed floor, or one the start left undecided),
    within the budget; its figure recorded as the floor's. None where it cannot be timed."""
    assert ladder.result is not None and ladder.snapshot is not None
    floor = [s.rung.name for s in ladder.slots if s.rung.name in ladder.floor]
    row = ladder.entry(floor[0]) if floor else None  # a switch's row: the floor's comparison against the baseline
    earlier = row.comparison if row is not None else None
    if earlier is not None and earlier.b is not None and comparison.decide(ladder.cfg, earlier)[0] == "kept":
        return earlier  # decided faster at the start: as measured
    if not affordable(ladder, "the floor against the baseline", *ladder.steps_ms):
        return None
    ladder.phase = "the floor against the baseline"
    n = len(ladder.slots)
    floor_mask = [s.rung.name in ladder.floor for s in ladder.slots]
    ladder.on_event("final check: the user's switches alone against the baseline")
    try:
        ladder.stack.configure([False] * n)  # A: the baseline; B: the floor
        paired = compare(ladder, lambda on: ladder.stack.configure(floor_mask if on else [False] * n), "the floor")
    except Exception as exc:
        ladder.stop.reraise(exc)
        ladder.on_event(f"final check: the floor against the baseline failed ({type(exc).__name__}: {first_line(exc)})")
        return None
    finally:
        ladder.stack.all_on()
        ladder.snapshot.restore()
    floor = [s.rung.name for s in ladder.slots if s.rung.name in ladder.floor]
    record(ladder, "the floor against the baseline", floor, paired.speedup > 1.0, paired, describe(paired))
    return replace(paired, measured_in="the floor against the baseline, timed after the final check")


def _without_a_check(ladder: Trials) -> None:
    """No final check was made (turned off, skipped for the budget, or failed): the chain decides. A floor
    that was never timed, or a chain whose product is estimated under 1.0, is not kept: the baseline. (The
    estimate is judged as a decision, :func:`speedkit.engine.comparison.decide`, on a comparison of no
    width: faster where it is 1.0 or more.)"""
    assert ladder.result is not None
    headline = ladder.result.figures()["headline"]["speedup"]
    estimate = PairedResult(headline or 0.0, headline or 0.0, headline or 0.0, 1.0, 0, "not_faster", 0.0)
    if headline is not None and headline >= 1.0:
        estimate.verdict = "faster"
    if _untimed_floor(ladder) or comparison.decide(ladder.cfg, estimate)[0] != "kept":
        names = [s.rung.name for s in ladder.slots]
        why = (
            "the user's switches were never timed against the baseline (no final check)"
            if _untimed_floor(ladder)
            else f"the kept rungs' figures multiply to {headline:.3f}x the baseline, estimated slower"
            if headline is not None
            else "the final configuration has no figure"
        )
        revert(ladder, names, "the confirm phase", f"{why}; ending on the baseline, what the user runs", None)
        ladder.on_event(f"final check: not made; {why}: ending on the baseline")


def affordable(ladder: Trials, what: str, a_ms: float, b_ms: float, also_s: float = 0.0) -> bool:
    """Whether the budget left holds a closing comparison between steps of ``a_ms`` and ``b_ms`` at its
    fewest blocks (and ``also_s`` for a later one that goes first); where not, it is skipped and the
    report says so (the trials end near their budget rather than a comparison's length past it)."""
    budget = ladder.budget
    needed = budget.comparison_s(a_ms, b_ms) + also_s
    if not (math.isfinite(a_ms) and math.isfinite(b_ms)) or budget.closing_left() >= needed:
        return True
    ladder.note_budget(what)
    return False


def scaling_and_profile(ladder: Trials, cached: bool = False) -> None:
    """The last closing phases, after a climb or a cached decision that held: the scaling across ranks
    and the profile (within what the budget left; ``cached``: none, a re-check takes seconds, and where
    the time goes was profiled by the fit that made the decision)."""
    result = ladder.result
    assert result is not None
    if ladder.state.step.world_size() > 1:
        ladder.phase = "the scaling"
        scaling(ladder)
    if not ladder.cfg.profile:
        return
    if cached:
        note = result.run.get("cache") or {}
        result.profile = {
            "windows": [],
            "host_syncs": {},
            "note": "not profiled: a cached decision re-checked in seconds; where the time goes before and after "
            f"is in the report of the fit that made it (key {str(note.get('key', ''))[:8]})",
        }
        return
    ladder.phase = "the profile"
    if ladder.budget.closing_left() > 0:
        profile_configurations(ladder)
    else:
        ladder.note_budget("the profile")


def scaling(ladder: Trials) -> None:
    """Across several processes: the final configuration's step with DDP's gradient all-reduce (A) timed
    against the same step without it (B), interleaved: B is what one GPU runs with this per-rank batch,
    so B's step time over A's is the scaling efficiency (``run["scaling"]``). Not measured where the step
    cannot leave the all-reduce out (a replayed CUDA graph holds it)."""
    result = ladder.result
    assert result is not None and ladder.snapshot is not None
    step, world = ladder.state.step, ladder.state.step.world_size()
    ladder.on_event(f"scaling: the final configuration with and without the gradient all-reduce over {world} ranks")
    entry: dict[str, Any] = {"world_size": world, "efficiency": None}
    fixed = step.gradient_sync_fixed()
    if fixed is not None:  # the same on every rank: the graph stopped on all of them or on none
        entry["note"] = f"the all-reduce cannot be switched off: {fixed}"
        shares = [r["share"] for r in (result.run.get("ranks_communication") or {}).get("ranks", [])]
        if shares and all(s is not None for s in shares):
            # were every collective's time exposed, one GPU would run the step without it; the rank whose
            # collectives took least is the one the others wait for: its time in them is the transfers',
            # the others' holds their wait for it (on two H200s 11% on one rank, 79% on the other)
            entry["efficiency_at_least"] = round(1 - min(shares), 4)
        ladder.on_event(f"scaling: not measured: {entry['note']}")
        result.run["scaling"] = entry
        return
    try:
        paired = compare(ladder, lambda on: step.gradient_sync(not on), "scaling", shared_batches=ladder.stack.shares_batches())
        assert paired.a is not None and paired.b is not None
        entry.update(
            efficiency=round(paired.b.step_ms / paired.a.step_ms, 4),
            step_ms_synced=paired.a.step_ms,
            step_ms_unsynced=paired.b.step_ms,
            note=(
                "each rank's step times the slowest rank's; one GPU without DDP also skips DDP's forward "
                "bookkeeping, which the step without the all-reduce still runs"
            ),
        )
        ladder.on_event(f"scaling: efficiency {entry['efficiency']:.2f}")
    except Exception as exc:  # the decisions stand; only the scaling figure is missing
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        entry["note"] = f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        step.gradient_sync(True)
        ladder.snapshot.restore()
    result.run["scaling"] = entry
