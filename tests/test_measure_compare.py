"""speedkit.measure.compare: the A/B comparison the ladder and the benchmarks share, on fake windows."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from speedkit.measure.compare import compare

RULE = SimpleNamespace(min_gain=0.01, confidence=0.95, min_blocks=3, max_blocks=12, detect_gain=0.045, power=0.95)


def _pair(a_ms: float, b_ms: float, noise: float = 0.0):
    """A switch and a window timer over two configurations of fixed step times (with alternating noise)."""
    state = {"on": False, "order": [], "switches": 0, "n": 0}

    def switch(on: bool) -> None:
        state["on"] = on
        state["switches"] += 1

    def window() -> SimpleNamespace:
        state["n"] += 1
        state["order"].append("B" if state["on"] else "A")
        ms = (b_ms if state["on"] else a_ms) * (1 + noise * (-1) ** state["n"])
        return SimpleNamespace(ms=ms)

    return state, switch, window


def test_faster_b_is_kept_after_the_minimum_of_blocks_in_abba_order_and_a_is_left_on():
    state, switch, window = _pair(10.0, 8.0, noise=0.01)
    paired = compare(switch, window, RULE, budget_s=1e9, clock=lambda: 0.0)
    assert paired.comparison.verdict == "faster" and paired.comparison.blocks == 3
    assert paired.comparison.speedup == pytest.approx(1.25, rel=0.02)
    assert "".join(state["order"]) == "ABBA" * 3 and state["on"] is False
    assert len(paired.a) == len(paired.b) == 6


def test_an_even_pair_is_not_faster_and_settle_runs_after_each_switch():
    state, switch, window = _pair(10.0, 10.0, noise=0.001)
    settled = []
    looks = []
    paired = compare(
        switch, window, RULE, budget_s=1e9, clock=lambda: 0.0, settle=lambda: settled.append(state["on"]), on_look=looks.append
    )
    assert paired.comparison.verdict == "not_faster" and looks[-1] is paired.comparison
    assert settled[:2] == [True, False]  # after A -> B and B -> A, within each block


def test_the_budget_stops_an_undecided_comparison_before_a_block_that_would_overrun_it():
    now = [0.0]
    state, switch, window = _pair(10.0, 10.2, noise=0.2)

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    paired = compare(switch, window, RULE, budget_s=0.5, clock=clock)
    assert paired.comparison.blocks == RULE.min_blocks and state["on"] is False


def test_a_block_that_would_end_past_the_budget_is_not_begun_and_the_final_look_is_taken_on_what_there_is():
    now, rng, state = [0.0], random.Random(3), {"on": False}

    def switch(on: bool) -> None:
        state["on"] = on

    def timed() -> SimpleNamespace:
        now[0] += 1.0  # each window takes a second: a block four
        return SimpleNamespace(ms=(9.7 if state["on"] else 10.0) * math.exp(rng.gauss(0.0, 0.03)))

    paired = compare(switch, timed, RULE, budget_s=30.0, clock=lambda: now[0], noise=0.03)
    # blocks end at 4, 8, ... s; after the 7th (28 s) an 8th would end at 32 s > 30 s
    assert paired.comparison.blocks == 7 and paired.stopped_by_budget and now[0] <= 30.0
    assert paired.design.final > 7 and state["on"] is False


def test_an_early_look_under_the_minimum_stops_only_where_its_noise_cannot_hide_the_sized_gain():
    """Futility at the early look: a mean under the minimum gain stops the comparison where even the
    optimistic end of its interval is under the gain the comparison is sized for; with noise that
    could hide that gain it goes on (on a 2-core CPU a 6% gain read 0.996x [0.821, 1.208] at 3 blocks
    and had stopped there)."""
    import math

    from speedkit.measure.compare import futile
    from speedkit.measure.config import MeasureConfig

    rule = MeasureConfig.from_dict({"min_gain": 0.03, "detect_gain": 0.06})
    quiet = [math.log(x) for x in (0.99, 1.00, 1.01, 0.995)]
    noisy = [math.log(x) for x in (0.85, 1.20, 0.95)]
    assert futile(quiet, rule)
    assert not futile(noisy, rule)
    assert not futile([math.log(1.04)] * 3, rule)  # past the minimum: never futile
