"""The one small error hierarchy of speedkit.

* :class:`SpeedkitError` — base of everything speedkit raises on purpose.
* :class:`ConfigError` — a recipe or argument is wrong; raised before any work starts.
  Its message is one line: where (the field path), what was expected, what was found.
* :class:`UnsupportedError` — the hardware or a library version cannot do what was asked.

The CLI prints ``str(error)`` on one line and exits with code 2 for these; it never prints a
traceback for them.
"""

from __future__ import annotations


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


def first_line(exc: BaseException, default: str = "") -> str:
    """The first line of ``exc``'s message (``default`` when it has none): what a one-line report says."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else default
