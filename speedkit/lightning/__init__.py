"""Thin Lightning callbacks over speedkit's core."""

from speedkit.lightning.speed_ladder import SpeedLadder
from speedkit.lightning.step_timer import StepTimer

__all__ = ["SpeedLadder", "StepTimer"]
