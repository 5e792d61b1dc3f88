"""The micro_batch rung on the CPU: merged micro-batches train to the parameters of the unmerged
accumulation (fp32, rel 1e-5) on the same samples in the same order, in a plain step and in a
Lightning fit (scheduler, clipping, two epochs, the counts it keeps in batches put back after), and
the rung says why it does not apply where merging would change what the run computes."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from ranks import spawn_ranks
from torch import nn
from torch.nn import functional as F

from speedkit.data.source import BatchSource
from speedkit.lightning import SpeedLadder
from speedkit.rungs.micro_batch import MergedStep, MicroBatchOptions, MicroBatchRung, largest_fitting_factor
from speedkit.training.accumulate import merge_batches, split_batch
from speedkit.training.state import TrainState
from speedkit.training.step import PlainStep

SAMPLES, BATCH, FEATURES, CLASSES = 256, 8, 10, 4


def _data(g: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = g or torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)


class Net(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(FEATURES, 32), nn.BatchNorm1d(32) if norm else nn.LayerNorm(32), nn.GELU(), nn.Linear(32, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _loss(model: nn.Module, batch, batch_idx: int = 0) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# -- merging batches -------------------------------------------------------------------------------
def test_merge_is_the_inverse_of_split_and_keeps_shared_leaves_once():
    mask = torch.tril(torch.ones(5, 5))
    batch = {"x": torch.randn(6, 5), "y": torch.arange(6), "mask": mask, "name": "wiki"}
    parts = [part for part, _ in split_batch(batch, 3)]
    merged, why = merge_batches(parts)
    assert why is None
    assert torch.equal(merged["x"], batch["x"]) and torch.equal(merged["y"], batch["y"])
    assert merged["mask"] is parts[0]["mask"] and merged["name"] == "wiki"


@pytest.mark.parametrize(
    "other, words",
    [
        ({"x": torch.randn(2, 7), "y": torch.arange(2)}, "apart from the batch dimension"),
        ({"x": torch.randn(2, 5), "y": torch.arange(2), "z": torch.ones(2)}, "structure"),
        ({"x": torch.randn(2, 5), "y": torch.arange(2.0)}, "dtype"),
    ],
)
def test_batches_that_do_not_concatenate_do_not_merge(other, words):
    merged, why = merge_batches([{"x": torch.randn(2, 5), "y": torch.arange(2)}, other])
    assert merged is None and words in why


def test_a_shared_leaf_that_differs_does_not_merge():
    _, why = merge_batches([(torch.ones(2, 3), "a"), (torch.ones(2, 3), "b")])
    assert "differs" in why


# -- a plain step ----------------------------------------------------------------------------------
def _plain_steps(factor: int | None, accumulate: int = 4, steps: int = 12) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = PlainStep(model, opt, torch.device("cpu"), loss_fn=_loss, accumulate=accumulate, clip_grad_norm=0.5)
    if factor is not None:
        step = MergedStep(step, factor)
    x, y = _data()
    losses = []
    for i in range(steps):
        lo = i * accumulate * BATCH
        micro = [(x[lo + k * BATCH : lo + (k + 1) * BATCH], y[lo + k * BATCH : lo + (k + 1) * BATCH]) for k in range(accumulate)]
        losses.append(float(step(micro, i)))
    return [p.detach().clone() for p in model.parameters()], losses


@pytest.mark.parametrize("factor", [2, 4])
def test_merged_micro_batches_train_to_the_parameters_of_the_accumulation(factor):
    ref, ref_losses = _plain_steps(None, steps=8)
    got, losses = _plain_steps(factor, steps=8)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_a_step_whose_batches_do_not_merge_runs_them_as_they_are():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    step = PlainStep(
        model, opt, torch.device("cpu"), loss_fn=lambda m, b, i: (calls.append(b[0].shape[0]), m(b[0]).mean())[1], accumulate=2
    )
    merged = MergedStep(step, 2)
    merged([(torch.ones(2, 3), "a"), (torch.ones(2, 3), "b")], 0)
    merged([(torch.ones(2, 3), "a"), (torch.ones(2, 3), "a")], 1)
    assert calls == [2, 2, 4]
    assert merged.unmerged_steps == 1 and merged.merged_steps == 1 and "differs" in merged.report()[1]


# -- where it applies ---------------------------------------------------------------------------
def _state(accumulate: int = 4, norm: bool = False, batches=None) -> TrainState:
    model = Net(norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    batches = batches or [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, 64, BATCH)]
    step = PlainStep(model, opt, torch.device("cpu"), loss_fn=_loss, accumulate=accumulate)
    return TrainState(
        model=model, optimizer=opt, device=torch.device("cpu"), step=step, data=BatchSource(batches, torch.device("cpu"))
    )


def test_it_applies_only_where_merging_keeps_what_the_run_computes():
    rung = MicroBatchRung()
    assert rung.check(_state()) is None
    assert "accumulates no gradients" in rung.check(_state(accumulate=1))
    assert "BatchNorm" in rung.check(_state(norm=True))
    assert "does not divide" in MicroBatchRung(MicroBatchOptions(factor=3)).check(_state())
    padded = [(torch.randn(BATCH, 5 + i), torch.zeros(BATCH, dtype=torch.long)) for i in range(4)]
    assert "do not merge" in rung.check(_state(batches=padded))


def test_apply_wraps_the_step_and_undo_puts_it_back():
    state = _state()
    before = state.step
    handle = MicroBatchRung().apply(state)
    assert isinstance(state.step, MergedStep) and state.step.factor == 4
    assert "4 micro-batches merged into one: 1 forward and backward passes per optimizer step instead of 4" in handle.changes[0]
    handle.undo()
    assert state.step is before


def test_the_default_factor_is_the_largest_divisor_whose_predicted_peak_fits():
    gib = 2**30
    # 10 GiB of weights, gradients and state, 12 GiB of activations a micro-batch, on an 80 GiB device
    k, why = largest_fitting_factor(8, peak_bytes=22 * gib, state_bytes=10 * gib, total_bytes=80 * gib)
    assert k == 4 and "fits 90%" in why  # 10 + 4 x 12 = 58 GiB; 8 x 12 would need 106
    assert largest_fitting_factor(8, 75 * gib, 10 * gib, 80 * gib)[0] == 1
    assert largest_fitting_factor(6, None, 0, None)[0] == 6


# -- a Lightning fit ---------------------------------------------------------------------------------
class IndexedSet(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = _data()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class LitNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.seen: list[int] = []
        self.batch_sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.extend(idx.tolist())
        self.batch_sizes.append(len(idx))
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), "interval": "step"}}


def _fit(callbacks: list, accumulate: int = 4) -> tuple[LitNet, pl.Trainer]:
    module = LitNet()
    loader = torch.utils.data.DataLoader(IndexedSet(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=loader)
    return module, trainer


def test_a_lightning_fit_with_merged_micro_batches_trains_as_the_accumulation_does():
    ref, ref_trainer = _fit([])
    ladder = SpeedLadder(rungs=[{"name": "micro_batch", "options": {"factor": 4}}], trials=False)
    got, trainer = _fit([ladder])
    assert "micro_batch" in ladder.applied_changes, ladder.skipped
    assert any("4 at a time" in line for line in ladder.applied_changes["micro_batch"])
    assert trainer.global_step == ref_trainer.global_step == 2 * SAMPLES // (4 * BATCH)
    assert got.seen == ref.seen  # every sample once per epoch, in the same order
    assert set(ref.batch_sizes) == {BATCH} and set(got.batch_sizes) == {4 * BATCH}  # one pass per optimizer step
    for a, b in zip(got.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert trainer.accumulate_grad_batches == 4  # put back after the fit


def test_a_fit_that_does_not_accumulate_is_left_as_it_is():
    ladder = SpeedLadder(rungs=["micro_batch"], trials=False)
    with pytest.warns(UserWarning, match="accumulates no gradients"):
        _fit([ladder], accumulate=1)
    assert "micro_batch" in ladder.skipped and "micro_batch" not in ladder.applied_changes


def test_the_ladder_judges_merged_micro_batches_and_the_fit_keeps_its_samples():
    ref, _ = _fit([])
    measure = {
        "warmup": 1,
        "steps": 2,
        "repeats": 2,
        "parity_steps": 2,
        "min_blocks": 2,
        "max_blocks": 2,
        "settle": 0,
        "budget_s": 10.0,
        "holds_windows": 1,
        "telemetry": False,
        "final_check": False,
        "switches_floor": False,
    }
    ladder = SpeedLadder(rungs=["micro_batch"], trials="always", measure=measure)
    got, trainer = _fit([ladder])
    entry = next(r for r in ladder.result.rungs if r.name == "micro_batch")
    assert entry.status in ("kept", "reverted"), entry.reason  # it passed parity: a decision on speed
    assert entry.parity is not None and entry.parity.passed
    assert got.seen[-2 * SAMPLES :] == ref.seen  # the fit after the trials: the same samples in the same order
    if entry.status == "kept":
        assert set(got.batch_sizes[-4:]) == {4 * BATCH}
    assert trainer.accumulate_grad_batches == 4


def test_with_dropout_parity_is_judged_with_dropout_off():
    state = _state()
    state.model.body.insert(3, nn.Dropout(0.1))
    assert MicroBatchRung().apply(state).draws_differently
    assert not MicroBatchRung().apply(_state()).draws_differently


def _agree_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks, each predicting another factor: both merge the smallest."""
    import os

    import torch.distributed as dist

    from speedkit.rungs import micro_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    micro_batch.MicroBatchRung.factor = lambda self, state: (4, "rank 0's") if rank == 0 else (2, "rank 1's")
    state = _state(accumulate=8)
    MicroBatchRung().apply(state)
    torch.save({"factor": state.step.factor}, f"{out}/rank{rank}.pt")


def test_under_ddp_every_rank_merges_as_many_micro_batches(tmp_path):
    spawn_ranks(_agree_worker, str(tmp_path))
    assert [torch.load(tmp_path / f"rank{r}.pt")["factor"] for r in range(2)] == [2, 2]
