"""The A/B comparison: two configurations timed in interleaved A B B A blocks until the paired
decision is made (:mod:`speedkit.measure.stats`), the blocks run out or the time does.

:func:`compare` knows nothing of rungs or models: it is given a switch between the configurations
(B on or off) and a timer of one window of the configuration in effect. The ladder calls it for
every decision; the benchmarks call it for their own side-by-side comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from speedkit.measure.stats import Comparison, block_log_gain, decide, looks


class Timed(Protocol):
    """What a timed window gives the comparison: its mean step time."""

    ms: float


W = TypeVar("W", bound=Timed)


class Rule(Protocol):
    """The settings a comparison decides by (a :class:`~speedkit.measure.config.MeasureConfig` has them)."""

    min_gain: float
    confidence: float
    min_blocks: int
    max_blocks: int


@dataclass
class Paired(Generic[W]):
    """A comparison's decision and the windows behind it."""

    comparison: Comparison
    a: list[W] = field(default_factory=list)  # the windows of A (B off), in the order timed
    b: list[W] = field(default_factory=list)  # those of B


def compare(
    switch: Callable[[bool], None],
    time_window: Callable[[], W],
    rule: Rule,
    *,
    budget_s: float,
    clock: Callable[[], float],
    settle: Callable[[], Any] = lambda: None,
    start_block: Callable[[Callable[[bool], bool]], Any] | None = None,
    on_look: Callable[[Comparison], Any] = lambda c: None,
) -> Paired[W]:
    """Time A (the configuration in effect, B off) against B in A B B A blocks; decide at the looks
    of :func:`~speedkit.measure.stats.looks` (``min_blocks`` to ``max_blocks``), and stop at the
    first decision, at ``max_blocks``, or at the first look after ``budget_s`` seconds of ``clock``
    (counted from this call, at least ``min_blocks`` blocks). Leaves A on.

    Args:
        switch: puts B on (True) or off (False); called only when that changes the configuration.
        time_window: times one window of the configuration in effect.
        settle: runs after each switch, before the next window (untimed steps).
        start_block: called before each block with the switch (which returns whether it changed the
            configuration, and does not settle): e.g. to draw the batches the block's windows share and
            warm both configurations on them.
        on_look: called with each look's decision.
    """
    on = False

    def change(candidate: bool) -> bool:
        nonlocal on
        if candidate == on:
            return False
        switch(candidate)
        on = candidate
        return True

    timed_from = clock()
    out: Paired[W] = Paired(comparison=None)  # type: ignore[arg-type]
    gains: list[float] = []
    stops = looks(rule.min_blocks, rule.max_blocks)
    while True:
        if start_block is not None:
            start_block(change)
        block: dict[bool, list[W]] = {False: [], True: []}
        for candidate in (False, True, True, False):
            if change(candidate):
                settle()
            block[candidate].append(time_window())
        out.a += block[False]
        out.b += block[True]
        gains.append(block_log_gain((block[False][0].ms, block[False][1].ms), (block[True][0].ms, block[True][1].ms)))
        out_of_budget = len(gains) >= rule.max_blocks or (len(gains) >= rule.min_blocks and clock() - timed_from > budget_s)
        if len(gains) not in stops and not out_of_budget:
            continue
        out.comparison = decide(gains, min_gain=rule.min_gain, confidence=rule.confidence, n_looks=len(stops))
        on_look(out.comparison)
        if out.comparison.verdict != "undecided" or out_of_budget:
            break
    change(False)
    return out
