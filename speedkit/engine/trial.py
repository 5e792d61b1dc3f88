"""One rung's trial: does it apply here, then applied at its place among the kept rungs, its numerics
judged against the configuration before it, timed against that configuration, kept or undone
(:func:`try_rung`). A verb of the ladder's policy, taking the :class:`~speedkit.engine.trials.Trials`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from speedkit import distributed
from speedkit.engine import comparison
from speedkit.engine.comparison import compare, record
from speedkit.engine.parity import dropout_off
from speedkit.engine.stack import RungProblem, Slot, agreed_problem
from speedkit.engine.timing import heartbeat
from speedkit.errors import first_line
from speedkit.results import RungResult

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials
    from speedkit.rungs.base import Rung


def try_rung(ladder: Trials, rung: Rung, reference: list[float]) -> tuple[RungResult, list[float]]:
    """Apply ``rung`` at its place in the ladder's order among the kept rungs (on top of them, or
    beneath those that come after it, which are switched off and on again on top of it), check its
    parity against the configuration before it and time it against that configuration (B with it, A
    without). Returns its row and the reference trajectory from then on (its own where kept). The
    decision goes in the ledger (:func:`speedkit.engine.comparison.record`)."""
    state, stack = ladder.state, ladder.stack
    assert ladder.result is not None and ladder.snapshot is not None
    t0 = ladder.host_clock()
    entry = RungResult(rung.name, "not_applicable", options=rung.options_dict(), precision=state.precision)
    ladder.trying(entry)
    place = stack.place(rung)
    above = [s.rung.name for s in ladder.slots[place:]]
    try:
        reason = stack.check_at_place(rung)
    except Exception as exc:  # a check that crashes is a failed rung, not a failed ladder
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        reason = None
        entry.status, entry.reason = "failed", f"check raised {type(exc).__name__}: {first_line(exc)}"
    if reason is not None or entry.status == "failed":
        stack.all_on()
        entry.reason = entry.reason or reason
        ladder.trying(None)
        return entry, reference

    losses = reference
    precision_before = state.precision
    slot: Slot | None = None
    n = len(ladder.slots) + 1
    paired = None

    def toggle(on: bool) -> None:
        stack.configure([True] * n if on else [i != place for i in range(n)])

    try:
        slot = stack.insert(place, rung, (True,) * place)
        ladder.trying(entry, slot)
        stack.configure([True] * n)  # the kept rungs after it, back on top of it
        entry.changes = list(slot.handle.changes) + ([f"applied beneath {', '.join(above)}"] if above else [])
        entry.rewrite = slot.rewrite_report()
        entry.precision = state.precision
        losses = judge_parity(ladder, entry, slot, place, reference, toggle, precision_before)
        inert = entry.parity.max_rel_diff == 0.0 and rung.acts_through_numerics
        problem = agreed_problem(slot.handle)
        if problem:
            raise RungProblem(problem)
        if not entry.parity.passed:
            entry.status = "reverted"
            entry.reason = entry.reason or (  # the batches' parity says why where it failed
                f"numerics changed: loss differs by {entry.parity.max_rel_diff:.2e} (relative) > "
                f"tolerance {entry.parity.tolerance:.0e} for {entry.parity.precision}"
            )
        elif inert:
            entry.status = "reverted"
            entry.reason = (
                "no effect here: the loss trajectory is bit-identical with it, so no op ran at its "
                "precision and it cannot change the step's speed; not timed"
            )
        else:
            shared = not rung.new_shape_cost and (not above or stack.shares_batches())
            paired = compare(ladder, toggle, rung.name, shared_batches=shared, weight_of=rung.name)
            problem = agreed_problem(slot.handle)
            if problem:
                raise RungProblem(problem)
            entry.comparison = paired
            ladder.last_comparison[rung.name] = paired
            ladder.judged.add(((rung.name,), tuple(s.rung.name for s in ladder.slots if s is not slot)))
            entry.measurement = paired.b
            entry.status, entry.reason = comparison.decide(ladder.cfg, paired, rung.memory_comparable)
            if not rung.memory_comparable:
                entry.changes.append("note: peak memory is not compared: " + rung.memory_note)
    except Exception as exc:
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        entry.status = "failed"
        paired = None
        ladder.failed_beneath[rung.name] = tuple(s.rung.name for s in ladder.slots if s is not slot)
        if isinstance(exc, torch.OutOfMemoryError):
            entry.reason = "out of memory while trying this rung"
        elif isinstance(exc, RungProblem):
            entry.reason = str(exc)
        else:
            entry.reason = f"{type(exc).__name__}: {first_line(exc)}"[:300]
    finally:
        if slot is not None:
            try:
                entry.changes += slot.handle.report()
            except Exception as exc:  # what it did is a report line; never the cause of a failure
                entry.changes.append(f"note: its report raised {type(exc).__name__}: {first_line(exc)}")
        ladder.snapshot.restore()
        if state.device.type == "cuda":
            torch.cuda.empty_cache()
    ladder.trying(None)
    keep_or_undo(ladder, entry, slot)
    if entry.status in ("kept", "reverted"):
        record(ladder, "the climb", [rung.name], entry.status == "kept", paired, entry.reason or "")
    entry.seconds = ladder.host_clock() - t0
    return entry, losses if entry.status == "kept" else reference


def judge_parity(
    ladder: Trials,
    entry: RungResult,
    slot: Slot,
    place: int,
    reference: list[float],
    toggle: Callable[[bool], None],
    precision_before: str,
) -> list[float]:
    """The candidate ``slot`` at ``place`` judged on its loss trajectory against ``reference`` (with
    dropout off where it draws its masks from another stream; also with the precision rungs off
    for a rewrite of the model's code): sets ``entry.parity`` and its notes; returns the trajectory."""
    state, rung, parity = ladder.state, slot.rung, ladder.parity
    ladder.on_event(f"  {rung.name}: parity over {parity.steps} steps")
    with heartbeat(ladder.on_event, f"  {rung.name}: parity"):  # the first steps compile, where a rung compiles
        losses = parity.trajectory()
    entry.parity = parity.judge(losses, reference)
    if parity.draws_differently(place):
        # the same function drawing its dropout masks differently: compare with dropout off
        with dropout_off(state.model):
            candidate = parity.trajectory()
            toggle(False)
            try:
                before = parity.trajectory()
            finally:
                toggle(True)
        entry.parity = parity.judge(candidate, before)
        entry.changes.append(
            "note: parity judged with dropout off (the change draws dropout masks from "
            "another random stream, so trajectories with dropout on differ by design)"
        )
    if entry.parity.passed and rung.judged_at_full_precision:
        precise = parity.at_full_precision(place)
        if precise is not None:
            entry.changes.append(
                f"note: also judged with the precision rungs off ({precise.precision}): "
                f"max rel diff {precise.max_rel_diff:.2e} against {precise.tolerance:.0e}"
            )
            if not precise.passed:
                entry.parity = precise
    bit_identical = entry.parity.max_rel_diff == 0.0
    if bit_identical and not rung.acts_through_numerics and state.precision != precision_before:
        entry.changes.append("note: applied but had no numerical effect here (loss trajectory bit-identical)")
    # a change that makes the samples draw other random numbers (another worker count under augmentations):
    # the loss trajectory runs on parity batches drawn once, so what must hold is read from the loaders
    batches = rung.batch_parity(state, parity.steps * state.step.accumulate)
    if batches is not None:
        entry.changes += [f"note: {line}" for line in batches.lines()]
        if distributed.any_rank(not batches.passed):
            entry.parity = replace(entry.parity, passed=False)
            entry.reason = batches.failure or "the batches differ on another rank where they must not"
    return losses


def keep_or_undo(ladder: Trials, entry: RungResult, slot: Slot | None) -> None:
    """After a trial: the kept rungs all on again, the candidate's slot among them where kept, else
    undone (an undo that fails is the rung's failure)."""
    stack = ladder.stack
    if entry.status == "kept":
        stack.all_on()
    elif slot is not None:
        try:
            if slot in ladder.slots:
                stack.remove(ladder.slots.index(slot))
            else:
                slot.undo()
        except Exception as exc:  # an undo that fails leaves the run in an unknown state: say so loudly
            entry.status = "failed"
            entry.reason = f"{entry.reason}; undo raised {type(exc).__name__}: {exc}"
        entry.precision = ladder.state.precision
    else:
        stack.all_on()
