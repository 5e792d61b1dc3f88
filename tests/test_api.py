"""speedkit.apply on plain PyTorch objects."""

from __future__ import annotations

import pytest
import torch

import speedkit
from speedkit.demos import LaunchBoundMLP


def _plain():
    torch.manual_seed(0)
    model = LaunchBoundMLP(features=16, hidden=32, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = [(torch.randn(8, 16), torch.randint(0, 10, (8,))) for _ in range(4)]
    return model, opt, loader


def test_apply_trains_and_undo_restores():
    model, opt, loader = _plain()
    sk = speedkit.apply(model, opt, loader, rungs=["fused_optimizer", {"name": "compile", "options": {"backend": "eager"}}],
                        loss_fn=lambda m, b, i: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    assert sk.model is model and sk.optimizer is opt
    assert sk.applied == ["fused_optimizer", "compile"]
    batches = sk.batches()
    losses = [sk.step(next(batches), i).item() for i in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    sk.undo()
    assert sk.applied == [] and "forward" not in model.__dict__ and opt.param_groups[0]["fused"] is None


def test_apply_skips_with_a_warning_what_does_not_apply():
    model, opt, loader = _plain()
    with pytest.warns(UserWarning, match="fp16 autocast on CPU"):
        sk = speedkit.apply(model, opt, loader, rungs=[{"name": "autocast", "options": {"dtype": "fp16"}}])
    assert "autocast" in sk.skipped and sk.applied == []


def test_own_loop_with_autocast_and_backward():
    model, opt, loader = _plain()
    with speedkit.apply(model, opt, loader, rungs=["autocast"]) as sk:
        if sk.skipped:
            pytest.skip(sk.skipped["autocast"])
        x, y = loader[0]
        with sk.autocast():
            loss = torch.nn.functional.cross_entropy(sk.model(x), y)
        sk.backward(loss)
        sk.optimizer_step()
    assert sk.state.autocast_dtype is None
