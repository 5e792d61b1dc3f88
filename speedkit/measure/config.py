"""MeasureConfig: how speedkit measures and decides, each setting documented and validated here.

Its values live in ``configs/defaults.yaml`` (``measure:``), the one home of each default; a recipe's
``measure:`` section, ``SpeedLadder(measure={...})`` and ``Ladder(measure={...})`` override some of
them through :meth:`MeasureConfig.from_dict`, which merges the overrides with the defaults once and
checks every field's type and range (a one-line :class:`~speedkit.errors.ConfigError` naming
``measure.<field>``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from speedkit import config
from speedkit.errors import ConfigError
from speedkit.options import check_value, describe_value, unknown_name


def _range(low: float | None = None, *, above: bool = False, below: float | None = None) -> dict[str, Any]:
    """A field's range: at least ``low`` (more than it where ``above``), less than ``below``."""
    return {"low": low, "above": above, "below": below}


@dataclass
class MeasureConfig:
    """How the ladder, the callbacks and the CLI measure and decide. No field has a default here:
    every one is in ``configs/defaults.yaml`` (``measure:``); build with :meth:`from_dict`."""

    warmup: int = field(metadata=_range(0))
    """Untimed steps before a configuration is first timed (compilation, autotuning, allocator)."""
    steps: int = field(metadata=_range(1))
    """Optimizer steps per timed window."""
    repeats: int = field(metadata=_range(1))
    """Windows of a configuration timed alone (the baseline; the fit's own steps)."""
    parity_steps: int = field(metadata=_range(1))
    """K: optimizer steps of the parity trajectory, compared against the state before each rung."""
    min_gain: float = field(metadata=_range(0.0, below=1.0))
    """A rung is kept only if it is at least this much faster, with ``confidence``."""
    memory_gain: float = field(metadata=_range(0.0, below=1.0))
    """... or if it saves this share of peak memory and is not slower (with ``confidence``)."""
    confidence: float = field(metadata=_range(0.5, below=1.0))
    """Of the paired decisions (interleaved A B B A blocks, Student-t interval)."""
    min_blocks: int = field(metadata=_range(2))
    """A B B A blocks at a comparison's first look (its only one where the planned noise allows)."""
    max_blocks: int = field(metadata=_range(2))
    """The most blocks a comparison's final look may be sized to (at least ``min_blocks``)."""
    detect_gain: float = field(metadata=_range(0.0, above=True, below=1.0))
    """The gain a comparison is sized to find: with ``power``, a rung this much faster is decided faster
    (more than ``min_gain``)."""
    power: float = field(metadata=_range(0.5, below=1.0))
    """The probability that a gain of ``detect_gain`` is decided faster (the design's sizing)."""
    budget_s: float = field(metadata=_range(0.0, above=True))
    """Seconds one comparison may take at most (the trials' budget usually gives it less)."""
    settle: int = field(metadata=_range(0))
    """Untimed steps after switching between configurations."""
    final_check: bool = field(metadata=_range())
    """At the end, time the final configuration against the baseline, interleaved (the headline figure)."""
    together_passes: int = field(metadata=_range(0))
    """Second looks: passes judging the rungs reverted on speed again on the final configuration (0: none)."""
    switches_floor: bool = field(metadata=_range())
    """Time the user's own switches (``configs/defaults.yaml`` ``switches:``) against the final
    configuration; the faster is kept."""
    host_bound_share: float = field(metadata=_range(0.0, above=True))
    """A GPU step whose host time is this share of it or more tries the host-cutting rungs first
    (compile, cuda_graph, async_progress_bar)..."""
    busy_util: float = field(metadata=_range(0.0, above=True))
    """... unless NVML saw the GPU busy this % of the time or more (a step that syncs: the host waits,
    it does not issue)."""
    window_s: float = field(metadata=_range(0.0))
    """Comparison windows last at least this many seconds at the baseline's step time: precision comes from the number of paired windows, not their length, so windows are sized
    by time (a 5 ms step gets 40, a 240 ms one ``steps``) ..."""
    min_window_steps: int = field(metadata=_range(1))
    """... at least this many steps ..."""
    max_window_steps: int = field(metadata=_range(1))
    """... and at most this many steps."""
    slow_step_ms: float = field(metadata=_range(0.0, above=True))
    """A step this long or longer (at the pace of the baseline's parity reference) gets the short forms of
    the baseline's phases: one draw per precision for the parity tolerances, three windows of two steps
    for the baseline's measurement, comparison windows of two steps at least (a 0.66 s step's baseline,
    tolerances and floor in under 40 s: at the full forms, 72 s for the baseline alone)."""
    trials_budget_s: float = field(metadata=_range(0.0, above=True))
    """The trials' one time budget (everything from the baseline to the profile) for a step of up to
    ``budget_step_ms``..."""
    budget_step_ms: float = field(metadata=_range(0.0, above=True))
    """... a longer step gets ``trials_budget_s`` per this many ms of step time ..."""
    trials_budget_max_s: float = field(metadata=_range(0.0, above=True))
    """... up to this many seconds ..."""
    trials_share: float = field(metadata=_range(0.0, above=True))
    """... and where the fit's length is known, at most this share of its planned time (planned steps
    times the baseline's step time) ..."""
    trials_min_s: float = field(metadata=_range(0.0))
    """... but never under this many seconds (:meth:`speedkit.engine.budget.TrialBudget.plan`)."""
    recompile_prior_s: float = field(metadata=_range(0.0))
    """Seconds a trial that compiles anew beneath compile is expected to spend compiling before any
    trial has compiled here: a rung is begun only where the budget left holds its fewest steps and
    this (:func:`speedkit.engine.climb.expected_compile_s`)."""
    cache_slack: float = field(metadata=_range(0.0))
    """A cached decision holds where its final configuration, timed again, is no slower than in the
    final check that decided it by more than this share (or three times the larger spread)."""
    holds_windows: int = field(metadata=_range(0))
    """Windows of the fit's own steps timed after the trials (the figure that holds; 0: none)."""
    holds_threshold: float = field(metadata=_range(0.0, above=True))
    """A fit slower than the ladder's figure by more than this is flagged, with its likely cause."""
    throughput_unit: Literal["auto", "tokens", "samples"] = field(metadata=_range())
    """tokens, samples or auto (integer 2-D inputs count tokens, else samples)."""
    mfu_precision: Literal["bf16", "fp16", "tf32", "fp32"] = field(metadata=_range())
    """The precision whose dense peak MFU is reported against (one peak, so MFU ratios equal speed ratios)."""
    peak_tflops: float | None = field(metadata=_range(0.0, above=True))
    """Overrides the table in ``configs/gpu_peaks.yaml`` (e.g. a measured GEMM ceiling); None: the table's."""
    telemetry: bool = field(metadata=_range())
    """Sample NVML in the background while timing (absent without a GPU)."""
    profile: bool = field(metadata=_range())
    """After the decisions: a short torch.profiler window of the baseline, of each kept rung and of
    the final configuration (the report's "where the time goes")."""
    profile_steps: int = field(metadata=_range(1))
    """Optimizer steps per profile window (after one untimed step)."""

    @classmethod
    def from_dict(cls, values: Any = None) -> MeasureConfig:
        """``configs/defaults.yaml``'s ``measure:`` overridden by ``values`` (a mapping; None: no
        overrides), every field checked. Raises ConfigError naming ``measure.<key>``."""
        if isinstance(values, MeasureConfig):
            return values
        if values is not None and not isinstance(values, dict):
            raise ConfigError("measure", f"expected a mapping, found {describe_value(values)}")
        defaults = config.measure_defaults()
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in defaults]
        if missing:
            raise KeyError(f"configs/defaults.yaml measure: lacks {missing}")
        allowed = list(dict.fromkeys([*defaults, *names]))
        for key in values or {}:
            if key not in allowed:
                raise ConfigError(f"measure.{key}", unknown_name("key", key, allowed))
        merged = {**defaults, **(values or {})}
        hints = typing.get_type_hints(cls)
        checked = {
            f.name: _check(merged[f.name], hints[f.name], f.metadata, f"measure.{f.name}") for f in dataclasses.fields(cls)
        }
        if checked["detect_gain"] <= checked["min_gain"]:
            raise ConfigError(
                "measure.detect_gain", f"must be > measure.min_gain ({checked['min_gain']}), found {checked['detect_gain']}"
            )
        if checked["max_blocks"] < checked["min_blocks"]:
            raise ConfigError(
                "measure.max_blocks", f"must be >= measure.min_blocks ({checked['min_blocks']}), found {checked['max_blocks']}"
            )
        return cls(**checked)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (the report's ``measure``)."""
        return dataclasses.asdict(self)


def _check(item: Any, tp: Any, rule: typing.Mapping[str, Any], where: str) -> Any:
    """``item`` checked against the annotation ``tp`` and the field's range."""
    item = check_value(item, tp, where)
    if isinstance(item, (int, float)) and not isinstance(item, bool):
        low, above, below = rule.get("low"), rule.get("above", False), rule.get("below")
        too_low = low is not None and (item <= low if above else item < low)
        too_high = below is not None and item >= below
        if too_low or too_high:
            kind = "an integer" if tp is int else "a number"
            rng = f"> {low}" if above else f">= {low}" if below is None else f"in [{low}, {below})"
            raise ConfigError(where, f"expected {kind} {rng}, found {item!r}")
    return item
