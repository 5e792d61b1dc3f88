"""Timing configurations of the ladder's stack (:class:`Timing`): one step of the configuration in
effect fed by the data source, a configuration alone, and two against each other in interleaved
A B B A blocks (:func:`speedkit.measure.compare.compare`); a heartbeat for long silent phases.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any

from speedkit.data.source import BatchSource
from speedkit.engine.budget import steps_for_window
from speedkit.engine.stack import Stack
from speedkit.measure.clock import summarize
from speedkit.measure.compare import compare
from speedkit.measure.config import MeasureConfig
from speedkit.measure.session import MeasureSession
from speedkit.measure.stats import Comparison
from speedkit.results import Measurement, PairedResult
from speedkit.training.snapshot import Snapshot
from speedkit.training.state import TrainState

#: rounds of a loader's workers read for its pace (:meth:`Timing.loader_pace_ms`), after its buffer and one
#: round, each timed on its own: their spread is the pace's noise
PACE_ROUNDS = 3
#: ... and at least this many reads in all
PACE_READS = 9
#: the pace under steps (:meth:`Timing.pace_under_steps`): its queues read away in at most this many times
#: their length and a round of its workers ...
DRAIN_ROUNDS = 3
#: ... until a step waited this share of the loader's pace alone for its batch (else the queues never
#: empty: the steps are slower than the loader, whose pace alone stands) ...
DRAIN_WAIT = 0.25
#: ... then its rounds timed with the steps, taken as the pace where the steps waited this share of them
LOADER_BOUND_WAIT = 0.25


class Timing:
    """Times configurations of ``stack`` on ``state`` through ``session``, each window from
    ``snapshot`` (weights and schedule; the RNG runs on).

    ``window_steps``: optimizer steps per window of the A/B comparisons (sized by time from the
    baseline, :func:`speedkit.engine.budget.window_steps`, then for each comparison again from the
    step time last measured for the configuration in effect: :meth:`size_windows`); ``noise``: the planned noise of one block's
    log gain (the baseline's window spread), which sizes each comparison's design; ``shapes_vary``: batches differ in shape
    (padded to each batch's longest sequence): each A/B block then times both configurations on the
    same batches, whose work would otherwise differ more between windows than most rungs change it.
    """

    def __init__(
        self,
        state: TrainState,
        cfg: MeasureConfig,
        session: MeasureSession,
        stack: Stack,
        snapshot: Snapshot,
        *,
        host_clock: Callable[[], float],
        on_event: Callable[[str], None],
        shapes_vary: bool,
        poll: Callable[[], None] = lambda: None,
    ) -> None:
        self.state, self.cfg, self.session, self.stack, self.snapshot = state, cfg, session, stack, snapshot
        self.host_clock, self.on_event = host_clock, on_event
        self.shapes_vary = shapes_vary
        #: called before each step it runs: raises where the trials must stop (a signal came)
        self.poll = poll
        self.window_steps = cfg.steps
        self.noise: float | None = None
        self._iterators: dict[int, Iterator[Any]] = {}
        #: per data source with workers: the pace it sustains, ms per batch (:meth:`loader_pace_ms`), and
        #: what measuring it read (for the report)
        self._pace_ms: dict[int, float] = {}
        #: ... and its noise: the spread of its rounds (robust relative std, as a measurement's)
        self._pace_spread: dict[int, float] = {}
        self.paces: list[dict[str, Any]] = []
        #: ms per step last measured for each configuration of the stack (the names of the rungs on)
        self._step_ms: dict[tuple[str, ...], float] = {}
        #: each time the windows were sized again for a comparison (for the report)
        self.resized: list[dict[str, Any]] = []

    def close(self) -> None:
        """Forget the data sources' iterators (the trials are over)."""
        self._iterators.clear()

    def settle(self) -> int:
        """Untimed steps after switching configuration (:meth:`Stack.settle`)."""
        return self.stack.settle(self.cfg.settle)

    def runner(self, batches: list[Any] | None = None) -> Callable[[], None]:
        """One step of the current configuration, fed by the current data source's iterator, or by
        ``batches`` (the block's own, see ``shapes_vary``) where given."""
        state, poll = self.state, self.poll
        source = iter(batches) if batches is not None else self.source_iterator()

        def step(micro: Any, i: int) -> Any:
            poll()  # inside a measurement too: a signal stops the trials within a step, not a comparison
            return state.step(micro, i)

        return self.session.runner(step, source, state.step.accumulate)

    def source_iterator(self) -> Iterator[Any]:
        """The current data source's iterator, made on first use and kept across windows. Beneath
        wrappers that only map batches (channels_last), the source they wrap is iterated and its
        batches mapped: both configurations of a comparison read one stream, and a source serving
        one live iterator at a time (data_path's ring: a second iterator closes the first) is never
        asked for another while the first is in use."""
        data = self.state.data
        assert data is not None
        data, maps = data.unmapped()
        batches = self._unmapped_iterator(data)
        for map_batch in reversed(maps):  # the innermost wrapper's first
            batches = map(map_batch, batches)
        return batches

    def _unmapped_iterator(self, data: BatchSource) -> Iterator[Any]:
        if id(data) not in self._iterators:
            self._iterators[id(data)] = data.iterator()
        return self._iterators[id(data)]

    def loader_pace_ms(self) -> float:
        """The least ms per optimizer step the data source in effect allows: the pace its loader's workers
        sustain, measured once per source, times the batches a step reads (0 for a source without
        workers: the reader makes each batch within the step, which the window times).

        Workers keep making batches while nobody reads their source (while the other configuration's
        windows run, or slower steps), and a window then reads that buffer: on an H200 data_path's
        ResNet-18 (14 workers, a batch every 41.8 ms) was timed at 22.6 ms per step against a fit of
        50-57 ms. Reading the buffer away before each window did not help: read all at once, the
        workers start their next batches together, and the next window waits for their round (3-step
        windows then read 13.6-27.8 ms and 20-147 ms in a stand-in whose loader sustains 40.1). So each
        window is bounded below by the pace measured here: every batch the source holds and one round of
        its workers read and let go, then :data:`PACE_ROUNDS` rounds (at least :data:`PACE_READS`
        batches) read back to back, timed."""
        data = self.state.data
        if data is None:
            return 0.0
        data, _ = data.unmapped()
        workers = data.workers()
        if workers <= 0:
            return 0.0
        key = id(data)
        if key not in self._pace_ms:
            batches, clock = self._unmapped_iterator(data), self.host_clock
            settle, per_round = data.buffered_at_most() + workers, max(workers, math.ceil(PACE_READS / PACE_ROUNDS))
            rounds: list[float] = []  # ms per batch, each round's
            data.reading_ahead = True  # a source recording its waits leaves these reads out
            try:
                began = clock()
                for _ in range(settle):
                    next(batches)
                for _ in range(PACE_ROUNDS):
                    start = clock()
                    for _ in range(per_round):
                        next(batches)
                    rounds.append((clock() - start) / per_round * 1e3)
            finally:
                data.reading_ahead = False
            alone_ms = sum(rounds) / len(rounds)
            pace = {
                "source": type(data).__name__,
                "workers": workers,
                "alone_ms_per_batch": round(alone_ms, 3),
                "alone_rounds_ms": [round(r, 3) for r in rounds],
                "batches": settle + PACE_ROUNDS * per_round,
            }
            under = self.pace_under_steps(data, batches, alone_ms, per_round)
            pace["under_steps"] = under
            if under.get("rounds_ms") and under["loader_bound"]:
                rounds = under["rounds_ms"]
            self._pace_ms[key] = max(alone_ms, sum(rounds) / len(rounds))
            self._pace_spread[key] = summarize(rounds)[1]
            pace.update(
                ms_per_batch=round(self._pace_ms[key], 3),
                spread=round(self._pace_spread[key], 4),
                seconds=round(clock() - began, 3),
            )
            self.paces.append(pace)
        return self._pace_ms[key] * self.state.step.accumulate

    def pace_under_steps(self, data: BatchSource, batches: Iterator[Any], alone_ms: float, per_round: int) -> dict[str, Any]:
        """The pace ``data``'s loader keeps while the configuration in effect steps on its batches, where it
        bounds them: its queues read away in untimed steps until one waited for its batch (at most
        :data:`DRAIN_ROUNDS` times their length and a round of workers), then :data:`PACE_ROUNDS` rounds
        of ``per_round`` batches timed with the steps. The step's host work contends with the workers:
        on an H100 a data_path ResNet-18 (14 workers) kept 45.9 ms a batch read alone and 51.2 ms a step
        in the fit. ``loader_bound``: the queues emptied and the steps waited :data:`LOADER_BOUND_WAIT` of
        the rounds' time or more (their pace is then the loader's under steps, not the steps' own; else
        ``alone_ms`` stands). Not across several processes (each rank would run its own number of
        steps, and their collectives would wait for each other): the pace read alone stands there."""
        clock, poll, step = self.host_clock, self.poll, self.state.step
        accumulate = step.accumulate
        most, drained = DRAIN_ROUNDS * (data.buffered_at_most() + data.workers()), 0
        out: dict[str, Any] = {"loader_bound": False}
        if step.world_size() > 1:  # each rank's steps would stop at its own count: their collectives would hang
            out["note"] = "not measured across several processes: the pace read alone stands"
            return out

        def waited_s(i: int) -> float:  # one step on the next batches: the seconds it waited for them
            poll()
            t0 = clock()
            micro = [next(batches) for _ in range(accumulate)]
            waited = clock() - t0
            step(micro, i)
            return waited

        began = clock()
        for i in range(most):
            drained += 1
            if waited_s(i) * 1e3 / accumulate >= DRAIN_WAIT * alone_ms:
                break
        else:
            out.update(drain_steps=drained, note="its queues never emptied: the steps are slower than the loader")
            return out
        rounds, waits, steps_per_round = [], 0.0, max(1, math.ceil(per_round / accumulate))
        for _ in range(PACE_ROUNDS):
            start = clock()
            waits += sum(waited_s(i) for i in range(steps_per_round))
            rounds.append((clock() - start) / (steps_per_round * accumulate) * 1e3)
        total_s = sum(rounds) * steps_per_round * accumulate / 1e3
        out.update(
            drain_steps=drained,
            rounds_ms=[round(r, 3) for r in rounds],
            wait_share=round(waits / total_s, 3) if total_s > 0 else None,
            loader_bound=total_s > 0 and waits >= LOADER_BOUND_WAIT * total_s,
            seconds=round(clock() - began, 3),
        )
        return out

    def with_pace_noise(self, measured: Measurement, data: BatchSource | None = None) -> Measurement:
        """``measured`` with its loader's pace noise where the pace bounded it (its median window timed at the
        pace): such windows are one figure, measured once, and read no spread of their own; the pace's
        rounds did vary (on an H100 a data_path ResNet-18 at 14 workers was decided at 45.9 ms a step, ran
        51.2 in the fit and re-timed at 59.0: a cached re-check judged it slower against a 5% slack).
        ``data``: the source it read (default: the one in effect)."""
        data = data if data is not None else self.state.data
        if data is None:
            return measured
        key = id(data.unmapped()[0])
        pace, spread = self._pace_ms.get(key), self._pace_spread.get(key, 0.0)
        if pace is None or not spread or measured.step_ms > pace * self.state.step.accumulate * (1 + 1e-9):
            return measured
        return replace(measured, spread=max(measured.spread, spread))

    def in_effect(self) -> tuple[str, ...]:
        """The configuration in effect: the names of the stack's rungs that are on."""
        return tuple(slot.rung.name for slot in self.stack.slots if slot.on)

    def note_step_ms(self, step_ms: float | None, configuration: tuple[str, ...] | None = None) -> None:
        """Remember ``step_ms`` as the step time of ``configuration`` (default: the one in effect)."""
        if step_ms is not None and math.isfinite(step_ms) and step_ms > 0:
            self._step_ms[self.in_effect() if configuration is None else configuration] = step_ms

    def size_windows(self, label: str) -> None:
        """Windows sized by time for the comparison about to run: ``window_s`` at the step time last
        measured for the configuration in effect (its A), within ``min_window_steps`` and
        ``max_window_steps``. Sized once from the baseline, a climb that made the step 10x faster
        timed 10x shorter windows: 3 steps of 35 ms for a ResNet-18 whose baseline took 345 ms, 10
        steps of 2.4 ms for a Transformer sized at 24 ms, where one host hiccup is a large share of
        a window. A configuration not yet measured keeps the windows as they are."""
        step_ms = self._step_ms.get(self.in_effect())
        if step_ms is None:
            return
        steps = steps_for_window(step_ms, self.cfg)
        if steps != self.window_steps:
            self.resized.append(
                {"before": label, "step_ms": round(step_ms, 3), "from_steps": self.window_steps, "window_steps": steps}
            )
            self.on_event(f"  {label}: windows of {steps} steps (~{steps * step_ms / 1e3:.2f} s at {step_ms:.2f} ms a step)")
            self.window_steps = steps

    def block_batches(self, same_source: bool) -> list[Any] | None:
        """The batches every window of the next A/B block runs, drawn once (untimed) from the data
        source, where batch shapes vary and both configurations read the same source; else None
        (each window draws its own: a change of the data path is timed on the data it serves)."""
        if not (self.shapes_vary and same_source):
            return None
        source = self.source_iterator()
        return [next(source) for _ in range(self.window_steps * self.state.step.accumulate)]

    def alone(self, steps: int | None = None, repeats: int | None = None, warmup: int | None = None) -> Measurement:
        """The configuration in effect, measured on its own (the baseline; a cached decision's final
        configuration): ``repeats`` windows of ``steps`` steps after ``warmup`` (default: the configured ones)."""
        cfg = self.cfg
        self.snapshot.restore(rng=False)
        floor = self.loader_pace_ms()
        measured = self.session.measure(
            self.runner(),
            warmup=cfg.warmup if warmup is None else warmup,
            steps=steps or cfg.steps,
            repeats=repeats or cfg.repeats,
            floor_ms=floor,
        )
        self.note_step_ms(measured.step_ms)
        return self.with_pace_noise(measured)

    def compare(
        self, set_candidate: Callable[[bool], None], label: str, budget_s: Callable[[], float], shared_batches: bool = True
    ) -> PairedResult:
        """Time the current configuration (A) against the candidate (B) in A B B A blocks until the
        paired decision is made, ``max_blocks`` are spent or its budget is out (``budget_s()``, asked after
        the warm-ups). Leaves A on.
        ``shared_batches``: where batch shapes vary, the windows of a block may run the same batches.
        The budget counts from the end of the warm-ups: a compilation there (a configuration compiled
        for the first time, or again, e.g. after parity ran it with dropout off) is the trials' time,
        and left the comparison, counted from its start, too few blocks to decide."""
        cfg, session = self.cfg, self.session
        self.snapshot.restore(rng=False)
        start = self.host_clock()
        set_candidate(True)
        source_b, configuration_b = self.state.data, self.in_effect()
        with heartbeat(self.on_event, f"  {label}: warm-up"):
            session.warm(self.runner(), max(cfg.warmup, self.settle()))
        set_candidate(False)
        same_source = self.state.data is source_b
        configuration_a = self.in_effect()
        self.size_windows(label)
        session.warm(self.runner(), self.settle())
        budget = budget_s()
        shared: list[Any] | None = None

        def start_block(switch: Callable[[bool], bool]) -> None:
            nonlocal shared
            shared = self.block_batches(same_source and shared_batches)
            if shared is not None:  # each configuration meets the block's shapes once, untimed: work the
                for candidate in (True, False):  # first batch of a shape brings (cuBLAS, cuDNN plans) is
                    switch(candidate)  # then timed in neither configuration's windows, not in the first
                    session.warm(self.runner(shared), self.window_steps)

        def look(verdict: Comparison) -> None:
            self.on_event(
                f"  {label}: {verdict.blocks} blocks: {verdict.speedup:.3f}x "
                f"[{verdict.low:.3f}, {verdict.high:.3f}] {verdict.verdict.replace('_', ' ')}"
            )

        def window() -> Any:  # no faster than the loader in effect sustains (loader_pace_ms)
            return session.window(self.runner(shared), self.window_steps, floor_ms=self.loader_pace_ms())

        paired = compare(
            set_candidate,
            window,
            cfg,
            budget_s=budget,
            clock=self.host_clock,
            noise=self.noise,
            settle=lambda: session.warm(self.runner(), self.settle()),
            start_block=start_block,
            on_look=look,
        )
        design = paired.design
        a_m = self.with_pace_noise(session.measurement(paired.a, warmup=cfg.warmup), self.state.data)
        b_m = self.with_pace_noise(session.measurement(paired.b, warmup=cfg.warmup), source_b)
        self.note_step_ms(a_m.step_ms, configuration_a)
        self.note_step_ms(b_m.step_ms, configuration_b)
        return PairedResult(
            **asdict(paired.comparison),
            planned_blocks=design.final if design is not None else None,
            stopped_by_budget=paired.stopped_by_budget,
            a=a_m,
            b=b_m,
            seconds=self.host_clock() - start,
        )


@contextlib.contextmanager
def heartbeat(on_event: Callable[[str], None], label: str, every_s: float = 20.0) -> Iterator[None]:
    """Say "still running" every ``every_s`` seconds of wall time while the block runs (a first
    compile can take minutes with nothing else to show)."""
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            on_event(f"{label}: still running after {time.monotonic() - start:.0f} s")

    thread = threading.Thread(target=beat, daemon=True, name="speedkit-heartbeat")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
