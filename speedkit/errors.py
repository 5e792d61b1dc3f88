"""The one small error hierarchy of speedkit.

* :class:`SpeedkitError` — base of everything speedkit raises on purpose.
* :class:`ConfigError` — a recipe or argument is wrong; raised before any work starts.
  Its message is one line: where (the field path), what was expected, what was found.
* :class:`UnsupportedError` — the hardware or a library version cannot do what was asked.
* :class:`UserCodeError` — the user's own code raised while speedkit ran it
  (:func:`failure_in_user_code` tells it from a data module that cannot build its data, a ConfigError).
* :class:`OutputError` — a file speedkit writes (a report, ``optimized.yaml``) could not be written
  (a full disk, a folder made read-only); nothing half-written is left.

The CLI prints ``str(error)`` on one line and exits with code 2 for these (1 for a UserCodeError,
after the traceback's frames in the user's code; 74, sysexits' EX_IOERR, for an OutputError, after
the results it could not write); it never prints speedkit's own frames for them.
"""

from __future__ import annotations

from typing import Any


class SpeedkitError(Exception):
    """Base class for errors speedkit raises deliberately."""


class ConfigError(SpeedkitError, ValueError):
    """A recipe, option or argument is malformed. Raised before any work starts."""

    def __init__(self, where: str, message: str) -> None:
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)


class UnsupportedError(SpeedkitError):
    """The machine or library versions cannot do what was asked; the message says how to fix it."""


class OutputError(SpeedkitError):
    """A file speedkit writes could not be written; nothing half-written was left in its place.

    Attributes: ``path`` (the file), ``reason`` (the system's words, e.g. "No space left on device"),
    ``result`` (what the file would have held, e.g. a ladder's result, for the caller to show), and
    ``written`` (the files written before it, complete)."""

    def __init__(self, path: Any, reason: str) -> None:
        self.path = path
        self.reason = reason
        self.result: Any = None
        self.written: dict[str, Any] = {}
        super().__init__(f"cannot write {path}: {reason}")


def first_line(exc: BaseException, default: str = "") -> str:
    """The first line of ``exc``'s message (``default`` when it has none): what a one-line report says."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else default


class UserCodeError(SpeedkitError):
    """The user's own code (model, data, callbacks) raised while speedkit ran it; nothing speedkit
    changed is left on the model. ``frames``: the traceback's frames in the user's code, formatted."""

    def __init__(self, message: str, frames: list[str]) -> None:
        self.frames = frames
        super().__init__(message)


#: top-level packages whose frames are not the user's code in a traceback
_NOT_USER = frozenset(
    {
        "torch",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
        "lightning_utilities",
        "speedkit",
        "triton",
        "numpy",
        "yaml",
        "rich",
        "fsspec",
    }
)
#: speedkit's reference models and data modules: in a recipe they stand in for the user's own, and fail only
#: on the recipe's arguments (a sequence longer than the model's block_size, float vectors for a GPT)
_DEMOS = "speedkit.demos"
#: the data hooks Lightning calls to build the training data (a failure there is the recipe's data section)
_DATA_HOOKS = ("prepare_data", "setup", "train_dataloader")


def _in_demos(frame: Any) -> bool:
    """Whether ``frame`` runs code of :data:`_DEMOS` (the package or one of its modules)."""
    return (str(frame.f_globals.get("__name__", "")) + ".").startswith(_DEMOS + ".")


def failure_in_user_code(exc: BaseException, during: str) -> SpeedkitError | None:
    """What speedkit reports when ``exc`` escaped a run (``during``: e.g. "speedkit optimize"): a
    ConfigError naming the data hook when the user's data module or model failed to build the training
    data (a batch size of 0), a UserCodeError naming the file and line of the user's innermost frame
    otherwise; None when no frame is the user's (speedkit's or a library's own failure: its traceback
    is what tells)."""
    import sys
    import traceback

    stdlib = getattr(sys, "stdlib_module_names", frozenset())
    user: list[tuple[Any, int]] = []
    tb = exc.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0]
        if module and module not in _NOT_USER and module not in stdlib or _in_demos(tb.tb_frame):
            user.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    if not user:
        return None
    frame, line = user[-1]
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    where = f"{code.co_filename}:{line} in {name}"
    what = f"{type(exc).__name__}: {first_line(exc, '(no message)')}"
    hooks = [f.f_code for f, _ in user if f.f_code.co_name in _DATA_HOOKS]
    if hooks:
        hook = getattr(hooks[-1], "co_qualname", hooks[-1].co_name)
        empty = "num_samples=0" in what  # torch's RandomSampler over an empty dataset
        fix = "; its dataset is empty (0 samples): check the path, split or filter that builds it" if empty else ""
        return ConfigError("data", f"{hook}() raised {what} ({where}){fix}")
    if _in_demos(frame):
        return ConfigError(
            "model",
            f"{name} raised {what} ({where}): the recipe's model and data do not fit together; "
            "check that data gives what the model takes (synthetic: tokens for a language model, vectors for an MLP) and "
            "model.init_args against it (e.g. block_size >= seq_len, vocab_size >= the data's)",
        )
    frames = traceback.format_list([traceback.FrameSummary(f.f_code.co_filename, n, f.f_code.co_name) for f, n in user])
    return UserCodeError(f"{during}: your code raised {what} ({where}); speedkit's changes were undone", frames)
