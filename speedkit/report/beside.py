"""A report written by a process of its own while the fit trains on (:class:`ReportProcess`).

Written inside the training step where the fit check ended, the report (HTML with its plots) stopped a
fit 1.4-3.6 s on an H200, 0.3 s on a CPU. On a thread of the fit's process it still stalled the steps: the
render holds Python's lock between the training thread's operations, and a 12 ms CPU step took 130-270
ms while it ran. The training process now only writes the result as JSON (milliseconds) and starts
``python -m speedkit.report.beside`` to render it; the caller waits for it where the fit ends.
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


class ReportProcess:
    """Render ``result``'s report into ``out_dir`` in a process of its own (its own session: a signal sent
    to the fit's process group does not cut it short). :meth:`wait` for it."""

    def __init__(self, result: LadderResult, out_dir: Path | str, formats: Iterable[str] = ("json", "md", "html")) -> None:
        text = json.dumps(to_json_safe(result.to_dict()), allow_nan=False, ensure_ascii=False)
        handle, path = tempfile.mkstemp(prefix="speedkit-result-", suffix=".json")
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
        self.result_path = Path(path)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # speedkit as this process finds it
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "speedkit.report.beside", path, str(out_dir), *formats],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            self.result_path.unlink(missing_ok=True)
            raise

    def wait(self) -> str | None:
        """Wait for the report; None where it was written, else the line saying why not."""
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
    from speedkit.report import write_report  # noqa: PLC0415

    with contextlib.suppress(OSError, AttributeError):  # the fit's steps come first on a machine of few cores
        os.nice(10)
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
