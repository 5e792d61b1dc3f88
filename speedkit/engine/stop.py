"""Stopping the trials at a safe point (:class:`StopRequests`): a signal (SIGTERM, SIGINT, a scheduler's
requeue signal) or a data loader whose workers died is not a failing rung.

A job scheduler or a container stop sends SIGTERM to the whole process group, a loader's workers
included. Taken as it came, the dead workers' errors failed the rung being tried and the climb went on,
rung after rung failing on an exhausted loader. During the trials the signals are only noted (after
the SIGTERM handler already installed, Lightning's, has run); the trials poll the note between phases
and steps (:meth:`StopRequests.check`), and a rung's failure that comes with a note, or from a dead
loader (:func:`loader_died`), stops them (:class:`TrialsStopped`, a ``BaseException``: no rung's failure
handler takes it). The ladder then undoes everything and restores the snapshot; its caller ends the
fit the way that signal ends it without speedkit. The requeue signal's own handler (Lightning's saves
a checkpoint) runs once the trial configuration is undone (:meth:`StopRequests.run_deferred`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from speedkit import distributed

#: the signals that stop the trials, with whether the handler already installed runs at once (SIGTERM:
#: Lightning's notes it and passes it to its launched processes), after the trials (the requeue signal:
#: Lightning's saves a checkpoint, never of a trial configuration), or not at all (SIGINT: Python's
#: raises KeyboardInterrupt wherever the trials are; the caller raises it once they are undone)
_AT_ONCE, _AFTER, _NEVER = "at once", "after the trials", "never"
_STOP_SIGNALS = (("SIGTERM", _AT_ONCE), ("SIGINT", _NEVER), ("SIGUSR1", _AFTER))


class TrialsStopped(BaseException):
    """The trials stopped before their end: by ``signal_name`` ("SIGTERM", "SIGINT", "SIGUSR1"), or by
    a data loader that died (``signal_name`` None). Not an ``Exception``: a rung's failure handler never
    takes it for the rung's."""

    def __init__(self, why: str, signal_name: str | None = None) -> None:
        super().__init__(why)
        self.why, self.signal_name = why, signal_name


def _ignore(signum: int, frame: Any) -> None:
    """A handler that does nothing (unlike ``SIG_IGN``, which changes how children are reaped)."""


def loader_died(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says a data loader can serve no more batches: a worker
    process killed or gone ("DataLoader worker (pid ...) is killed by signal", "... exited
    unexpectedly"), or an endless batch source exhausted (``StopIteration``)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, StopIteration) or "DataLoader worker" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


class StopRequests:
    """The signals received during the trials (:meth:`listening`) and the checks that stop them."""

    def __init__(self) -> None:
        #: the first stopping signal's name, once one came
        self.received: str | None = None
        self._deferred: list[tuple[Callable[..., Any], int]] = []
        self._sigchld: Any = None  # SIGCHLD's handler, set aside while the trials stop

    @contextlib.contextmanager
    def listening(self) -> Iterator[None]:
        """Note the stopping signals for the duration (main thread only; elsewhere nothing is
        installed), then put the handlers back."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous: dict[int, Any] = {}
        for name, when in _STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handler(name, previous[signum], when))
            except (OSError, ValueError):  # a platform without it
                previous.pop(signum, None)
        try:
            yield
        finally:
            if self._sigchld is not None:  # the dead workers are quieted by now: torch's check comes back
                with contextlib.suppress(OSError, ValueError, TypeError):
                    signal.signal(signal.SIGCHLD, self._sigchld)
                self._sigchld = None
            for signum, handler in previous.items():
                with contextlib.suppress(OSError, ValueError, TypeError):
                    signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _handler(self, name: str, previous: Any, when: str) -> Callable[[int, Any], None]:
        def noted(signum: int, frame: Any) -> None:
            if callable(previous) and previous is not signal.default_int_handler:
                if when == _AT_ONCE:
                    previous(signum, frame)
                elif when == _AFTER:
                    self._deferred.append((previous, signum))
            if self.received is None:
                self.received = name
                if when != _AFTER:
                    self._mute_worker_check()

        return noted

    def _mute_worker_check(self) -> None:
        """Set torch's SIGCHLD handler aside while the trials stop: a signal sent to the process group kills
        the loaders' workers, and that handler raises "DataLoader worker ... is killed by signal" wherever
        the main thread is as each one's exit is noticed (inside logging's lock, inside the undoing). Put
        back when :meth:`listening` ends, once the ladder has quieted the dead workers. Runs in the stopping
        signal's handler, which Python runs before SIGCHLD's (lower numbers first)."""
        sigchld = getattr(signal, "SIGCHLD", None)
        if sigchld is None or self._sigchld is not None:
            return
        handler = signal.getsignal(sigchld)
        if callable(handler):  # never SIG_IGN: children would then be reaped behind multiprocessing's back
            self._sigchld = handler
            signal.signal(sigchld, _ignore)

    def check(self, collective: bool = False) -> None:
        """Raise :class:`TrialsStopped` where a stopping signal came. ``collective``: at a point every
        process of a distributed run reaches together, any process's signal stops them all there."""
        name = self.received
        if collective and distributed.world_size() > 1:
            name = distributed.first_said(name) if distributed.any_rank(name is not None) else None
        if name is not None:
            raise TrialsStopped(f"{name} received", name)

    def stopping(self, exc: BaseException) -> TrialsStopped | None:
        """What a failure inside the trials means: a stop (a signal came, or a loader died) or, None,
        the failure of what was being tried."""
        if isinstance(exc, TrialsStopped):
            return exc
        if self.received is not None:
            return TrialsStopped(f"{self.received} received", self.received)
        if loader_died(exc):
            return TrialsStopped(f"the data loader died ({type(exc).__name__}: {str(exc).strip()[:160]})")
        return None

    def reraise(self, exc: BaseException) -> None:
        """Inside a handler of a rung's failure: raise the stop instead where ``exc`` is one."""
        stop = self.stopping(exc)
        if stop is not None:
            raise stop from exc

    def run_deferred(self) -> None:
        """The handlers held back until the trials were undone (the requeue signal's: a checkpoint)."""
        deferred, self._deferred = self._deferred, []
        for handler, signum in deferred:
            handler(signum, None)
