"""Loading of the YAML files in ``configs/`` (defaults, GPU peaks, parity tolerances)."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

import yaml

#: Numerics classes from strictest to loosest; a run's effective precision is the loosest applied.
PRECISION_ORDER = ("fp32", "tf32", "fp16", "bf16", "fp8")


def config_dir() -> Path:
    """Where the YAML configs live: ``$SPEEDKIT_CONFIG_DIR`` or the ones shipped with the package."""
    override = os.environ.get("SPEEDKIT_CONFIG_DIR")
    return Path(override) if override else Path(__file__).resolve().parent / "configs"


@functools.cache
def load(name: str) -> dict[str, Any]:
    """Parse ``configs/<name>.yaml`` once per process."""
    path = config_dir() / f"{name}.yaml"
    with open(path) as f:
        return yaml.safe_load(f) or {}


def defaults(section: str) -> Any:
    """A copy of one section of ``configs/defaults.yaml`` (``measure``, ``step_timer``, ``loader``, ``nvml``,
    ``sweep``, ``ladder``, ...): the file is read once, and no caller can change what the next one reads."""
    return copy.deepcopy(load("defaults")[section])


def measure_defaults() -> dict[str, Any]:
    """How speedkit measures and decides, unless a recipe or the callback says otherwise."""
    return defaults("measure")


def step_timer_defaults() -> dict[str, Any]:
    """How ``StepTimer`` times a fit's steps where its caller does not say (``step_timer:``)."""
    return defaults("step_timer")


def diagnosis_thresholds() -> dict[str, Any]:
    """How the baseline's step is diagnosed and the rungs' gains bounded (``diagnosis:``)."""
    return defaults("diagnosis")


def default_ladder() -> list[Any]:
    """The rungs ``SpeedLadder()`` climbs when given none."""
    return defaults("ladder")


def switch_rungs() -> list[str]:
    """The rungs standing for the switches a user turns on by hand: the ladder's floor."""
    return defaults("switches")


def tolerance(precision: str, device_type: str) -> float:
    """Relative per-step loss tolerance for ``precision`` on ``device_type`` ('cpu' or 'cuda')."""
    table = load("tolerances")
    entry = table[precision]
    return float(entry.get(device_type, entry.get("cuda")))


def parity_calibration() -> dict[str, Any]:
    """How the ladder calibrates parity tolerances on the model (``tolerances.yaml`` calibration:)."""
    return dict(load("tolerances")["calibration"])


def loosest(a: str, b: str) -> str:
    """The looser of two precisions (the one whose numerics differ more from fp32)."""
    return max(a, b, key=PRECISION_ORDER.index)


def gpu_peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of a GPU by name and precision, or ``None`` if the GPU is not in the table."""
    best = None
    for entry in load("gpu_peaks")["gpus"]:
        match = entry["match"].lower()
        if match in device_name.lower() and (best is None or len(match) > len(best["match"])):
            best = entry
    if best is None:
        return None
    return float(best["peaks"][precision])
