"""cudnn_benchmark: let cuDNN time its convolution algorithms and keep the fastest.

Speeds up: convolutions on CUDA. With ``torch.backends.cudnn.benchmark = True``, the first call of
each convolution shape times cuDNN's algorithms and caches the fastest for that shape; otherwise a
heuristic picks one, often not the fastest.
Does not help: models without convolutions; input shapes that keep changing (every new shape is
timed again, so the first steps of each shape are slower).
Needs: a CUDA device and cuDNN; no request for deterministic algorithms (the algorithm timing picks
may differ from run to run, and so may the results, by rounding).
Numerics: unchanged. Another algorithm sums in another order at most.

The rung sets one process-global flag; ``undo`` puts its previous value back.
"""

from __future__ import annotations

import torch
from torch import nn

from speedkit.rungs.base import Handle, Rung
from speedkit.training.state import TrainState

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _set_benchmark(on: bool) -> None:
    """Set the process-global flag (a function, so that undo and redo can set it)."""
    torch.backends.cudnn.benchmark = on


class CudnnBenchmarkRung(Rung):
    name = "cudnn_benchmark"
    # the convolutions' algorithms (convolutions count as GEMM)
    targets = ("gemm",)
    new_shape_cost = True  # each new shape benchmarks the convolution algorithms again
    precision = None  # another algorithm sums in another order at most

    def check(self, state: TrainState) -> str | None:
        if state.device.type != "cuda":
            return f"cuDNN runs only on CUDA devices (the run is on {state.device.type})"
        if not torch.backends.cudnn.is_available():
            return "this PyTorch build has no cuDNN"
        if not torch.backends.cudnn.enabled:
            return "cuDNN is disabled (torch.backends.cudnn.enabled = False)"
        if not any(isinstance(m, _CONVOLUTIONS) for m in state.model.modules()):
            return "the model has no convolution (cudnn.benchmark chooses convolution algorithms)"
        if torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic:
            return (
                "deterministic algorithms are requested (torch.use_deterministic_algorithms or "
                "torch.backends.cudnn.deterministic); benchmark mode may pick other algorithms in other runs"
            )
        if torch.backends.cudnn.benchmark:
            return "torch.backends.cudnn.benchmark is already on"
        return None

    def apply(self, state: TrainState) -> Handle:
        handle = Handle(self.name)
        previous = torch.backends.cudnn.benchmark
        _set_benchmark(True)
        handle.record(
            f"torch.backends.cudnn.benchmark = True (was {previous})",
            lambda: _set_benchmark(previous),
            lambda: _set_benchmark(True),
        )
        return handle
