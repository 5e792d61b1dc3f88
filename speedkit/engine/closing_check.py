"""The ladder's closing check: each kept rung that asks for it (``Rung.recheck``) judged again with
the rungs kept after it on top, and reverted where it no longer pays. A verb of the ladder's policy,
taking the :class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedkit.engine import comparison
from speedkit.engine.comparison import compare, record
from speedkit.errors import first_line
from speedkit.results import RungResult

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials


def closing_check(ladder: Trials, reference: list[float]) -> list[float]:
    """Re-judge each kept rung that asks for it, with the kept rungs after it on top; returns the
    final configuration's loss trajectory."""
    result = ladder.result
    assert result is not None
    j = 0
    while j < len(ladder.slots) - 1:
        slot = ladder.slots[j]
        if not slot.rung.recheck or slot.rung.name in ladder.floor:  # the floor stays as the user runs it
            j += 1
            continue
        if ladder.budget.spent():  # the rungs' share of the budget holds no comparison: it stands as decided
            ladder.note_budget(f"the closing check of {slot.rung.name}")
            j += 1
            continue
        entry = next(r for r in result.rungs if r.name == slot.rung.name)
        names = ", ".join(s.rung.name for s in ladder.slots[j + 1 :])
        ladder.on_event(f"closing check: {slot.rung.name} with {names} on top")
        t0 = ladder.host_clock()
        without = [i != j for i in range(len(ladder.slots))]
        closing = RungResult(f"closing check: without {slot.rung.name}", "closing", changes=[f"reverted {slot.rung.name}"])
        try:
            losses, closing.parity = ladder.parity.of(without, [True] * len(ladder.slots), reference)
            closing.precision = ladder.state.precision
            if not closing.parity.passed:  # the configuration without it must be the same function
                raise RuntimeError("the configuration without it changes numerics")
            paired = compare(
                ladder,
                lambda on: ladder.stack.configure([True] * len(ladder.slots) if on else without),
                slot.rung.name,
                shared_batches=ladder.stack.shares_batches(),
            )
            status, why = comparison.decide(ladder.cfg, paired)
        except Exception as exc:  # put the configuration back and say why the check failed
            ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
            paired, status, why = None, "failed", f"{type(exc).__name__}: {first_line(exc)}"
        finally:
            ladder.snapshot.restore()
        if status == "reverted":  # it no longer pays with the later rungs on top
            with_it = ladder.stack.remove(j)  # and those that cannot work without it (off in the comparison too)
            ladder.judged.add(((slot.rung.name,), tuple(s.rung.name for s in ladder.slots)))
            entry.status = "reverted"
            entry.reason = f"reverted by the closing check: with {names} on top, {why}; before them: {entry.reason}"
            record(ladder, "the closing check", [slot.rung.name, *with_it], False, paired, why)
            for name in with_it:
                dependent = ladder.entry(name)
                if dependent is not None:
                    dependent.status = "reverted"
                    dependent.reason = f"{dependent.reason}; reverted with {slot.rung.name}, which it cannot work without"
            closing.reason = f"final configuration without {slot.rung.name}"
            closing.comparison, closing.measurement = paired, paired.a if paired else None
            closing.seconds = ladder.host_clock() - t0
            result.rungs.append(closing)
            ladder.on_event(f"closing check: {slot.rung.name} reverted ({why})")
            reference = losses
            continue
        ladder.stack.all_on()
        # it stands on the figure it was kept with (the chain telescopes through the kept set's changes: its
        # gain with the later rungs on top is another link's figure), re-checked here
        record(ladder, "the closing check", [slot.rung.name], True, None, f"re-checked with {names} on top: {why}")
        note = f"closing check with {names} on top: {why}" + (", kept" if status == "kept" else ", kept as it was")
        entry.reason = f"{entry.reason}; {note}" if entry.reason else note
        ladder.on_event(f"closing check: {slot.rung.name} kept")
        j += 1
    return reference
