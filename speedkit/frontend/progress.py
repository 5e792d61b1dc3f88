"""Progress bars for long work (the ladder's trials, the batch-size sweep), on a terminal only.

The engines report progress as ``on_progress(done, total, label)`` calls (:class:`speedkit.engine.ladder.Ladder`:
rungs tried of those in the ladder, then its closing phases; :func:`speedkit.engine.sweep.sweep`: sizes
measured of at most ``max_trials``); :class:`ProgressBar` draws them with rich above the printed
event lines. Where the output is not a terminal (a log file, CI) it draws nothing: the event lines
alone say what happens.
"""

from __future__ import annotations

from typing import Any


class ProgressBar:
    """A rich progress bar on ``console`` while in the ``with`` block; quiet off a terminal.

    Use the instance as the engine's ``on_progress``; print other lines through the same console.
    """

    def __init__(self, console: Any, title: str) -> None:
        self.console, self.title = console, title
        self.enabled = bool(getattr(console, "is_terminal", False))
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.title, total=None)
        return self

    def __call__(self, done: int, total: int, label: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=max(total, done, 1), description=f"{self.title}: {label}")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
