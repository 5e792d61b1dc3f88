"""Shared bench plumbing: result lines, the machine's GEMM ceiling, and a timed training loop.

Benchmarks are not tests: they run on a GPU and append JSON lines to
``bench/results/<date>_<gpu>.jsonl`` with the fields bench, variant, device, metric, value, unit,
commit, date. Figures come from the speedkit step clock (CUDA events, one wait per window),
as medians over warmed-up windows.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def gpu_slug() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    m = re.search(r"(H200|H100|A100|L40S|A10G|RTX \d+)", name)
    return (m.group(1) if m else name).lower().replace(" ", "")


def commit() -> str:
    """The commit the measured code is: ``$SPEEDKIT_COMMIT`` where the caller knows it (the device
    machine's copy of the tree has no history of its own), else git's HEAD, "+dirty" when the tree
    differs from it."""
    env = os.environ.get("SPEEDKIT_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


class Results:
    """Appends result lines to the day's file for this GPU and keeps them for a summary table."""

    def __init__(self, bench: str, out: Path | None = None, model: str | None = None, **every_row: object) -> None:
        self.bench = bench
        self.model = model  # the model every row is of, unless a row names its own
        self.every_row = every_row  # fields written into every row (a row's own value wins)
        self.date = datetime.date.today().isoformat()
        self.device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.path = out or RESULTS / f"{self.date}_{gpu_slug()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.commit = commit()
        self.rows: list[dict] = []

    def add(self, variant: str, metric: str, value: float | None, unit: str, **extra) -> None:
        """Append one row; ``extra`` may hold ``bench`` to file it under another benchmark's name."""
        model = {"model": extra.pop("model", self.model)} if self.model or "model" in extra else {}
        row = {
            "bench": extra.pop("bench", self.bench),
            **model,
            "variant": variant,
            "device": self.device,
            "metric": metric,
            "value": value,
            "unit": unit,
            "commit": self.commit,
            "date": self.date,
            **self.every_row,
            **extra,
        }
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def value(self, variant: str, metric: str) -> float | None:
        for row in reversed(self.rows):
            if row["variant"] == variant and row["metric"] == metric:
                return row["value"]
        return None


def gemm_ceiling_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16, repeats: int = 20) -> float:
    """Median bf16 GEMM rate on random data (the measured ceiling MFU is quoted against in ANCHORS.md)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    from speedkit.measure.session import MeasureSession

    times = sorted(MeasureSession(torch.device("cuda")).window_times(lambda: a @ b, warmup=3, steps=1, repeats=repeats))
    return 2 * n**3 / (times[len(times) // 2] / 1e3) / 1e12
