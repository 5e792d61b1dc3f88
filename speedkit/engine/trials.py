"""What the ladder's phases read and call on the ladder: :class:`Trials`, a protocol the
:class:`~speedkit.engine.ladder.Ladder` satisfies.

The phases (:mod:`~speedkit.engine.baseline`, :mod:`~speedkit.engine.cache_check`,
:mod:`~speedkit.engine.switches`, :mod:`~speedkit.engine.climb`, :mod:`~speedkit.engine.trial`,
:mod:`~speedkit.engine.remedy`, :mod:`~speedkit.engine.closing_check`, :mod:`~speedkit.engine.second_look`,
:mod:`~speedkit.engine.confirm`, :mod:`~speedkit.engine.profile_run`) are verbs of the ladder, run in the
order it runs them (diagnose, plan, decide, confirm); :mod:`~speedkit.engine.comparison` times, judges
and records their decisions. They type against this protocol, not the ladder's class: the
ladder imports its phases and no phase imports the ladder, for running or for type checking.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: none of these imports the ladder
    import torch

    from speedkit.engine.budget import TrialBudget
    from speedkit.engine.cache import DecisionCache
    from speedkit.engine.diagnose import Diagnosis
    from speedkit.engine.parity import ParityCheck
    from speedkit.engine.stack import Slot, Stack
    from speedkit.engine.stop import StopRequests
    from speedkit.engine.timing import Timing
    from speedkit.measure.clock import StepClock
    from speedkit.measure.config import MeasureConfig
    from speedkit.measure.session import MeasureSession
    from speedkit.results import LadderResult, PairedResult, RungResult
    from speedkit.rungs.base import Rung
    from speedkit.training.snapshot import Snapshot
    from speedkit.training.state import TrainState


class Trials(Protocol):
    """The trials in progress, as a phase sees them (the attributes are documented on the ladder)."""

    state: TrainState
    cfg: MeasureConfig
    rungs: list[Rung]
    result: LadderResult | None
    stack: Stack
    parity: ParityCheck
    snapshot: Snapshot | None
    timing: Timing | None
    session: MeasureSession | None
    budget: TrialBudget
    stop: StopRequests
    clock: StepClock
    host_clock: Callable[[], float]
    decision_clock: Callable[[], float]
    on_event: Callable[[str], None]
    trace_dir: Path | None
    planned_steps: int | None
    last_comparison: dict[str, PairedResult]
    judged: set[tuple[tuple[str, ...], tuple[str, ...]]]
    failed_beneath: dict[str, tuple[str, ...]]
    remedy: set[str]
    floor: set[str]
    floor_row: RungResult | None
    steps_ms: tuple[float, float]
    diagnosis: Diagnosis | None
    trial_compile_s: float
    floor_compile_s: float
    cache: DecisionCache | None
    cache_key: str | None
    start_digest: str | None
    settings: dict[str, object]
    on_progress: Callable[[int, int, str], None]

    @property
    def phase(self) -> str: ...

    @phase.setter
    def phase(self, value: str) -> None: ...

    @property
    def slots(self) -> list[Slot]: ...

    def entry(self, name: str) -> RungResult | None: ...

    def trying(self, entry: RungResult | None, slot: Slot | None = None) -> None: ...

    def optimizers(self) -> list[torch.optim.Optimizer]: ...

    def note_budget(self, what: str) -> None: ...
