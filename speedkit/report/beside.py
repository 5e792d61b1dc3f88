"""A report written by a process of its own while the fit trains on (:class:`ReportProcess`).

Written inside the training step where the fit check ended, the report (HTML with its plots) stopped a
fit 1.4-3.6 s on an H200, 0.3 s on a CPU. On a thread of the fit's process it still stalled the steps: the
render holds Python's lock between the training thread's operations, and a 12 ms CPU step took 130-270
ms while it ran. The training process now only writes the result as JSON (milliseconds) and starts
``python -m speedkit.report.beside`` to render it; the caller waits for it where the fit ends.

In a process of its own it still took cores from the fit: started at the fit's priority, it imported torch
and matplotlib (1.6 s of CPU) before lowering it, with as many OpenMP threads as cores, and on a 2-core
CPU ten steps took 130-400 ms. The process is now put at the lowest priority the moment it exists
(:func:`run_lowest`: ``SCHED_IDLE``, which Linux runs only on a core nothing else wants, and niceness 19
where that is refused), before it imports anything, and each of its math libraries runs on one thread
(:data:`ONE_THREAD`); it sets both again itself first thing.

That priority counts only within the fit's session: it stays in it, in a process group of its own (a
signal sent to the fit's process group does not cut it short). Started in a session of its own, as it was,
Linux's automatic grouping of sessions (``kernel.sched_autogroup_enabled``, on by default) shared the CPU
between the two sessions equally whatever each process's policy: on a 2-core CPU a SCHED_IDLE busy loop
in a session of its own slowed a 12 ms step to 70 ms with stalls of up to a second, the report's process
13 steps by 50-900 ms; in the fit's session, neither slowed a step.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from speedkit.report import to_json_safe
from speedkit.results import LadderResult

#: the thread counts of the math libraries a report's process loads (OpenMP: torch, NumPy's BLAS): one each
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")}


def run_lowest(pid: int = 0) -> str | None:
    """Put process ``pid`` (0: this one) at the lowest CPU priority: ``SCHED_IDLE``, under which Linux runs
    it only on a core no other process wants; where that is refused, niceness 19. Returns what was
    applied ("SCHED_IDLE", "nice 19"), None where neither could be."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, pid, 19)
        return "nice 19"
    return None


def _own_process_group() -> dict[str, object]:
    """``subprocess.Popen``'s arguments for a process group of its own within this session (not a session of
    its own: the kernel's autogroups would then give it half the CPU, whatever its priority)."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # Python 3.10


class ReportProcess:
    """Render ``result``'s report into ``out_dir`` in a process of its own (in the fit's session, in a process
    group of its own: a signal sent to the fit's process group does not cut it short). :meth:`wait` for it."""

    def __init__(self, result: LadderResult, out_dir: Path | str, formats: Iterable[str] = ("json", "md", "html")) -> None:
        text = json.dumps(to_json_safe(result.to_dict()), allow_nan=False, ensure_ascii=False)
        handle, path = tempfile.mkstemp(prefix="speedkit-result-", suffix=".json")
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
        self.result_path = Path(path)
        # speedkit as this process finds it; its math libraries on one thread each
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **ONE_THREAD}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "speedkit.report.beside", path, str(out_dir), *formats],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                **_own_process_group(),
            )
        except BaseException:
            self.result_path.unlink(missing_ok=True)
            raise
        # at once, while its interpreter starts: the imports (torch, matplotlib) run at the lowest priority too
        self.priority = run_lowest(self.process.pid)

    def wait(self) -> str | None:
        """Wait for the report; None where it was written, else the line saying why not. Waited for, it
        yields to nothing of the fit's any more: back to the usual policy where the OS lets this process
        say so (an unprivileged one may not leave ``SCHED_IDLE``: it then finishes on the idle cores)."""
        if self.priority == "SCHED_IDLE":
            with contextlib.suppress(OSError, AttributeError):
                os.sched_setscheduler(self.process.pid, os.SCHED_OTHER, os.sched_param(0))
        try:
            _, err = self.process.communicate()
        finally:
            self.result_path.unlink(missing_ok=True)
        if self.process.returncode == 0:
            return None
        lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else f"the report's process ended with status {self.process.returncode}"


def main(argv: list[str]) -> int:
    """``python -m speedkit.report.beside RESULT_JSON OUT_DIR [FORMAT ...]``: the report of a result."""
    run_lowest()  # the fit's steps come first on a machine of few cores (the parent did so too, a moment later)
    from speedkit.report import write_report  # noqa: PLC0415

    if "torch" in sys.modules:  # one intra-op thread, whatever the environment said
        sys.modules["torch"].set_num_threads(1)
    result_path, out_dir, *formats = argv
    result = json.loads(Path(result_path).read_text(encoding="utf-8"))
    try:
        write_report(result, out_dir, formats=formats or ("json", "md", "html"))
    except Exception as exc:  # one line for the fit's warning
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
