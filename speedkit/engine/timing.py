"""Timing configurations of the ladder's stack (:class:`Timing`): one step of the configuration in
effect fed by the data source, a configuration alone, and two against each other in interleaved
A B B A blocks (:func:`speedkit.measure.compare.compare`); a heartbeat for long silent phases.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

from speedkit.data.source import BatchSource
from speedkit.engine.stack import Stack
from speedkit.measure.compare import compare
from speedkit.measure.config import MeasureConfig
from speedkit.measure.session import MeasureSession
from speedkit.measure.stats import Comparison
from speedkit.results import Measurement, PairedResult
from speedkit.training.snapshot import Snapshot
from speedkit.training.state import TrainState

#: a read of a data source that took longer waited for its batch to be made (:meth:`Timing.drain`)
READ_WAITED_S = 0.003


class Timing:
    """Times configurations of ``stack`` on ``state`` through ``session``, each window from
    ``snapshot`` (weights and schedule; the RNG runs on).

    ``window_steps``: optimizer steps per window of the A/B comparisons (sized by time from the
    baseline, :func:`speedkit.engine.budget.window_steps`); ``noise``: the planned noise of one block's
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
    ) -> None:
        self.state, self.cfg, self.session, self.stack, self.snapshot = state, cfg, session, stack, snapshot
        self.host_clock, self.on_event = host_clock, on_event
        self.shapes_vary = shapes_vary
        self.window_steps = cfg.steps
        self.noise: float | None = None
        self._iterators: dict[int, Iterator[Any]] = {}
        #: the windows that began by reading, untimed, what the source held ahead; the batches that took,
        #: and its host seconds (:meth:`drain`)
        self.drains, self.drained_batches, self.drained_s = 0, 0, 0.0
        #: per data source: its quickest read in :meth:`drain` that did not wait (taking a batch made ahead)
        self._quickest_read: dict[int, float] = {}

    def close(self) -> None:
        """Forget the data sources' iterators (the trials are over)."""
        self._iterators.clear()

    def settle(self) -> int:
        """Untimed steps after switching configuration (:meth:`Stack.settle`)."""
        return self.stack.settle(self.cfg.settle)

    def runner(self, batches: list[Any] | None = None) -> Callable[[], None]:
        """One step of the current configuration, fed by the current data source's iterator, or by
        ``batches`` (the block's own, see ``shapes_vary``) where given."""
        state = self.state
        source = iter(batches) if batches is not None else self.source_iterator()
        return self.session.runner(lambda micro, i: state.step(micro, i), source, state.step.accumulate)

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

    def drain(self) -> bool:
        """Before a window that reads the data source in effect: read, untimed and without stepping, what
        its workers made ahead while slower steps or the other configuration's windows ran, until a read
        waits for its batch (at most what the source can hold, :meth:`BatchSource.buffered_at_most`,
        and one more). The window then runs at the pace the loader sustains behind this configuration's
        steps, as the fit's steps do, not on a buffer: on an H200 a ResNet-18 whose loader makes a batch
        every 40.5 ms was timed at 22.6 ms per step on batches data_path's ring had filled while the
        baseline's windows ran; its fit ran 50-57 ms. A source without workers holds nothing ahead.
        Returns whether it read any (the next step then waits for a batch being made).

        A read waited where it took over :data:`READ_WAITED_S` and over three times this source's quickest
        read that did not wait: taking a batch made ahead costs about the same each time, well under a
        millisecond from a worker's queue, about one for a large batch from data_path's ring (a 77 MiB
        slot on an H200). A shorter wait goes unseen, and the reads go on (at most to the cap, each
        waiting that little)."""
        data = self.state.data
        if data is None:
            return False
        data, _ = data.unmapped()
        most = data.buffered_at_most()
        if most <= 0:
            return False
        batches, clock = self._unmapped_iterator(data), self.host_clock
        start, key = clock(), id(data)
        self.drains += 1
        outer = self.state.data
        outer.reading_ahead = data.reading_ahead = True
        try:
            for _ in range(most + 1):
                before = clock()
                next(batches)
                took = clock() - before
                self.drained_batches += 1
                quickest = self._quickest_read.get(key, float("inf"))
                if took > max(READ_WAITED_S, 3 * quickest if quickest < float("inf") else 0.0):
                    break
                self._quickest_read[key] = min(quickest, took)
        finally:
            outer.reading_ahead = data.reading_ahead = False
            self.drained_s += clock() - start
        return True

    def block_batches(self, same_source: bool) -> list[Any] | None:
        """The batches every window of the next A/B block runs, drawn once (untimed) from the data
        source, where batch shapes vary and both configurations read the same source; else None
        (each window draws its own: a change of the data path is timed on the data it serves)."""
        if not (self.shapes_vary and same_source):
            return None
        source = self.source_iterator()
        return [next(source) for _ in range(self.window_steps * self.state.step.accumulate)]

    def alone(self, steps: int | None = None, repeats: int | None = None) -> Measurement:
        """The configuration in effect, measured on its own (the baseline; a cached decision's final
        configuration): ``repeats`` windows of ``steps`` steps (default: the configured ones)."""
        cfg = self.cfg
        self.snapshot.restore(rng=False)
        self.drain()
        return self.session.measure(self.runner(), warmup=cfg.warmup, steps=steps or cfg.steps, repeats=repeats or cfg.repeats)

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
        source_b = self.state.data
        with heartbeat(self.on_event, f"  {label}: warm-up"):
            session.warm(self.runner(), max(cfg.warmup, self.settle()))
        set_candidate(False)
        same_source = self.state.data is source_b
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

        # the configuration in effect, and the one the last window ran: a window right after another of
        # the same configuration finds the source as that configuration's steps leave it, nothing to drain
        side: dict[str, bool | None] = {"on": False, "last_window": None}

        def switch(candidate: bool) -> None:
            set_candidate(candidate)
            side["on"] = candidate

        def window() -> Any:
            # read from the source at its sustained pace, not from what it buffered meanwhile; one step
            # then begins the window in that pace's rhythm
            if shared is None and side["last_window"] is not side["on"] and self.drain():
                session.warm(self.runner(), 1)
            side["last_window"] = side["on"]
            return session.window(self.runner(shared), self.window_steps)

        paired = compare(
            switch,
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
        return PairedResult(
            **asdict(paired.comparison),
            planned_blocks=design.final if design is not None else None,
            stopped_by_budget=paired.stopped_by_budget,
            a=session.measurement(paired.a, warmup=cfg.warmup),
            b=session.measurement(paired.b, warmup=cfg.warmup),
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
