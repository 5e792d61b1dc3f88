"""activation_checkpointing (issue 58): each repeated block recomputes its activations in the backward.
The same function, bit for bit on a CPU, dropout included (the recompute replays the forward's random
state); undo leaves the blocks as they were; it says why not where there is nothing for it to buy or to
checkpoint."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import QUIET_TRAINER
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedkit import rungs
from speedkit.lightning import SpeedLadder
from speedkit.rungs.activation_checkpointing import CheckpointedForward, repeated_blocks
from speedkit.training.state import TrainState
from speedkit.training.step import PlainStep


class Block(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.norm, self.up, self.down, self.drop = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(3 * d, d), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(7, 24), nn.ModuleList(Block() for _ in range(3)), nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, scale=0.5)  # a keyword argument passes through the checkpoint
        return self.out(h)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _state(accumulate: int = 2) -> TrainState:
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = PlainStep(model, opt, torch.device("cpu"), accumulate=accumulate, loss_fn=_loss)
    return TrainState(model=model, optimizer=opt, device="cpu", step=step)


def _train(state: TrainState, steps: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # dropout's masks
    for i in range(steps):
        batches = [(torch.randn(9, 7, generator=g), torch.randint(0, 5, (9,), generator=g)) for _ in range(state.step.accumulate)]
        state.step(batches, i)
    return [p.detach().clone() for p in state.model.parameters()]


def test_checkpointed_blocks_train_exactly_as_without_and_undo_puts_them_back():
    plain = _train(_state())
    state = _state()
    rung = rungs.make("activation_checkpointing")
    assert rung.check(state) is None
    handle = rung.apply(state)
    assert all(isinstance(b.__dict__["forward"], CheckpointedForward) for b in state.model.blocks)
    assert "3 Block blocks recompute their activations" in " ".join(handle.changes)
    recomputed = {"n": 0}
    hook = state.model.blocks[0].up.register_forward_hook(lambda *a: recomputed.__setitem__("n", recomputed["n"] + 1))
    checkpointed = _train(state)
    hook.remove()
    assert recomputed["n"] == 4 * 2 * 2  # 4 steps of 2 micro-batches: each forward of the block once more in the backward
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))  # dropout's masks replayed too
    handle.undo()
    assert all("forward" not in b.__dict__ for b in state.model.blocks)
    handle = rung.apply(state)
    recomputed["n"] = 0
    hook = state.model.blocks[0].up.register_forward_hook(lambda *a: recomputed.__setitem__("n", recomputed["n"] + 1))
    with torch.no_grad():  # passes without gradients run the forward as it is: nothing to recompute
        state.model(torch.randn(2, 7))
    hook.remove()
    assert recomputed["n"] == 1
    handle.undo()


def test_it_says_why_not():
    make = rungs.make
    assert "accumulates no gradients" in make("activation_checkpointing").check(_state(accumulate=1))
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    opt = torch.optim.SGD(flat.parameters(), lr=0.1)
    state = TrainState(model=flat, optimizer=opt, device="cpu", step=PlainStep(flat, opt, torch.device("cpu"), accumulate=2))
    assert "no repeated blocks" in make("activation_checkpointing").check(state)
    state = _state()
    for block in state.model.blocks:
        block.gradient_checkpointing = True  # transformers' own switch, as its layers record it
    assert "the library's own switch" in make("activation_checkpointing").check(state)
    model = _state().model
    assert repeated_blocks(model) == list(model.blocks)


class StackModule(pl.LightningModule):
    """The stack of blocks in a Lightning fit that accumulates gradients over 4 micro-batches."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Stack()
        self.params_after: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.params_after.append([p.detach().clone() for p in self.parameters()])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _lightning_fit(callbacks: list) -> StackModule:
    torch.manual_seed(0)
    module = StackModule()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 7, generator=g), torch.randint(0, 5, (256,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        accumulate_grad_batches=4,
        **QUIET_TRAINER,
        callbacks=callbacks,
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=8, shuffle=True))
    return module


@pytest.mark.filterwarnings("ignore")
def test_with_micro_batch_the_trials_train_as_both_given_by_hand():
    """The pair the ladder judges together (the memory checkpointing frees buys micro_batch's merge):
    kept by the trials (forced), the fit trains exactly as with both given by hand, the checkpointed
    blocks running inside the merged micro-batches."""
    from test_fsdp import QUICK, forced

    with forced("kept"):
        tried = SpeedLadder(rungs=["micro_batch", "activation_checkpointing"], trials="always", measure=QUICK, cache=False)
        trained = _lightning_fit([tried])
    kept = [{"name": r.name, "options": r.options} for r in tried.result.kept]
    assert sorted(k["name"] for k in kept) == ["activation_checkpointing", "micro_batch"], tried.result.rungs
    given = SpeedLadder(rungs=kept)
    by_hand = _lightning_fit([given])
    assert sorted(given.applied_changes) == ["activation_checkpointing", "micro_batch"], given.skipped
    assert len(trained.params_after) == len(by_hand.params_after) > 0
    for step, (a, b) in enumerate(zip(trained.params_after, by_hand.params_after, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), step
