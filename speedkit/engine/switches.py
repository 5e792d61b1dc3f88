"""The user's switches as the ladder's floor, as the user runs them: applied together before any
other rung (:func:`apply_floor`), and every other rung judged on top of them; after the climb, the
final configuration timed against them (:func:`confirm_floor`). Verbs of the ladder's policy, taking
the :class:`~speedkit.engine.trials.Trials` (the ladder).

The switches are ``configs/defaults.yaml``'s ``switches:`` that apply on the baseline: a precision or
a compile the user set makes its rung say it does not apply, so the floor is the user's switches as
they run them (for an fp32 eager user bf16-mixed, TF32, compile and the library's attention switch).
They stay as a group, judged against the baseline only to be sure they are not slower than it: a
floor decided slower than the baseline, or one that changes numerics or fails, is no floor, and the
climb starts from the baseline with each switch a rung like the others. The tie goes to the floor:
the rungs on top stay only on their own decided gains, and the final configuration falls back to the
floor where it is decided not faster than it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from speedkit import config
from speedkit.engine import comparison
from speedkit.engine.budget import window_steps
from speedkit.engine.comparison import compare, record, revert
from speedkit.engine.stack import RungProblem, agreed_check, agreed_problem, kept_entry
from speedkit.errors import first_line
from speedkit.measure.stats import describe
from speedkit.results import Measurement, PairedResult, RungResult

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials
    from speedkit.rungs.base import Rung


def applicable_switches(ladder: Trials) -> tuple[list[Rung], list[str]]:
    """The switches among the ladder's rungs that apply on the configuration in effect (the baseline),
    in the ladder's order, and a note for each that does not."""
    names = config.switch_rungs()
    switches, notes = [], []
    for rung in (r for r in ladder.rungs if r.name in names):
        try:
            reason = agreed_check(rung, ladder.state)
        except Exception as exc:
            reason = f"check raised {type(exc).__name__}: {first_line(exc)}"
        if reason is None:
            switches.append(rung)
        else:
            notes.append(f"{rung.name}: not applicable ({reason})")
    return switches, notes


def apply_floor(
    ladder: Trials, reference: list[float], baseline: Measurement
) -> tuple[RungResult | None, list[float], Measurement | None]:
    """Apply the user's switches together on the baseline, check their parity against it and time them
    against it (A the baseline, B the switches). They stay, the floor (``ladder.floor``), unless decided
    slower than the baseline, changing numerics or failing: then everything is undone and the climb
    starts from the baseline. Where the baseline's step clock shows the step waiting for its batches
    (``diagnosis.data_bound_share`` of it or more), they are not timed: a faster compute cannot show
    there, and the comparison would spend the budget its remedy needs (on an H200, 25-37 s of a
    ResNet-18's 120 s, undecided). Appends the ``switches`` row and, where they stay, a kept row per switch
    (kept as the user's switches, with the group's figure). Returns the row (None where the ladder has
    no switch), the reference trajectory from then on and the floor's measurement (None: no floor)."""
    result = ladder.result
    assert result is not None and ladder.snapshot is not None
    if not any(r.name in config.switch_rungs() for r in ladder.rungs):
        return None, reference, None
    t0 = ladder.host_clock()
    switches, notes = applicable_switches(ladder)
    label = " + ".join(r.name for r in switches) or "none"
    row = RungResult("switches", "switches", reason=f"the switches by hand: {label}", changes=notes)
    result.rungs.append(row)
    if not switches:
        row.reason = f"{row.reason}; none applies"
        return row, reference, None
    ladder.on_event(f"floor: the user's switches ({label}) against the baseline")
    paired: PairedResult | None = None
    why_untimed = ""
    try:
        for rung in switches:
            ladder.stack.insert_at_place(rung)
        n = len(ladder.slots)
        losses, parity = ladder.parity.of([True] * n, [False] * n, reference)
        row.parity, row.precision = parity, ladder.state.precision
        if not parity.passed:
            raise RungProblem(
                f"numerics changed: loss differs from the baseline's by {parity.max_rel_diff:.2e} > {parity.tolerance:.0e}"
            )
        problem = next((p for p in (agreed_problem(s.handle) for s in ladder.slots) if p), None)
        if problem:
            raise RungProblem(problem)
        wait = baseline.data_wait_ms / baseline.step_ms if baseline.data_wait_ms and baseline.step_ms else 0.0
        if wait >= config.diagnosis_thresholds()["data_bound_share"]:
            raise _Untimed(
                f"not timed against the baseline: the step waits for its batches {wait:.0%} of its time, "
                "where a faster compute cannot show"
            )
        ladder.stack.configure([False] * n)  # A: the baseline; B: the switches
        paired = compare(
            ladder,
            lambda on: ladder.stack.configure([on] * n),
            "the switches",
            shared_batches=not any(s.rung.new_shape_cost for s in ladder.slots),
            grant=ladder.budget.for_floor,
        )
        ladder.stack.all_on()
        problem = next((p for p in (agreed_problem(s.handle) for s in ladder.slots) if p), None)
        if problem:
            raise RungProblem(problem)
        if paired.verdict == "not_faster" and paired.high < 1.0:
            raise RungProblem(f"slower than the baseline: {describe(paired)}")
    except _Untimed as untimed:  # the floor stays, as the user runs it, untimed
        ladder.stack.all_on()
        why_untimed = str(untimed)
    except Exception as exc:
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        ladder.stack.undo_all()
        why = str(exc) if isinstance(exc, RungProblem) else f"{type(exc).__name__}: {first_line(exc)}"
        row.reason = f"{row.reason}; no floor ({why}): the climb starts from the baseline, each switch judged as a rung"
        row.seconds = ladder.host_clock() - t0
        record(ladder, "the floor", [r.name for r in switches], False, paired, why)
        ladder.on_event(f"floor: {row.reason}")
        return row, reference, None
    finally:
        ladder.snapshot.restore()
    group = tuple(r.name for r in switches)
    ladder.floor = set(group)
    result.floor = list(group)
    if paired is None:
        return _untimed_floor(ladder, row, switches, parity, why_untimed, t0), losses, None
    floor_m = paired.b
    if floor_m is not None and ladder.timing is not None:  # the rungs are timed on the floor's step: windows sized by it
        noise = window_steps(floor_m, ladder.cfg, ladder.clock.name)
        ladder.timing.window_steps = noise["window_steps"]
        if floor_m.spread == floor_m.spread:  # not NaN
            ladder.timing.noise = max(0.005, floor_m.spread)
        result.run.setdefault("noise", {})["on_the_floor"] = noise
    row.comparison, row.measurement = paired, paired.b
    row.reason = f"{row.reason}; the floor, as the user runs them: against the baseline {describe(paired)}"
    record(ladder, "the floor", group, True, paired, f"the user's switches, the floor: {describe(paired)}")
    for slot in ladder.slots:
        result.rungs.append(
            kept_entry(
                slot,
                ladder.state.precision,
                f"one of the user's switches ({label}), the floor every other rung is judged on: kept with them, "
                f"their figure against the baseline {describe(paired)}",
                parity=parity,
                comparison=paired,
                measurement=paired.b,
            )
        )
    row.seconds = ladder.host_clock() - t0
    ladder.on_event(f"floor: {label} kept as the floor ({describe(paired)} against the baseline)")
    return row, losses, floor_m


class _Untimed(Exception):
    """The floor applies and passes its parity, but is not timed against the baseline (said why)."""


def _untimed_floor(ladder: Trials, row: RungResult, switches: list[Rung], parity: Any, why: str, t0: float) -> RungResult:
    """The floor kept untimed: its row and a kept row per switch say why (no figure of their own)."""
    result = ladder.result
    assert result is not None
    label = " + ".join(r.name for r in switches)
    group = tuple(r.name for r in switches)
    row.reason = f"{row.reason}; the floor, as the user runs them: {why}"
    record(ladder, "the floor", group, True, None, f"the user's switches, the floor, untimed: {why}")
    for slot in ladder.slots:
        result.rungs.append(
            kept_entry(
                slot,
                ladder.state.precision,
                f"one of the user's switches ({label}), the floor every other rung is judged on: kept with them, {why}",
                parity=parity,
            )
        )
    row.seconds = ladder.host_clock() - t0
    ladder.on_event(f"floor: {label} kept as the floor ({why})")
    return row


def confirm_floor(ladder: Trials, row: RungResult | None) -> None:
    """After the climb: the final configuration (B) against the floor (A, the rungs on top off). The rungs
    on top stay only where it is decided faster than the floor; undecided or not faster, they are
    reverted (the tie goes to the floor) and the decision recorded. Sets the row's comparison."""
    if row is None or not ladder.floor:
        return
    t0 = ladder.host_clock()
    on_top = [s.rung.name not in ladder.floor for s in ladder.slots]
    if not any(on_top):
        row.reason = f"{row.reason}; nothing paid on top of them: the final configuration is the switches"
        return
    n = len(ladder.slots)
    mask_floor = [not o for o in on_top]
    names = [s.rung.name for s, o in zip(ladder.slots, on_top) if o]
    ladder.on_event(f"switches: the final configuration against them ({', '.join(names)} on top)")
    try:
        ladder.stack.configure(mask_floor)  # A: the floor; B: the final configuration
        paired = compare(
            ladder,
            lambda on: ladder.stack.configure([True] * n if on else mask_floor),
            "switches",
            shared_batches=ladder.stack.shares_batches(),
        )
    except Exception as exc:  # the rungs on top were each decided on their own: they stay, said why
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        row.reason = f"{row.reason}; the final configuration against them not measured ({type(exc).__name__}: {first_line(exc)})"
        return
    finally:
        ladder.stack.all_on()
        assert ladder.snapshot is not None
        ladder.snapshot.restore()
    assert ladder.result is not None
    ladder.result.run["switches_check"] = asdict(paired)  # the final configuration against the floor
    if comparison.decide(ladder.cfg, paired)[0] != "kept":  # not shown faster: the tie goes to the floor
        why = f"the final configuration with them on top was not shown faster than the switches ({describe(paired)})"
        revert(ladder, names, "the switches", f"{why}: the tie goes to the floor", paired)
        row.reason = (
            f"{row.reason}; the final configuration with {', '.join(names)} on top against them: {describe(paired)}, "
            "not shown faster: the tie goes to the floor, the final configuration is the switches"
        )
        ladder.on_event(f"switches: the rungs on top are {paired.speedup:.3f}x them, not shown faster: ending on the switches")
    else:
        record(ladder, "the switches", names, True, None, f"the final configuration against the switches: {describe(paired)}")
        row.reason = f"{row.reason}; the final configuration against them ({', '.join(names)} on top): {describe(paired)}"
        ladder.on_event(f"switches: the final configuration is {paired.speedup:.3f}x them (faster)")
    row.seconds = (row.seconds or 0.0) + ladder.host_clock() - t0
