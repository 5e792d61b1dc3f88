"""Progress bars: drawn on a terminal, nothing off one; the engines report (done, total, label)."""

from __future__ import annotations

import io

from rich.console import Console

from speedkit.engine.sweep import SweepTrial, sweep
from speedkit.frontend.progress import ProgressBar


def test_off_a_terminal_the_bar_draws_nothing():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with ProgressBar(console, "trials") as bar:
        bar(1, 4, "tf32")
    assert not bar.enabled and out.getvalue() == ""


def test_on_a_terminal_the_bar_shows_the_label_and_the_count():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with ProgressBar(console, "trials") as bar:
        bar(2, 5, "compile")
        bar._progress.refresh()
    text = out.getvalue()
    assert bar.enabled and "trials: compile" in text and "2/5" in text


def test_the_sweep_reports_each_size_it_measures():
    seen = []

    def measure(size: int) -> SweepTrial:
        return SweepTrial(size, 1, 1000.0 * min(size, 16), "samples/s", None, True, "", 0.1)

    result = sweep(measure, 4, max_trials=8, on_progress=lambda done, total, label: seen.append((done, total, label)))
    assert seen[0] == (0, 8, "micro-batch 4") and seen[1] == (1, 8, "micro-batch 4 measured")
    assert len(seen) == 2 * len(result.trials) and all(total == 8 for _, total, _ in seen)
