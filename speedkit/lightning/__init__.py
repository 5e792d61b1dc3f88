"""Thin Lightning callbacks over speedkit's core."""

from speedkit.lightning.oom_fallback import OOMFallback
from speedkit.lightning.speed_ladder import SpeedLadder
from speedkit.lightning.speed_profiler import SpeedProfiler
from speedkit.lightning.step_timer import StepTimer

__all__ = ["OOMFallback", "SpeedLadder", "SpeedProfiler", "StepTimer"]
