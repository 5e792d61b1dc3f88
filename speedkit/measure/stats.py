"""Deciding "is B faster than A?" from interleaved windows, so that noise and drift decide nothing.

The two configurations are timed in blocks of four windows in the order A B B A. Within a block the
two A windows sit on either side of the two B windows, so a drift that is linear over the block
(a warming GPU, a throttling CPU, a neighbour's load ramping up) adds the same to both means and
cancels in their ratio. Each block gives one paired estimate of the log speedup,

    r = (ln A₁ + ln A₂ − ln B₁ − ln B₂) / 2,

blocks are disjoint and so independent, and the decision is a Student-t confidence interval on
their mean at the stated confidence:

* **faster** — the whole interval is above ``ln(1 + min_gain)``: B pays by at least ``min_gain``;
* **not faster** — the whole interval is below it: whatever B gains is less than ``min_gain``;
* **undecided** — the interval straddles it: the caller adds blocks, within its budget, and treats a
  comparison still undecided at the end as "not shown to pay".

Looking at the data after every block and stopping at the first decision would make a "faster"
verdict on a change that gains nothing several times likelier than the stated confidence allows
(7.5% instead of 2.5% in a simulation at ±25% window noise). So decisions are taken only at
:func:`looks` — block counts growing by about a third — and each look's interval is widened so that
the error probabilities of all looks together stay within the stated confidence (Bonferroni).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Literal

Verdict = Literal["faster", "not_faster", "undecided"]


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom: closed forms for 1 and 2,
    bisection on the numerically integrated CDF up to 30, a Cornish-Fisher expansion above
    (within 0.1% there)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"need 0 < p < 1 and df >= 1, found p={p}, df={df}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    if p < 0.5:
        return -t_quantile(1 - p, df)
    if df <= 30:
        lo, hi = 0.0, 1.0
        while _t_cdf(hi, df) < p:
            hi *= 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
        return (lo + hi) / 2
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def _t_cdf(t: float, df: int, intervals: int = 400) -> float:
    """P(T <= t) for t >= 0, Simpson's rule on the density over [0, t] (in atan-substituted
    coordinates, so heavy tails need no more intervals)."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    # t = sqrt(df) tan(u): dt = sqrt(df) sec^2(u) du; the density times dt is smooth in u
    end = math.atan(t / math.sqrt(df))

    def f(u: float) -> float:
        x = math.sqrt(df) * math.tan(u)
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df)) * math.sqrt(df) / math.cos(u) ** 2

    h = end / intervals
    total = f(0.0) + f(end) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, intervals))
    return 0.5 + total * h / 3


def block_log_gain(a_ms: tuple[float, float], b_ms: tuple[float, float]) -> float:
    """One A B B A block's estimate of ln(speedup of B over A)."""
    return (math.log(a_ms[0]) + math.log(a_ms[1]) - math.log(b_ms[0]) - math.log(b_ms[1])) / 2


@dataclass
class Comparison:
    """The paired estimate of B's speedup over A, with its confidence interval."""

    speedup: float  # exp(mean log gain): > 1 means B is faster
    low: float  # lower end of the confidence interval of the speedup
    high: float  # upper end
    confidence: float  # e.g. 0.95
    blocks: int  # A B B A blocks measured
    verdict: Verdict
    min_gain: float

    def describe(self) -> str:
        return describe(self)


def describe(c: Comparison | Any) -> str:
    """One line for a comparison (or a report's record of one): the speedup, its interval, the verdict."""
    ci = f"{c.speedup:.3f}x, {c.confidence:.0%} CI [{c.low:.3f}, {c.high:.3f}] over {c.blocks} A/B blocks"
    threshold = 1 + c.min_gain
    if c.verdict == "faster":
        return f"{ci}: faster by more than the {threshold:.2f}x minimum"
    if c.verdict == "not_faster":
        return f"{ci}: not faster by the {threshold:.2f}x minimum"
    return f"{ci}: undecided against the {threshold:.2f}x minimum"


def looks(min_blocks: int, max_blocks: int) -> list[int]:
    """The block counts at which a comparison may stop: ``min_blocks``, then about a third more each
    time, and ``max_blocks``."""
    out = [min_blocks]
    while out[-1] < max_blocks:
        out.append(min(max_blocks, max(out[-1] + 1, math.ceil(out[-1] * 4 / 3))))
    return out


def decide(log_gains: list[float], *, min_gain: float, confidence: float, n_looks: int = 1) -> Comparison:
    """Judge B against A from the per-block log gains (see the module docstring); ``n_looks`` is how
    many looks the whole comparison may take (each look's interval is widened for them)."""
    n = len(log_gains)
    if n == 0:
        raise ValueError("no blocks to decide on")
    mean = statistics.fmean(log_gains)
    if n < 2:
        return Comparison(math.exp(mean), 0.0, math.inf, confidence, n, "undecided", min_gain)
    per_look = 1 - (1 - confidence) / max(1, n_looks)
    half = t_quantile(0.5 + per_look / 2, n - 1) * statistics.stdev(log_gains) / math.sqrt(n)
    low, high = mean - half, mean + half
    threshold = math.log1p(min_gain)
    verdict: Verdict = "faster" if low > threshold else "not_faster" if high < threshold else "undecided"
    return Comparison(math.exp(mean), math.exp(low), math.exp(high), confidence, n, verdict, min_gain)


def not_slower(comparison: Comparison | Any, tolerance: float) -> bool:
    """B is, with the comparison's confidence, no slower than A by more than ``tolerance``."""
    return comparison.blocks >= 2 and comparison.low >= 1 - tolerance
