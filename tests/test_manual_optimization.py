"""SpeedLadder on a LightningModule with manual optimization (``automatic_optimization = False``):
a GAN stepping two optimizers inside its own ``training_step`` (issue 57)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedkit.handle import Handle, set_attr
from speedkit.lightning import SpeedLadder
from speedkit.lightning.manual_step import USER_STEPS_OPTIMIZERS
from speedkit.rungs.base import Rung

QUICK = {
    "warmup": 1,
    "steps": 3,
    "repeats": 2,
    "parity_steps": 2,
    "min_blocks": 4,
    "max_blocks": 8,
    "budget_s": 60.0,
    "holds_windows": 1,
    "telemetry": False,
    "profile": False,
}


class Discriminator(nn.Module):
    """Shared features, then an ensemble of linear heads (one weight tensor, a slice per head) whose
    scores are averaged, computed one head at a time in a Python loop: the batched rung's kind of model."""

    def __init__(self, dim: int, width: int = 64, heads: int = 128) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(dim, width), nn.LeakyReLU(0.2))
        self.heads = nn.Parameter(torch.randn(heads, width, 1) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        scores = []
        for i in range(self.heads.shape[0]):
            scores.append(h @ self.heads[i])
        return torch.stack(scores).mean(dim=0).squeeze(-1)


class GAN(pl.LightningModule):
    """A GAN trained the way Lightning's GAN example trains one: manual optimization, the generator's
    and the discriminator's Adam each toggled, stepped and zeroed by hand, both losses logged."""

    def __init__(self, latent: int = 16, dim: int = 32, n: int = 512, batch_size: int = 32) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.latent = latent
        self.generator = nn.Sequential(nn.Linear(latent, 64), nn.ReLU(), nn.Linear(64, dim))
        self.discriminator = Discriminator(dim)
        g = torch.Generator().manual_seed(3)
        self.data = TensorDataset(torch.randn(n, dim, generator=g) * 0.5 + 1.0)
        self.batch_size = batch_size
        self.losses: list[tuple[float, float]] = []

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], self.latent, device=self.device)
        ones, zeros = torch.ones(real.shape[0], device=self.device), torch.zeros(real.shape[0], device=self.device)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = 0.5 * (
            F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
            + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
        )
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)
        self.losses.append((g_loss.item(), d_loss.item()))

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        return [opt_g, opt_d]

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True)


def _fit(ladder: SpeedLadder, max_steps: int = 8) -> tuple[GAN, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model = GAN()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ladder],
    )
    trainer.fit(model)
    return model, trainer


def test_a_manual_optimization_gan_keeps_a_measured_rung_and_trains_as_with_it_given_by_hand(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ladder = SpeedLadder(
        rungs=["batched", "cuda_graph", "micro_batch", "fused_optimizer"], trials="always", measure=QUICK, cache=False
    )
    model, trainer = _fit(ladder)
    result = ladder.result
    assert ladder.not_run is None and result is not None and result.interrupted is None
    assert result.run["optimization"] == "manual" and result.run["optimizer"] == "Adam, Adam"
    statuses = {r.name: r for r in result.rungs[1:]}
    # the ensemble's 48 heads in one GEMM: measured, and kept on its speed
    batched = statuses["batched"]
    assert batched.status == "kept", batched.reason
    assert batched.comparison is not None and result.figures()["rungs"]["batched"]["speedup"] > 1.0
    for name in ("cuda_graph", "micro_batch"):  # they run the optimizer step themselves: each says why not
        assert statuses[name].status == "not_applicable" and statuses[name].reason == USER_STEPS_OPTIMIZERS
    fused = statuses["fused_optimizer"]  # both Adams switched, each from the user's flags
    assert fused.status in ("kept", "reverted") and fused.parity.passed, fused.reason
    assert any(c.startswith("optimizer 0 of 2: Adam: ") for c in fused.changes), fused.changes
    assert any(c.startswith("optimizer 1 of 2: Adam: ") for c in fused.changes), fused.changes
    assert len(model.losses) == 8 and trainer.global_step == 16  # the trials took no real step (two optimizers a batch)

    kept = [{"name": r.name, "options": r.options} for r in result.kept]
    by_hand = SpeedLadder(rungs=kept)
    replayed, _ = _fit(by_hand)
    assert set(by_hand.applied_changes) == {r.name for r in result.kept}
    assert model.losses == replayed.losses  # exactly: the same weights, both optimizers, RNG and data order
    for a, b in zip(model.parameters(), replayed.parameters()):
        assert torch.equal(a, b)
    assert "forward" not in model.discriminator.__dict__  # everything undone after the fit
    assert all(g["fused"] is None for opt in trainer.optimizers for g in opt.param_groups)


def test_the_trials_put_both_optimizers_back():
    """Trials step both Adams many times; the fit after them starts from the state before them: its
    losses are those of a fit without speedkit."""
    plain, _ = _fit(SpeedLadder(rungs=[]))
    tried, _ = _fit(SpeedLadder(rungs=["gc_freeze"], trials="always", measure=QUICK, cache=False))
    assert plain.losses == tried.losses and len(plain.losses) == 8


def test_manual_optimization_parity_reads_every_backpropagated_loss():
    """The step's loss for parity is the sum of the losses given to manual_backward (the generator's
    and the discriminator's), not nothing: the GAN's training_step returns None."""
    seen: list[float] = []

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            from speedkit.lightning.manual_step import fit_step
            from speedkit.lightning.step import LightningSource

            step, source = fit_step(trainer, pl_module), LightningSource(trainer, pl_module)
            batch = source.to_device(next(iter(source.epoch())))
            before = len(pl_module.losses)
            with step.trial():
                loss = step([batch], 0)
            g, d = pl_module.losses[before]
            seen.extend([float(loss), g + d])
            pl_module.losses[before:] = []
            source.release()

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe()],
    )
    trainer.fit(GAN())
    assert seen[0] == pytest.approx(seen[1], rel=1e-6)


class _BreaksTheDiscriminator(Rung):
    """A rung whose discriminator raises on its first call: inside the generator's phase, after
    ``toggle_optimizer(opt_g)`` turned the discriminator's gradients off and before its untoggle."""

    name = "breaks_the_discriminator"

    def apply(self, state):
        handle = Handle(self.name)
        net = state.model.discriminator

        def forward(x):
            raise RuntimeError("the discriminator broke")

        set_attr(handle, net, "forward", forward, "discriminator.forward raises")
        return handle


def test_a_rung_failing_between_toggle_and_untoggle_leaves_the_fit_training_as_without_speedkit():
    """Found on an H200 (DCGAN): a rung combination that failed inside the generator's phase left the
    discriminator's parameters without gradients (its untoggle never ran), and the fit after the trials
    failed with "element 0 of tensors does not require grad". The snapshot puts requires_grad back."""
    plain, _ = _fit(SpeedLadder(rungs=[]))
    ladder = SpeedLadder(rungs=[_BreaksTheDiscriminator()], trials="always", measure=QUICK, cache=False)
    tried, _ = _fit(ladder)
    entry = next(r for r in ladder.result.rungs if r.name == "breaks_the_discriminator")
    assert entry.status == "failed" and "the discriminator broke" in entry.reason
    assert all(p.requires_grad for p in tried.parameters())
    assert tried.losses == plain.losses


def test_manual_optimization_across_processes_runs_no_trials_and_says_why():
    """The DDP guards average gradients around an optimizer step the user's code holds: one warning,
    nothing applied, the fit goes on as set up."""
    from types import SimpleNamespace

    ladder = SpeedLadder(trials="always", cache=False)
    module = GAN()
    trainer = SimpleNamespace(world_size=2)
    with pytest.warns(UserWarning, match="manual optimization across 2 processes"):
        ladder.on_train_start(trainer, module)
    assert ladder.result is None and ladder.handles == [] and "one process only" in ladder.not_run
