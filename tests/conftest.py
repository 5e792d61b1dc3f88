"""Shared fixtures: tiny models and a clean torch global state around every test."""

from __future__ import annotations

import os
import shutil

# speedkit's Triton kernels run on CPU tensors through Triton's interpreter; it is chosen when the
# kernels are defined (at import), so it must be set before anything imports them.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc
import random
import warnings
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    """Every rung must restore the flags it changes; this makes a leak in one test not break others."""
    matmul = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32


@pytest.fixture(autouse=True)
def _own_decision_cache(tmp_path, monkeypatch):
    """SpeedLadder() keeps its decisions by default (speedkit.engine.cache): each test gets its own
    folder, so no test re-checks another's decision, nor one from a user's home."""
    monkeypatch.setenv("SPEEDKIT_CACHE_DIR", str(tmp_path / "speedkit-cache"))


@pytest.fixture(autouse=True)
def _quiet_self_log():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.trainer.*not registered.*")
        yield


@pytest.fixture
def bf16_cpu(monkeypatch):
    """tf32 and autocast refuse a CPU without bf16 instructions (there bf16 is emulated, slower than
    fp32); what a test checks of them (apply/undo, parity, clipping) does not depend on speed, so such
    a test pretends the CPU has them and runs the same on every CI machine."""
    from speedkit import compat

    monkeypatch.setattr(compat, "cpu_has_bf16", lambda: True)


@pytest.fixture
def no_bf16_cpu(monkeypatch):
    """The other way round from ``bf16_cpu``: a test of what tf32 and autocast do where the CPU has no
    bf16 instructions (they refuse, and say why) pretends it has none, on every CI machine."""
    from speedkit import compat

    monkeypatch.setattr(compat, "cpu_has_bf16", lambda: False)


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    random.seed(0)


def tiny_gpt_state(batch_size: int = 4, seq_len: int = 32, device: str = "cpu", **model_kwargs):
    """A TrainState over the tiny naive GPT with synthetic tokens."""
    from speedkit.data import BatchSource
    from speedkit.demos import NaiveGPT, SyntheticTokens
    from speedkit.training.state import TrainState

    torch.manual_seed(0)
    model = NaiveGPT("tiny", **model_kwargs).to(device)
    dm = SyntheticTokens(batch_size=batch_size, seq_len=seq_len, vocab_size=512, length=batch_size * 64)
    return TrainState(
        model=model,
        optimizer=model.configure_optimizers(),
        device=torch.device(device),
        data=BatchSource(dm.train_dataloader(), torch.device(device)),
    )


#: a Trainer's arguments that keep a test's fit quiet and on its own: no logger, checkpoints, progress bar or summary
QUIET_TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def mlp_state(device: str = "cpu", **kwargs):
    from speedkit.data import BatchSource
    from speedkit.demos import LaunchBoundMLP, SyntheticVectors
    from speedkit.training.state import TrainState

    torch.manual_seed(0)
    model = LaunchBoundMLP(depth=2, hidden=32, features=16, **kwargs).to(device)
    dm = SyntheticVectors(batch_size=8, features=16, classes=10, length=8 * 64)
    return TrainState(
        model=model,
        optimizer=model.configure_optimizers(),
        device=torch.device(device),
        data=BatchSource(dm.train_dataloader(), torch.device(device)),
    )


def assert_rel_close(actual, expected, tol: float = 1e-5, msg: str = "") -> None:
    """‖actual − expected‖ / ‖expected‖ ≤ tol, computed in float64; NaN never passes.

    Element-wise tolerances fail on near-zero entries of long reductions (gradients) whose
    absolute error is set by the large entries; the relative norm is the measure METHOD.md uses.
    """
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), f"{msg}: non-finite values"
    # a reference that is zero but for rounding (a degenerate gradient) is judged on absolute error
    denom = max(e.norm().item(), 1e-6)
    rel = (a - e).norm().item() / denom
    assert rel <= tol, f"{msg}: relative error {rel:.3e} > {tol:.0e}"


def tensors_holding_a_graph() -> list[str]:
    """Real tensors alive now with a ``grad_fn`` (the fake ones torch.compile keeps as example values aside)."""
    gc.collect()
    found = []
    with warnings.catch_warnings():  # isinstance on a deprecated module attribute warns (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [o for o in objects if type(o).__name__ not in ("FakeTensor", "FunctionalTensor") and _is_tensor(o)]
    for o in tensors:
        if o.grad_fn is not None:
            found.append(f"{tuple(o.shape)} {type(o.grad_fn).__name__}")
    return found


def _is_tensor(o: Any) -> bool:
    try:
        return isinstance(o, torch.Tensor)
    except Exception:  # an object that raises on isinstance (a dead weak proxy)
        return False
