"""The diagnosed bottleneck's remedy tried as one configuration: its rungs together, each at its place,
judged against the configuration before them (:func:`try_remedy`), then, once the ladder has tried the
rest of its order, member by member (leave one out, :func:`speedkit.engine.second_look.leave_one_out`),
so that nothing rides along that slows the step.

One at a time, a remedy's rungs hide each other's gains: on Lightning's demo Transformer (host-bound)
the progress bar's sync removal measured 0.99x on the compiled step and 1.31x once a CUDA graph
replayed it, and whether a second look reached it came down to the budget left. Together they are
judged once, and each then by what leaving it out costs. A verb of the ladder's policy, taking the
:class:`~speedkit.engine.trials.Trials` (the ladder).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speedkit.engine import comparison
from speedkit.engine.comparison import compare, record
from speedkit.engine.second_look import judge_inserted
from speedkit.engine.stack import RungProblem, agreed_problem, kept_entry
from speedkit.errors import first_line
from speedkit.measure.stats import describe
from speedkit.results import Parity, RungResult

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials
    from speedkit.rungs.base import Rung


def try_remedy(ladder: Trials, group: list[Rung], reference: list[float]) -> tuple[list[str], list[float]]:
    """Apply the rungs of ``group`` that apply (at least two; else nothing is tried) at their places in
    the configuration in effect, check their parity against ``reference`` (also with the precision
    rungs off for a rewrite) and time them together against the configuration without them. Kept:
    each gets its entry, kept with the bundle and its figure; the ladder judges it member by member
    (:func:`leave_one_out`) once the rest of its order is tried. Not kept (undecided, slower,
    failed): all are undone, and each is tried on its own afterwards. Returns the names kept and the
    reference trajectory from then on."""
    result = ladder.result
    assert result is not None and ladder.snapshot is not None
    t0, inserted, tried = ladder.host_clock(), [], []
    for rung in sorted(group, key=ladder.rungs.index):  # in ladder order: each at its place among the kept rungs
        try:
            place = ladder.stack.insert_at_place(rung)
        except RungProblem:  # does not apply here: tried (and said why) on its own
            ladder.stack.all_on()
            continue
        except Exception as exc:  # its apply raised: its own trial says so
            ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
            ladder.stack.all_on()
            continue
        inserted = [i + (i >= place) for i in inserted] + [place]
        tried.append(rung)
    ladder.stack.all_on()
    if len(tried) < 2:
        for i in sorted(inserted, reverse=True):
            ladder.stack.remove(i)
        ladder.stack.all_on()
        ladder.snapshot.restore()
        return [], reference
    label = " + ".join(r.name for r in tried)
    ladder.on_event(f"remedy: {label} together")
    parity: Parity | None = None
    paired = None
    try:
        n = len(ladder.slots)
        losses, parity, problem = judge_inserted(ladder, inserted, reference)
        if problem:
            raise RungProblem(problem)
        without = [i not in inserted for i in range(n)]
        paired = compare(
            ladder,
            lambda on: ladder.stack.configure([True] * n if on else without),
            "remedy",
            shared_batches=ladder.stack.shares_batches(),
            grant=lambda: ladder.budget.for_group([r.name for r in tried]),
        )
        for i in inserted:  # a change that stopped working while timed: not what was timed
            problem = agreed_problem(ladder.slots[i].handle)
            if problem:
                raise RungProblem(problem)
        status, why = comparison.decide(ladder.cfg, paired, all(r.memory_comparable for r in tried))
    except Exception as exc:
        ladder.stop.reraise(exc)  # a signal or a dead loader stops the trials: no rung's failure
        status, why = "failed", str(exc) if isinstance(exc, RungProblem) else f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        ladder.stack.all_on()
        ladder.snapshot.restore()
    row = RungResult(
        f"remedy: {label}",
        "closing",
        precision=ladder.state.precision,
        changes=[f"applied {label} together"],
        parity=parity,
        comparison=paired,
        measurement=paired.b if paired is not None else None,
        reason=f"the diagnosed bottleneck's remedy together: {why}",
    )
    record(ladder, "the remedy", [r.name for r in tried], status == "kept", paired, why)
    if status != "kept":
        for i in sorted(inserted, reverse=True):
            ladder.stack.remove(i)
        ladder.stack.all_on()
        row.reason += "; undone, each tried on its own"
        row.seconds = ladder.host_clock() - t0
        result.rungs.append(row)
        ladder.on_event(f"remedy: {label} not kept together ({why}): each tried on its own")
        return [], reference
    assert paired is not None
    names = tuple(r.name for r in tried)
    for rung in tried:
        slot = next(s for s in ladder.slots if s.rung is rung)
        result.rungs.append(
            kept_entry(
                slot,
                ladder.state.precision,
                f"kept with the remedy's bundle ({label}), their figure together: {describe(paired)}",
                parity=parity,
                comparison=paired,
                measurement=paired.b,
            )
        )
        ladder.last_comparison[rung.name] = paired
    ladder.judged.add((names, tuple(s.rung.name for s in ladder.slots if s.rung not in tried)))
    row.seconds = ladder.host_clock() - t0
    ladder.on_event(f"remedy: {label} kept together ({why}); each judged within it")
    for entry in result.rungs:
        if entry.name in names and entry.status == "kept":
            entry.seconds = (ladder.host_clock() - t0) / len(names)
    return list(names), losses
