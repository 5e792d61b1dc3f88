"""A decision between two configurations of the ladder's stack: timed within its share of the trials'
budget (:func:`compare`), judged by the decision rule (:func:`decide`), and recorded in the run's
ledger (:func:`record`), whose paired comparisons every printed figure is derived from
(:func:`speedkit.figures.account.account`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from speedkit import distributed
from speedkit.measure.config import MeasureConfig
from speedkit.measure.stats import describe, not_slower
from speedkit.results import PairedResult, comparison_figure

if TYPE_CHECKING:
    from speedkit.engine.trials import Trials

#: the closing phases whose comparisons draw on the share of the budget held back for them, in order
CLOSING_COMPARISONS = ("the switches", "the final check", "the floor against the baseline", "the scaling")


def decide(cfg: MeasureConfig, paired: PairedResult, memory_comparable: bool = True) -> tuple[str, str]:
    """Kept where B is decided faster than A by at least ``min_gain`` (or leaner in peak memory by
    ``memory_gain`` and shown not slower); else reverted, said why."""
    if paired.verdict == "faster":
        return "kept", describe(paired)
    if not memory_comparable:  # its peak memory is not what the allocator's peak shows
        return "reverted", (
            f"not shown to pay within the budget: {describe(paired)}" if paired.verdict == "undecided" else describe(paired)
        )
    a_mem = paired.a.peak_memory_bytes if paired.a else None
    b_mem = paired.b.peak_memory_bytes if paired.b else None
    if a_mem and b_mem is not None and b_mem < a_mem * (1 - cfg.memory_gain) and not_slower(paired, cfg.min_gain):
        return "kept", f"{1 - b_mem / a_mem:.0%} less peak memory, not slower ({describe(paired)})"
    if paired.verdict == "undecided":
        return "reverted", f"not shown to pay within the budget: {describe(paired)}"
    return "reverted", describe(paired)


def compare(
    ladder: Trials,
    set_candidate: Callable[[bool], None],
    label: str,
    shared_batches: bool = True,
    weight_of: str | None = None,
    whole_budget: bool = False,
    grant: Callable[[], float] | None = None,
) -> PairedResult:
    """Time the current configuration (A) against the candidate (B) (:meth:`Timing.compare`; leaves A
    on) within the comparison's budget: a closing phase's share of what the budget has left for them
    (:meth:`TrialBudget.for_closing`), else the rungs' share weighted by the bound of the rung it
    decides (``weight_of``: :meth:`TrialBudget.for_comparison`), or with ``whole_budget`` all the
    rungs' time left; ``grant``: the phase's own share (the floor's: :meth:`TrialBudget.for_floor`)."""
    assert ladder.timing is not None
    budget = ladder.budget

    def seconds() -> float:
        if grant is not None:
            return grant()
        if ladder.phase in CLOSING_COMPARISONS:
            return budget.for_closing(len(CLOSING_COMPARISONS) - CLOSING_COMPARISONS.index(ladder.phase))
        if whole_budget:
            return budget.for_comparison(None, whole=True)
        return budget.for_comparison(weight_of)

    with distributed.together():  # a comparison that raised on one rank ends on every rank
        return ladder.timing.compare(set_candidate, label, seconds, shared_batches=shared_batches)


def record(
    ladder: Trials,
    phase: str,
    names: Iterable[str],
    kept: bool,
    paired: PairedResult | None = None,
    why: str = "",
    *,
    also: Iterable[dict] = (),
) -> None:
    """Append a decision to the run's ledger: ``names`` kept (or dropped) together by ``phase``, their
    figure ``paired`` (with the figures in ``also``, e.g. a group's less a member left out of it; none
    where the decision stands on an earlier one's)."""
    assert ladder.result is not None
    comparisons = ([comparison_figure(paired, label=phase)] if paired is not None else []) + list(also)
    ladder.result.decide(phase, list(names), kept, comparisons, why)


def link_of(ladder: Trials, name: str) -> dict | None:
    """The account's link of kept rung ``name`` in the chain as recorded so far (its names, figure and
    the comparisons it stands on; None where it is not kept)."""
    assert ladder.result is not None
    figures = ladder.result.figures()
    return next((link for link in figures["links"] if name in link["names"]), None)


def revert(ladder: Trials, names: list[str], phase: str, why: str, paired: PairedResult | None) -> list[str]:
    """Undo the kept rungs ``names`` (and those that cannot work without them), their rows reverted, said
    why, the decision recorded. Returns every name undone."""
    gone: list[str] = []
    for name in reversed([s.rung.name for s in ladder.slots if s.rung.name in names]):
        index = next((i for i, s in enumerate(ladder.slots) if s.rung.name == name), None)
        if index is None:  # undone already, with a rung it needs
            continue
        gone += [name, *ladder.stack.remove(index)]
    ladder.stack.all_on()
    for name in gone:
        entry = ladder.entry(name)
        if entry is not None:
            entry.status = "reverted"
            entry.reason = f"{entry.reason}; reverted by {phase}: {why}"
    record(ladder, phase, gone, False, paired, why)
    return gone
