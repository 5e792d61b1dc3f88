"""The user's switches as the ladder's floor: the switches a user turns on by hand, as the user runs
them, timed against the final configuration; the final configuration stays only where it is shown
faster than them, and every other outcome (slower, undecided) ends on the switches, from which the
ladder starts again. A verb of the ladder's policy, taking the :class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from speedkit import config
from speedkit.engine.second_look import second_look
from speedkit.engine.stack import RungProblem, Slot, agreed_apply, agreed_check, agreed_problem
from speedkit.errors import first_line
from speedkit.measure.stats import describe
from speedkit.results import Parity, RungResult

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials


def switches_floor(ladder: Trials, reference: list[float]) -> tuple[RungResult | None, list[float]]:
    """Time the final configuration against the switches a user turns on by hand
    (``configs/defaults.yaml`` ``switches:``, those of the ladder's rungs that apply on the baseline,
    together: a precision or a compile the user set makes its rung say it does not apply, so the
    switches are as the user runs them). The switches are the floor and the tie goes to them: the
    final configuration stays only where it is decided faster than them (its comparison's verdict
    ``faster``, A the switches, B the final configuration); slower or undecided, the ladder starts
    again from the switches: the rungs of the climb's final configuration that are not switches,
    and every other rung reverted on speed, are judged on top of them (second looks). Returns the
    ``switches`` row (its comparison the final configuration against the switches; None when no
    switch is in the ladder) and the reference trajectory from then on."""
    result = ladder.result
    assert result is not None
    names = config.switch_rungs()
    candidates = [r for r in ladder.rungs if r.name in names]
    if not candidates:
        return None, reference
    t0 = ladder.host_clock()
    final = list(ladder.slots)
    n = len(final)
    ladder.stack.configure([False] * n)  # which switches apply is asked of the baseline
    switches, notes = [], []
    for rung in candidates:
        try:
            reason = agreed_check(rung, ladder.state)
        except Exception as exc:
            reason = f"check raised {type(exc).__name__}: {first_line(exc)}"
        if reason is None:
            switches.append(rung)
        else:
            notes.append(f"{rung.name}: not applicable ({reason})")
    label = " + ".join(r.name for r in switches) or "none"
    row = RungResult("switches", "switches", reason=f"the switches by hand: {label}", changes=notes)
    result.rungs.append(row)
    kept_names = [s.rung.name for s in final]
    if not switches or [r.name for r in switches] == kept_names:
        ladder.stack.configure([True] * n)
        if switches:
            row.gain_vs_previous = 1.0
        row.reason += "; none applies" if not switches else "; the same as the final configuration"
        row.seconds = ladder.host_clock() - t0
        return row, reference
    ladder.on_event(f"switches: {label} against the final configuration")
    subset = all(r.name in kept_names for r in switches)
    added: list[Slot] = []
    parity: Parity | None = None
    try:
        if subset:  # the final configuration with its other rungs off
            mask_switches = [s.rung.name in {r.name for r in switches} for s in ladder.slots]
        else:  # applied on the baseline beside the final configuration, which is off while they run
            for rung in switches:
                slot = Slot(rung, agreed_apply(rung, ladder.state), (False,) * n + (True,) * len(added))
                ladder.slots.append(slot)
                added.append(slot)
            mask_switches = [False] * n + [True] * len(added)
        mask_final = [True] * n + [False] * len(added)
        losses, parity = ladder.parity.of(mask_switches, [False] * len(ladder.slots), ladder.parity.reference)
        row.parity, row.precision = parity, ladder.state.precision
        problems = [p for p in (agreed_problem(s.handle) for s in ladder.slots if s.on) if p]
        if not parity.passed:
            raise RungProblem(
                f"numerics changed: loss differs from the baseline's by {parity.max_rel_diff:.2e} > "
                f"{parity.tolerance:.0e} ({ladder.state.precision})"
            )
        if problems:
            raise RungProblem(problems[0])
        ladder.stack.configure(mask_switches)  # A: the switches; B: the final configuration
        paired = ladder.compare(
            lambda on: ladder.stack.configure(mask_final if on else mask_switches),
            "switches",
            shared_batches=not any(s.rung.new_shape_cost for s in ladder.slots),
        )
    except Exception as exc:  # not a candidate: the final configuration stays, said why
        ladder.stack.drop(added)
        ladder.stack.configure([True] * n)
        ladder.snapshot.restore()
        row.reason += f"; not measured: {exc if isinstance(exc, RungProblem) else f'{type(exc).__name__}: {first_line(exc)}'}"
        row.seconds = ladder.host_clock() - t0
        ladder.on_event(f"switches: {row.reason}")
        return row, reference
    finally:
        ladder.snapshot.restore()
    row.comparison, row.measurement, row.gain_vs_previous = paired, paired.a, paired.speedup
    # the switches are the floor: the final configuration stays only where it is shown faster than them
    if paired.verdict == "faster":
        ladder.stack.drop(added)
        ladder.stack.configure([True] * n)
        row.reason += f"; the final configuration against them: {describe(paired)}"
        row.seconds = ladder.host_clock() - t0
        ladder.on_event(f"switches: the final configuration is {paired.speedup:.3f}x the switches, decided faster")
        return row, reference
    outcome = "undecided" if paired.verdict == "undecided" else "not faster"
    # the switches win: the climb starts again from them
    if subset:
        for j in reversed(range(n)):
            if not mask_switches[j]:
                ladder.stack.remove(j)
    else:
        ladder.stack.configure(mask_switches)
        for slot in reversed(final):
            ladder.slots.remove(slot)
            slot.undo()
        for slot in added:
            slot.below = slot.below[n:]
    ladder.stack.all_on()
    switch_names = {r.name for r in switches}
    # their gain over the baseline: the climb's (its decisions, each group once) times theirs over it
    climb = decided_product(ladder, kept_names)
    for rung in switches:
        ladder.decisions[rung.name] = (tuple(r.name for r in switches), climb / paired.speedup if climb is not None else None)
    for name in kept_names:
        entry = ladder.entry(name)
        if entry is not None and name not in switch_names:
            entry.status = "reverted"
            entry.reason = (
                f"{entry.reason}; the climb's final configuration was {outcome} against the switches "
                f"({paired.speedup:.3f}x): judged again on top of them"
            )
    for rung in switches:
        entry = ladder.entry(rung.name)
        if entry is not None and entry.status != "kept":
            slot = next(s for s in ladder.slots if s.rung is rung)
            entry.status, entry.changes = "kept", list(slot.handle.changes) + slot.handle.report()
            entry.rewrite = slot.rewrite_report()
            entry.reason = (
                f"kept with the switches ({label}; the climb's final configuration against them: {describe(paired)}); "
                f"before: {entry.reason}"
            )
    row.reason += (
        f"; the climb's final configuration against them: {describe(paired)}, {outcome}: the tie goes to the "
        "switches, and the ladder starts from them"
    )
    ladder.on_event(
        f"switches: the climb is {paired.speedup:.3f}x them, {outcome}: ending on the switches, judging the other rungs on top"
    )
    ladder.phase = "the second look on the switches"
    reference = second_look(ladder, losses)
    ladder.phase = "the switches"
    if len(ladder.slots) > len(switches):  # rungs kept on top: the final configuration against the switches, measured
        on_top = [s.rung not in switches for s in ladder.slots]
        mask_s = [not o for o in on_top]
        try:
            ladder.stack.configure(mask_s)
            again = ladder.compare(lambda on: ladder.stack.configure([True] * len(ladder.slots) if on else mask_s), "switches")
            row.comparison, row.measurement, row.gain_vs_previous = again, again.a, again.speedup
        finally:
            ladder.stack.all_on()
            ladder.snapshot.restore()
    else:  # the same configuration: its comparison with the climb is in the reason
        row.comparison, row.gain_vs_previous = None, 1.0
        row.reason += "; nothing paid on top of them: the final configuration is the switches"
    row.seconds = ladder.host_clock() - t0
    return row, reference


def decided_product(ladder: Trials, names: list[str]) -> float | None:
    """The product of the decisions that kept ``names`` (a group once); None where one is unknown."""
    if any(n not in ladder.decisions for n in names):
        return None
    groups = {ladder.decisions[n][0]: ladder.decisions[n][1] for n in names}
    if any(v is None for v in groups.values()):
        return None
    return math.prod(groups.values()) if groups else 1.0
