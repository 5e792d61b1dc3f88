"""The cudnn_benchmark rung: when it applies, and the one flag it sets and puts back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedkit.rungs.cudnn_benchmark import CudnnBenchmarkRung
from speedkit.training.state import TrainState


@pytest.fixture(autouse=True)
def _cudnn_flags_back():
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
    )
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.enabled = saved[:3]
        torch.use_deterministic_algorithms(saved[3])


@pytest.fixture
def cudnn_available(monkeypatch):
    """The checks past the device's, on a machine whose torch build may lack cuDNN."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)


def _state(device: str = "cuda", model: nn.Module | None = None) -> TrainState:
    """A state that says it runs on ``device``; nothing is moved there (the rung only reads and sets flags)."""
    model = model if model is not None else nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    return TrainState(model=model, optimizer=None, device=torch.device(device))


def test_not_on_cuda_says_why():
    assert CudnnBenchmarkRung().check(_state("cpu")) == "cuDNN runs only on CUDA devices (the run is on cpu)"


def test_applies_on_cuda_with_convolutions(cudnn_available):
    torch.backends.cudnn.benchmark = False
    assert CudnnBenchmarkRung().check(_state()) is None
    assert CudnnBenchmarkRung().check(_state(model=nn.Sequential(nn.ConvTranspose1d(3, 4, 3)))) is None


def test_apply_undo_and_redo_the_flag():
    torch.backends.cudnn.benchmark = False
    handle = CudnnBenchmarkRung().apply(_state())
    assert torch.backends.cudnn.benchmark is True
    assert handle.changes == ["torch.backends.cudnn.benchmark = True (was False)"] and handle.toggleable
    for _ in range(3):
        handle.suspend()
        assert torch.backends.cudnn.benchmark is False
        handle.resume()
        assert torch.backends.cudnn.benchmark is True
    handle.undo()
    assert torch.backends.cudnn.benchmark is False


@pytest.mark.parametrize("how", ["use_deterministic_algorithms", "cudnn.deterministic"])
def test_deterministic_algorithms_requested(how, cudnn_available):
    torch.backends.cudnn.benchmark = False
    if how == "use_deterministic_algorithms":
        torch.use_deterministic_algorithms(True)
    else:
        torch.backends.cudnn.deterministic = True
    assert "deterministic algorithms are requested" in CudnnBenchmarkRung().check(_state())


def test_other_reasons(cudnn_available):
    rung = CudnnBenchmarkRung()
    assert "no convolution" in rung.check(_state(model=nn.Sequential(nn.Linear(4, 4))))
    torch.backends.cudnn.benchmark = True
    assert "already on" in rung.check(_state())
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.enabled = False
    assert "disabled" in rung.check(_state())


def test_a_build_without_cudnn_says_so(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert CudnnBenchmarkRung().check(_state()) == "this PyTorch build has no cuDNN"


@pytest.mark.gpu
def test_convolutions_run_and_match_with_benchmark_on():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).cuda()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False  # fp32 algorithms: they differ by rounding only (conftest restores it)
    expected = model(x)
    state = _state(model=model)
    assert CudnnBenchmarkRung().check(state) is None
    handle = CudnnBenchmarkRung().apply(state)
    out = model(x)
    handle.undo()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
