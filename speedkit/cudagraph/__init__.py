"""Whole-step CUDA graphs: ``graphed_step`` captures a :class:`~speedkit.training.step.Step` fed from
static buffers and replays it; ``safety`` reads the step's source for what a replay would get wrong
(host syncs, dynamic shapes, host work); ``step_watch`` runs a step to find the syncs and host random
draws the source does not show. The ``cuda_graph`` rung decides and swaps it in.
"""
