"""The one measurement path used by the ladder, the CLI, the callbacks and the benchmarks."""

from speedkit.measure.clock import StepClock, summarize
from speedkit.measure.flops import count_step_flops, mfu, peak_tflops

__all__ = ["StepClock", "count_step_flops", "mfu", "peak_tflops", "summarize"]
