"""Writing speedkit's output files whole or not at all.

A report, ``optimized.yaml`` or a trace is written to a temporary file beside its destination and
renamed over it (``os.replace``, atomic on one filesystem): a full disk or a failure midway leaves
the earlier file, or none, never a truncated one that the next run would read or refuse.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from speedkit.errors import OutputError


def write_text_atomic(path: Path | str, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole, creating its folder; returns the path.

    Raises:
        OutputError: the folder or the file could not be written (its ``reason`` is the system's,
            e.g. "No space left on device"); neither a partial file nor the temporary one is left.
    """
    path = Path(path)
    data = text.encode("utf-8")
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a full disk may only say so when the data leaves the page cache
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise OutputError(path, exc.strerror or str(exc)) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def _umask() -> int:
    """The process's umask (mkstemp makes files 0600; a report is as readable as any file written)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_cache_dir() -> Path:
    """speedkit's cache folder where no other is given: its decisions (:mod:`speedkit.engine.cache`) and
    the kernels' per-shape measurements (:mod:`speedkit.kernels.choice`)."""
    if os.environ.get("SPEEDKIT_CACHE_DIR"):
        return Path(os.environ["SPEEDKIT_CACHE_DIR"])
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "speedkit"
