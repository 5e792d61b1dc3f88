"""speedkit.apply on plain PyTorch objects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import speedkit
from speedkit.demos import LaunchBoundMLP
from speedkit.errors import ConfigError


def _plain():
    torch.manual_seed(0)
    model = LaunchBoundMLP(features=16, hidden=32, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = [(torch.randn(8, 16), torch.randint(0, 10, (8,))) for _ in range(4)]
    return model, opt, loader


def test_apply_trains_and_undo_restores():
    model, opt, loader = _plain()
    sk = speedkit.apply(
        model,
        opt,
        loader,
        rungs=["fused_optimizer", {"name": "compile", "options": {"backend": "eager"}}],
        loss_fn=lambda m, b, i: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
    )
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


def test_own_loop_with_autocast_and_backward(bf16_cpu):
    model, opt, loader = _plain()
    with speedkit.apply(model, opt, loader, rungs=["autocast"]) as sk:
        if sk.skipped:
            pytest.skip(sk.skipped["autocast"])
        x, y = loader[0]
        with sk.autocast():
            loss = torch.nn.functional.cross_entropy(sk.model(x), y)
        sk.backward(loss)
        sk.optimizer_step()
    assert sk.state.step.autocast_dtype is None  # the autocast rung undone on leaving the block


def test_arguments_that_cannot_work_are_one_line_errors_before_anything_changes():
    from speedkit.errors import ConfigError

    model, opt, loader = _plain()
    other = torch.optim.AdamW(LaunchBoundMLP(features=16, hidden=32, depth=2).parameters())
    loss = lambda m, b, i: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    cases = [
        (dict(rungs="compile"), "rungs: expected a list of rungs"),
        (dict(rungs=None), "rungs: expected a list"),
        (dict(optimizer=other), "optimizer: holds none of the model's parameters"),
        (dict(accumulate=1.5), "accumulate:"),
        (dict(accumulate="2"), "accumulate:"),
        (dict(clip_grad_norm=-1.0), "clip_grad_norm:"),
        (dict(clip_grad_norm="x"), "clip_grad_norm:"),
        (dict(loader=42), "loader:"),
        (dict(loss_fn=3), "loss_fn:"),
        (dict(scheduler=5), "scheduler:"),
        (dict(model="resnet"), "model:"),
        (dict(device="nonsense"), "device:"),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), "device: cuda was asked for"))
    for change, words in cases:
        args = {**dict(model=model, optimizer=opt, loader=loader, rungs=["fused_optimizer"], loss_fn=loss), **change}
        with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as raised:
            speedkit.apply(args.pop("model"), args.pop("optimizer"), args.pop("loader"), **args)
        assert "\n" not in str(raised.value)
        assert opt.param_groups[0]["fused"] is None and "forward" not in model.__dict__
    sk = speedkit.apply(model, opt, loader, rungs=["fused_optimizer"], loss_fn=loss, accumulate=3)
    with pytest.raises(ConfigError, match="accumulate=3, step\\(\\) takes a list of 3 micro-batches"):
        sk.step(loader[0], 0)  # one (x, y) batch: the README's loop with accumulate needs micro-batches grouped
    assert torch.isfinite(sk.step(loader[:3], 0))
    sk.undo()


def test_speedladder_arguments_that_cannot_work_are_one_line_errors():
    from speedkit.errors import ConfigError
    from speedkit.lightning import SpeedLadder

    for kwargs, words in (
        (dict(rungs="compile"), "rungs: expected a list of rungs"),
        (dict(trials="no"), "trials:"),
        (dict(on_event=3), "on_event:"),
        (dict(report_dir=5), "report_dir:"),
        (dict(trials=False), "trials: False applies the rungs given, without measuring them, and none were given"),
    ):
        with pytest.raises(ConfigError, match=words) as raised:
            SpeedLadder(**kwargs)
        assert "\n" not in str(raised.value)
    assert SpeedLadder(rungs=[], trials=False).rungs == []  # no rungs, said so: nothing applied


def test_batches_end_with_the_epoch_and_group_micro_batches():
    """The README's loop ends when the data does: one epoch per batches() call (a fresh pass),
    ``steps`` stops early, ``accumulate`` groups the micro-batches of one optimizer step."""
    from speedkit.frontend.api import MicroBatches

    model, opt, _ = _plain()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(40, 16), torch.randint(0, 10, (40,))),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    loss = lambda m, b, i: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    with speedkit.apply(model, opt, loader, rungs=["fused_optimizer"], loss_fn=loss) as sk:
        firsts = []
        for _ in range(2):
            seen = [sk.step(batch, i) for i, batch in enumerate(sk.batches())]
            assert len(seen) == 5  # 40 samples / 8
            firsts.append(next(iter(sk.batches()))[1].tolist())
        assert firsts[0] != firsts[1]  # each pass is a new epoch: the sampler shuffles anew
        assert len(list(sk.batches(epochs=3))) == 15
        assert len(list(sk.batches(epochs=None, steps=7))) == 7
        assert len(list(sk.batches(epochs=2, steps=100))) == 10
        endless = sk.batches(epochs=None)
        assert len([next(endless) for _ in range(12)]) == 12
        for bad in (0, -1, 1.5, True, "1"):
            with pytest.raises(speedkit.ConfigError, match="epochs: expected a whole number"):
                sk.batches(epochs=bad)
    model, opt, _ = _plain()
    with speedkit.apply(model, opt, loader, rungs=[], loss_fn=loss, accumulate=2) as sk:
        groups = list(sk.batches())
        assert [len(g) for g in groups] == [2, 2, 1] and all(isinstance(g, MicroBatches) for g in groups)
        assert all(torch.isfinite(sk.step(g, i)) for i, g in enumerate(groups))  # a short last group steps too
        assert [len(g) for g in sk.batches(steps=2)] == [2, 2]
        assert len(list(sk.batches(epochs=2))) == 6  # groups never span the epoch's end
        endless = sk.batches(epochs=None)  # without end, grouped the same way
        assert [len(next(endless)) for _ in range(7)] == [2, 2, 1, 2, 2, 1, 2]


def test_a_plain_model_without_loss_fn_is_told_to_give_one():
    """A forward taking the inputs alone, batches of (inputs, targets): the default loss calls
    model(*batch); a raw TypeError named nothing to fix."""
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    applied = speedkit.apply(model, optimizer, loader, rungs=[])
    with pytest.raises(ConfigError, match=r"^loss_fn: .*does not take the batch's 2 items; give loss_fn=") as raised:
        applied.step(next(iter(loader)))
    assert "\n" not in str(raised.value)
    # a forward that takes the batch but returns logits: the same fix named
    inputs_only = DataLoader(torch.randn(8, 4), batch_size=4)
    with pytest.raises(ConfigError, match=r"returned Tensor of shape \(4, 2\); give loss_fn="):
        speedkit.apply(model, optimizer, inputs_only, rungs=[]).step(next(iter(inputs_only)))

    # a TypeError raised inside a forward that takes the batch is the model's own, as it was
    class Broken(nn.Module):
        def forward(self, x, y):
            raise TypeError("the model's own")

    with pytest.raises(TypeError, match="the model's own"):
        speedkit.apply(Broken(), torch.optim.SGD(model.parameters(), lr=0.1), rungs=[]).step(next(iter(loader)))
