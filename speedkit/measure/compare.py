"""The A/B comparison: two configurations timed in interleaved A B B A blocks until the paired
decision is made (:mod:`speedkit.measure.stats`: a planned design of one or two looks), or the time runs out.

:func:`compare` knows nothing of rungs or models: it is given a switch between the configurations
(B on or off) and a timer of one window of the configuration in effect. The ladder calls it for
every decision; the benchmarks call it for their own side-by-side comparisons.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from speedkit.measure.stats import Comparison, Design, block_log_gain, decide, plan, t_quantile


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
    detect_gain: float
    power: float


@dataclass
class Paired(Generic[W]):
    """A comparison's decision and the windows behind it."""

    comparison: Comparison
    a: list[W] = field(default_factory=list)  # the windows of A (B off), in the order timed
    b: list[W] = field(default_factory=list)  # those of B
    design: Design | None = None  # the looks it planned (the final one as sized after the early look)
    stopped_by_budget: bool = False  # the final look came early: the next block would have overrun the budget


def futile(gains: list[float], rule: Rule) -> bool:
    """Whether an early look's per-block log gains show the comparison cannot pay: their mean under
    ``ln(1 + min_gain)`` and its one-sided 95% upper bound under ``ln(1 + detect_gain)``."""
    n, mean = len(gains), statistics.fmean(gains)
    if mean >= math.log1p(rule.min_gain):
        return False
    if n < 2:
        return True
    upper = mean + t_quantile(0.95, n - 1) * statistics.stdev(gains) / math.sqrt(n)
    return upper < math.log1p(rule.detect_gain)


def compare(
    switch: Callable[[bool], None],
    time_window: Callable[[], W],
    rule: Rule,
    *,
    budget_s: float,
    clock: Callable[[], float],
    noise: float | None = None,
    settle: Callable[[], Any] = lambda: None,
    start_block: Callable[[Callable[[bool], bool]], Any] | None = None,
    on_look: Callable[[Comparison], Any] = lambda c: None,
) -> Paired[W]:
    """Time A (the configuration in effect, B off) against B in A B B A blocks, decide at the looks of
    the design :func:`~speedkit.measure.stats.plan` makes for ``noise`` (the SD of one block's log gain
    the caller expects, from the baseline's windows; None: unknown), and stop at the early look's
    decision, at the final look, or before a block that would end past ``budget_s`` seconds of ``clock``
    (counted from this call; at least ``min_blocks`` blocks), whose final look is then taken on the
    blocks it has. Leaves A on.

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
    design = plan(rule, noise)
    out: Paired[W] = Paired(comparison=None, design=design)  # type: ignore[arg-type]
    gains: list[float] = []
    while True:
        block_from = clock()
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
        n, now = len(gains), clock()
        # the next block would end past the budget (each block takes about as long as the last one did)
        out_of_budget = n >= rule.min_blocks and now + (now - block_from) - timed_from > budget_s
        if n == design.early and design.looks == 2:
            out.comparison = decide(gains, min_gain=rule.min_gain, alpha=design.alpha_early)
            on_look(out.comparison)
            # decided; or futile: a gain under the minimum so far, with even the optimistic end of a 90%
            # interval under the gain the comparison is sized for (a 5% gain at 3% noise shows that at 4
            # blocks in under 1% of comparisons; stopping keeps nothing, so it costs no error). The
            # interval keeps a noisy early look going: on a 2-core CPU a 6% gain read 0.996x
            # [0.821, 1.208] at 3 blocks and had stopped there, in one demo of three.
            if out.comparison.verdict != "undecided" or futile(gains, rule):
                break
            design = out.design = design.resized(statistics.stdev(gains), rule)
        if n >= design.final or out_of_budget:
            out.stopped_by_budget = out_of_budget and n < design.final
            out.comparison = decide(gains, min_gain=rule.min_gain, alpha=design.alpha_final)
            on_look(out.comparison)
            break
    change(False)
    return out
