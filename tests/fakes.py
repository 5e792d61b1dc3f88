"""A virtual timeline for engine tests: steps cost what a test says, drift and window noise included.

:class:`VirtualTime` is both the step clock's backend and the host clock, so the ladder, its
measurement session and its budget all read one deterministic time line. :class:`CostStep` wraps a
real step (real losses for parity) and spends its cost on that time line; rungs that change speed
wrap the step again with a :class:`CostStep` of their own. No test sleeps or reads the wall clock.
"""

from __future__ import annotations

import random
from typing import Any

from speedkit.handle import set_attr
from speedkit.measure.clock import StepClock
from speedkit.rungs.base import Handle, Rung
from speedkit.training.step import StepWrapper


class VirtualTime:
    """A clock backend and a host clock over one virtual time line (seconds).

    Args:
        drift: the step cost grows linearly by this fraction over ``horizon`` steps (0.3: +30%).
        noise: each window's costs are multiplied by a factor drawn uniformly in [1 - noise, 1 + noise].
        seed: of the noise.
    """

    name = "virtual"

    def __init__(self, *, drift: float = 0.0, noise: float = 0.0, horizon: int = 5000, seed: int = 0) -> None:
        self.now = 0.0
        self.drift, self.noise, self.horizon = drift, noise, horizon
        self.rng = random.Random(seed)
        self.factor = 1.0
        self.steps = 0
        self.waits = 0

    # host clock
    def __call__(self) -> float:
        return self.now

    # clock backend
    def reset(self) -> None:
        self.factor = 1.0 + self.rng.uniform(-self.noise, self.noise)

    def mark(self) -> float:
        return self.now

    def synchronize(self, mark: float) -> None:
        self.waits += 1

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def spend(self, seconds: float) -> None:
        self.now += seconds * self.factor * (1.0 + self.drift * min(self.steps / self.horizon, 1.0))

    def clock(self) -> StepClock:
        import torch

        return StepClock(torch.device("cpu"), backend=self)


class CostStep(StepWrapper):
    """The step it wraps, then ``seconds`` of virtual time. The innermost one (``counts=True``)
    carries the configuration's base cost and counts steps for the drift; rungs that change speed
    wrap it again with an extra (negative: a speed-up)."""

    def __init__(self, inner: Any, time: VirtualTime, seconds: float, counts: bool = True) -> None:
        super().__init__(inner)
        self.time, self.seconds, self.counts = time, seconds, counts

    def __call__(self, batches: Any, batch_idx: int) -> Any:
        loss = self.inner(batches, batch_idx)
        self.time.spend(self.seconds)
        self.time.steps += self.counts
        return loss


class SpeedRung(Rung):
    """A rung that changes the step's cost by ``change`` (a fraction of ``base``: -0.1 = 10% faster),
    by wrapping ``state.step``; numerics untouched."""

    def __init__(self, name: str, time: VirtualTime, base: float, change: float) -> None:
        super().__init__()
        self.name, self.time, self.base, self.change = name, time, base, change
        self.applied = 0

    def apply(self, state: Any) -> Handle:
        self.applied += 1
        handle = Handle(self.name)
        set_attr(
            handle,
            state,
            "step",
            CostStep(state.step, self.time, self.base * self.change, counts=False),
            f"step cost {self.change:+.0%}",
        )
        return handle


def timed_state(time: VirtualTime, base: float = 0.01):
    """The tiny MLP state whose step costs ``base`` virtual seconds."""
    from conftest import mlp_state

    state = mlp_state()
    state.step = CostStep(state.step, time, base)
    return state
