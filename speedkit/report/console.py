"""The ladder table on the terminal, with rich: the same cells as ``report.md``, colored by status."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from speedkit.report.markdown import (
    STATUS_LABELS,
    TABLE_COLUMNS,
    diagnosis_line,
    holds_line,
    summary_line,
    table_rows,
)

STATUS_STYLES = {
    "baseline": "bold cyan",
    "kept": "bold green",
    "reverted": "yellow",
    "not_applicable": "dim",
    "skipped": "dim",
    "failed": "bold red",
    "closing": "bold green",
    "interrupted": "bold red",
    "switches": "cyan",
}


def render_console(d: dict[str, Any], console: Console | None = None) -> None:
    """Print the ladder table and the one-line summary of a report dict."""
    console = console or Console()
    recipe = f": {d['recipe']}" if d.get("recipe") else ""
    title = f"speedkit ladder{recipe} on {d.get('device') or '?'}"
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(TABLE_COLUMNS):
        table.add_column(column, justify="left" if i < 2 or i == len(TABLE_COLUMNS) - 1 else "right")
    for rung, cells in table_rows(d):
        style = STATUS_STYLES.get(rung.get("status"), "")
        # Text, not markup strings: a reason or a name with "[...]" must print as written.
        table.add_row(*(Text(cell) for cell in cells), style=style)
    console.print(table)
    diagnosis = (d.get("run") or {}).get("diagnosis")
    if diagnosis:
        console.print(Text("Diagnosis: " + diagnosis_line(diagnosis)))
    console.print(Text("Summary: " + summary_line(d)))
    holds = holds_line(d)
    if holds:
        flagged = (d.get("holds") or {}).get("flagged")
        console.print(Text("In training: " + holds, style="yellow" if flagged else ""))
    for rung in d.get("rungs") or []:
        if rung.get("status") in ("failed", "reverted") and rung.get("reason"):
            label = STATUS_LABELS.get(rung["status"], rung["status"])
            reason = " ".join(str(rung["reason"]).split())  # one line per rung
            console.print(Text(f"  {rung.get('name')} ({label}): {reason}", style=STATUS_STYLES.get(rung["status"], "")))
