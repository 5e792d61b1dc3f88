"""The channels_last rung: weights, buffers, gradients, optimizer state and inputs in NHWC, in place,
the same numbers as eager, undone to bit-identical contiguous tensors; in speedkit's trials and in a
real Lightning fit."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel_close
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks
from torch.utils.data import DataLoader, TensorDataset

from speedkit.data import BatchSource
from speedkit.engine.ladder import Ladder
from speedkit.lightning import SpeedLadder
from speedkit.rungs.channels_last import (
    ChannelsLastRung,
    ChannelsLastSource,
    channels_last_batch,
)
from speedkit.training.snapshot import Snapshot
from speedkit.training.state import TrainState

CL = torch.channels_last
#: small and quick (as in test_lightning.py): the decisions are not what these tests are about
QUICK = {
    "warmup": 1,
    "steps": 2,
    "repeats": 2,
    "parity_steps": 2,
    "min_blocks": 2,
    "max_blocks": 2,
    "budget_s": 60.0,
    "holds_windows": 1,
    "telemetry": False,
    "final_check": False,
}
IMPLEMENTATIONS = {"foreach": {"foreach": True}, "for-loop": {"foreach": False}, "fused": {"fused": True}}


class ConvNet(nn.Module):
    """Conv2d + BatchNorm2d + ReLU + pool + Linear, and a 4-D buffer (a per-pixel bias); returns the loss."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # a bias before a batch norm has no gradient but noise
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, classes)
        self.register_buffer("bias", 0.1 * torch.randn(1, 8, 8, 8))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x) + self.bias)), 2)
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 4).flatten(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), y)


def _batches(n: int = 6, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(n)]


def _state(impl: str = "foreach", device: str = "cpu") -> TrainState:
    """A conv net whose AdamW already has state (one step taken)."""
    torch.manual_seed(0)
    model = ConvNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **IMPLEMENTATIONS[impl])
    state = TrainState(model=model, optimizer=optimizer, device=torch.device(device), data=BatchSource(_batches(), device))
    state.step([state.data.to_device(_batches(1, seed=7)[0])], 0)
    return state


def _tensors(state: TrainState) -> dict[str, torch.Tensor]:
    """Every tensor the rung may touch, by name: parameters, buffers and optimizer state."""
    found = dict(state.model.named_parameters()) | dict(state.model.named_buffers())
    for name, p in state.model.named_parameters():
        for key, value in state.optimizer.state[p].items():
            if value.dim() > 0:
                found[f"{name}.{key}"] = value
    return found


def _copies(state: TrainState) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _tensors(state).items()}


def _four_d(state: TrainState) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _tensors(state).items() if v.dim() == 4}


def _assert_contiguous_and_equal(state: TrainState, before: dict[str, torch.Tensor]) -> None:
    for name, t in _tensors(state).items():
        assert t.is_contiguous(), name
        assert torch.equal(t, before[name]), name


def _same_objects(state: TrainState, params: list[nn.Parameter]) -> bool:
    now = list(state.model.parameters())
    return len(now) == len(params) and all(a is b for a, b in zip(now, params))


def _train(state: TrainState, steps: int = 4) -> list[torch.Tensor]:
    it = state.data.iterator()
    return [state.step([next(it)], i) for i in range(steps)]


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_apply_converts_in_place_and_undo_restores_bit_identical_tensors(impl):
    state = _state(impl)
    source = state.data
    params = list(state.model.parameters())
    before = _copies(state)
    assert len(_four_d(state)) == 7  # 2 conv weights, their 2 x 2 moments, the bias buffer

    handle = ChannelsLastRung().apply(state)
    assert _same_objects(state, params)
    for name, t in _four_d(state).items():
        assert t.is_contiguous(memory_format=CL) and not t.is_contiguous(), name
    assert all(torch.equal(t, before[k]) for k, t in _tensors(state).items())
    assert isinstance(state.data, ChannelsLastSource) and state.data.inner is source
    assert "2 parameters and 1 buffers" in handle.changes[0] and "4 optimizer state tensors" in handle.changes[0]
    assert any("trial data source" in line for line in handle.changes)

    handle.undo()
    assert _same_objects(state, params) and state.data is source
    _assert_contiguous_and_equal(state, before)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_training_after_apply_matches_eager(impl):
    reference, converted = _state(impl), _state(impl)
    expected = _train(reference)
    seen: list[bool] = []
    converted.model.conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous(memory_format=CL)))
    handle = ChannelsLastRung().apply(converted)
    losses = _train(converted)
    assert seen == [True] * 4  # the trial data source made the inputs channels_last
    assert_rel_close(torch.stack(losses), torch.stack(expected), 1e-5, "losses")
    for (name, p), q in zip(converted.model.named_parameters(), reference.model.parameters()):
        assert_rel_close(p, q, 1e-5, name)
    for name, t in _four_d(converted).items():  # state created or updated by the steps is channels_last too
        assert t.is_contiguous(memory_format=CL), name
    handle.undo()
    assert all(t.is_contiguous() for t in _tensors(converted).values())


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_optimizer_state_restored_contiguous_is_made_channels_last_before_the_step(impl):
    """What the ladder does between trials: a snapshot taken before the rung puts contiguous optimizer
    state back under channels_last parameters. A fused AdamW would pair the wrong elements."""
    reference, converted = _state(impl), _state(impl)
    snapshot = Snapshot(converted.model, converted.optimizer)
    expected = _train(reference)
    handle = ChannelsLastRung().apply(converted)
    snapshot.restore()
    conv = converted.model.conv.weight
    assert conv.is_contiguous(memory_format=CL) and converted.optimizer.state[conv]["exp_avg"].is_contiguous()
    assert_rel_close(torch.stack(_train(converted)), torch.stack(expected), 1e-5, "losses")
    assert converted.optimizer.state[conv]["exp_avg"].is_contiguous(memory_format=CL)
    handle.undo()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_on_cuda_training_from_a_restored_snapshot_matches_eager(impl):
    torch.backends.cudnn.allow_tf32 = False  # fp32 convolutions in both layouts (conftest restores the flag)
    reference, converted = _state(impl, "cuda"), _state(impl, "cuda")
    snapshot = Snapshot(converted.model, converted.optimizer)
    expected = _train(reference)
    handle = ChannelsLastRung().apply(converted)
    snapshot.restore()
    assert_rel_close(torch.stack(_train(converted)), torch.stack(expected), 1e-4, "losses")  # fp32 on CUDA
    assert all(t.is_contiguous(memory_format=CL) for t in _four_d(converted).values())
    handle.undo()
    assert all(t.is_contiguous() for t in _tensors(converted).values())


def test_the_hook_goes_with_undo_and_comes_back_with_resume():
    hooks = len(_global_optimizer_pre_hooks)
    state = _state()
    handle = ChannelsLastRung().apply(state)
    assert len(_global_optimizer_pre_hooks) == hooks + 1
    handle.suspend()
    assert len(_global_optimizer_pre_hooks) == hooks
    handle.resume()
    assert len(_global_optimizer_pre_hooks) == hooks + 1
    handle.undo()
    assert len(_global_optimizer_pre_hooks) == hooks


def test_suspend_and_resume_switch_the_same_objects_any_number_of_times():
    state = _state("fused")
    source, params = state.data, list(state.model.parameters())
    before = _copies(state)
    handle = ChannelsLastRung().apply(state)
    wrapper = state.data
    for _ in range(3):
        handle.suspend()
        assert state.data is source
        _assert_contiguous_and_equal(state, before)
        handle.resume()
        assert state.data is wrapper
        assert all(t.is_contiguous(memory_format=CL) for t in _four_d(state).values())
        assert all(torch.equal(t, before[k]) for k, t in _tensors(state).items())
        assert _same_objects(state, params)
    handle.undo()
    _assert_contiguous_and_equal(state, before)


def test_suspended_training_steps_run_in_the_other_layout():
    """Steps taken while suspended, then resumed: the optimizer state follows the parameters."""
    reference, state = _state("fused"), _state("fused")
    expected = _train(reference, 6)
    handle = ChannelsLastRung().apply(state)
    it = state.data.inner.iterator()
    losses = []
    for i in range(6):
        handle.suspend() if i % 2 else handle.resume()
        losses.append(state.step([state.data.to_device(next(it))], i))
    assert_rel_close(torch.stack(losses), torch.stack(expected), 1e-5, "losses")
    handle.undo()
    assert all(t.is_contiguous() for t in _tensors(state).values())


def test_check_reasons():
    rung = ChannelsLastRung()
    mlp = TrainState(model=nn.Sequential(nn.Linear(4, 4)), optimizer=None, device=torch.device("cpu"))
    assert "no 2-d convolution" in rung.check(mlp)
    state = _state()
    assert rung.check(state) is None
    state.model.to(memory_format=CL)
    assert "already channels_last" in rung.check(state)


def test_batches_convert_only_4d_floating_tensors():
    image, ints, seq = torch.randn(2, 3, 4, 4), torch.zeros(2, 3, 4, 4, dtype=torch.long), torch.randn(2, 3, 4)
    out = channels_last_batch({"image": image, "ids": ints, "seq": seq, "label": 3})
    assert out["image"].is_contiguous(memory_format=CL) and not out["image"].is_contiguous()
    assert torch.equal(out["image"], image)
    assert out["ids"] is ints and out["seq"] is seq and out["label"] == 3
    already = image.contiguous(memory_format=CL)
    assert channels_last_batch([already])[0] is already  # converting twice costs nothing


def test_the_source_wrapper_delegates_all_but_the_layout():
    inner = BatchSource(
        DataLoader(
            TensorDataset(torch.randn(8, 3, 4, 4)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0)
        ),
        "cpu",
    )
    source = ChannelsLastSource(inner)
    assert source.generators() == inner.generators() and source.state_dict()["generators"].generators
    host = source.parity_batches(2)
    assert all(b[0].is_contiguous() for b in host)
    assert source.to_device(host[0])[0].is_contiguous(memory_format=CL)
    assert next(source.iterator())[0].is_contiguous(memory_format=CL)


def test_a_plain_ladder_with_state_already_there_keeps_parity(monkeypatch):
    """The ladder restores a snapshot with optimizer state (contiguous) between trials: parity holds."""
    monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("kept", "forced by the test"))
    state = _state("fused")
    source = state.data
    ladder = Ladder(state, [ChannelsLastRung()], QUICK)
    result = ladder.run()
    entry = result.rungs[1]
    assert entry.status == "kept" and entry.parity.passed and entry.parity.max_rel_diff <= 1e-5, entry
    assert isinstance(state.data, ChannelsLastSource) and state.model.conv.weight.is_contiguous(memory_format=CL)
    ladder.revert()
    assert state.data is source and all(t.is_contiguous() for t in _tensors(state).values())


# -- in a Lightning fit ----------------------------------------------------------------------------------


class LitConvNet(pl.LightningModule):
    """A tiny conv classifier, fused AdamW, its own train loader."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ConvNet()
        g = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(48, 3, 8, 8, generator=g), torch.randint(0, 5, (48,), generator=g))

    def training_step(self, batch, batch_idx):
        return self.net(*batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4, shuffle=True)


class ConvData(pl.LightningDataModule):
    """The module's loader, from a datamodule."""

    def __init__(self, model: LitConvNet) -> None:
        super().__init__()
        self.model = model

    def train_dataloader(self):
        return self.model.train_dataloader()


class TransformingData(ConvData):
    """A datamodule with its own ``on_after_batch_transfer``: Lightning calls it, not the module's."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return [batch[0] * 1.0, batch[1]]  # a new, contiguous tensor


class Probe(pl.Callback):
    """What the fit's steps saw: the first conv's input layout, the loss, the optimizer state's layout."""

    def __init__(self) -> None:
        self.inputs: list[bool] = []
        self.losses: list[float] = []
        self.state_layouts: list[bool] = []

    def on_fit_start(self, trainer, pl_module):
        pl_module.net.conv.register_forward_pre_hook(lambda m, args: self.inputs.append(args[0].is_contiguous(memory_format=CL)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        state = trainer.optimizers[0].state[pl_module.net.conv.weight]
        self.state_layouts.append(state["exp_avg"].is_contiguous(memory_format=CL))


def _fit(callbacks, datamodule: str | None = None, max_steps: int = 4):
    pl.seed_everything(0, verbose=False)
    model = LitConvNet()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    data = {None: None, "plain": ConvData, "overrides": TransformingData}[datamodule]
    data = data(model) if data else None
    trainer.fit(model, datamodule=data)
    return model, trainer


@pytest.mark.parametrize("datamodule", [None, "plain", "overrides"])
def test_given_rung_in_a_lightning_fit_converts_inputs_and_is_undone_at_teardown(datamodule, recwarn):
    plain, converted = Probe(), Probe()
    _fit([plain], datamodule)
    ladder = SpeedLadder(rungs=[ChannelsLastRung()])
    model, trainer = _fit([ladder, converted], datamodule)
    assert ladder.result is None and "channels_last" in ladder.applied_changes
    owner = "TransformingData" if datamodule == "overrides" else "LitConvNet"
    assert any(f"{owner}.on_after_batch_transfer" in line for line in ladder.applied_changes["channels_last"])
    assert converted.inputs == [True] * 4 and plain.inputs == [False] * 4
    assert converted.state_layouts == [True] * 4
    assert_rel_close(torch.tensor(converted.losses), torch.tensor(plain.losses), 1e-5, "losses")
    assert not [w for w in recwarn if "on_after_batch_transfer" in str(w.message)]  # Lightning's hook choice unchanged
    # teardown undid it: contiguous again, hooks gone, optimizer state (the optimizer Lightning built) too
    assert "on_after_batch_transfer" not in model.__dict__
    assert trainer.datamodule is None or "on_after_batch_transfer" not in trainer.datamodule.__dict__
    assert all(t.is_contiguous() for t in [*model.parameters(), *model.buffers()])
    assert all(v.is_contiguous() for st in trainer.optimizers[0].state.values() for v in st.values())


@pytest.mark.parametrize("forced", [True, False], ids=["kept-forced", "real-decision"])
def test_trials_in_a_lightning_fit_then_training_matches(forced, monkeypatch):
    if forced:
        monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("kept", "forced by the test"))
    plain, trained = Probe(), Probe()
    _fit([plain], max_steps=6)
    ladder = SpeedLadder(rungs=[ChannelsLastRung()], trials="always", measure=QUICK)
    model, _ = _fit([ladder, trained], max_steps=6)
    entry = ladder.result.rungs[1]
    assert entry.name == "channels_last" and entry.status in ("kept", "reverted"), (entry.status, entry.reason)
    assert entry.parity is not None and entry.parity.passed
    kept = entry.status == "kept"
    assert kept or not forced, entry.reason
    fit_inputs = trained.inputs[-6:]  # the trials' forwards come first
    assert fit_inputs == [kept] * 6 and trained.state_layouts == [kept] * 6
    assert_rel_close(torch.tensor(trained.losses), torch.tensor(plain.losses), 1e-5, "losses")
    assert "on_after_batch_transfer" not in model.__dict__ and all(p.is_contiguous() for p in model.parameters())
