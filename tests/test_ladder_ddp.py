"""SpeedLadder's trials across two processes (Lightning DDP, gloo on the CPU): every rank climbs in
step, takes the same decisions, a rung that fails on one rank fails on both (no hang), rank 0 writes
the one report with each rank's figures, and the fit trains as it would without speedkit."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import test_lightning
import torch
import torch.nn.functional as F
from ranks import EndProcessGroupAtExit, run_in_process
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedkit.handle import Handle
from speedkit.lightning import SpeedLadder
from speedkit.rungs.base import Rung

QUICK = {**test_lightning.QUICK, "switches_floor": False, "together_passes": 0}


class FailsOnRank1(Rung):
    """A rung whose apply raises on rank 1 only (rank 0 applies it)."""

    name = "fails_on_rank_1"

    def apply(self, state):
        if torch.distributed.get_rank() == 1:
            raise ValueError("planted: this rank cannot apply it")
        handle = Handle(self.name)
        handle.record("nothing (rank 0 applied it)", lambda: None)
        return handle


class RunsOutOfMemoryOnRank1(nn.Module):
    """Its forward runs out of memory on rank 1, after the layers before it ran."""

    def forward(self, x):
        if torch.distributed.get_rank() == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (planted)")
        return F.gelu(x)


class OutOfMemoryOnRank1(Rung):
    """A rung under which rank 1's training step runs out of memory (in the middle of the forward)."""

    name = "oom_on_rank_1"

    def apply(self, state):
        handle = Handle(self.name)
        net, before, planted = state.model.net, state.model.net[1], RunsOutOfMemoryOnRank1()
        net[1] = planted
        handle.record(
            "net[1] runs out of memory on rank 1", lambda: net.__setitem__(1, before), lambda: net.__setitem__(1, planted)
        )
        return handle


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))
        g = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 5, (256,), generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3), "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8, shuffle=True)


class Saver(pl.Callback):
    """Each rank's parameters and losses at the end of the fit, and the ladder's decisions."""

    def __init__(self, out: str) -> None:
        self.out, self.losses = out, []

    first_step: int | None = None

    def on_train_start(self, trainer, pl_module):
        self.first_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        ladder = next((c for c in trainer.callbacks if isinstance(c, SpeedLadder)), None)
        result = ladder.result if ladder is not None else None
        torch.save(
            {
                "params": [p.detach().clone() for p in pl_module.parameters()],
                "losses": self.losses,
                "decisions": [(r.name, r.status) for r in result.rungs] if result else None,
                "reasons": {r.name: r.reason for r in result.rungs} if result else None,
                "not_run": ladder.not_run if ladder is not None else None,
                "kept": ladder.applied if ladder is not None else None,
                "resumed": ladder.resumed if ladder is not None else None,
                "first_step": self.first_step,
            },
            f"{self.out}/rank{trainer.global_rank}.pt",
        )


def ddp_fit(out: str, trials: bool, resume: str | None = None, all_three: bool = False) -> None:
    """A 2-process DDP fit on the CPU (gloo), with SpeedLadder's trials when ``trials``, a checkpoint
    every 6 steps, resumed from ``resume`` where given; run as its own process."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.multiprocessing.set_sharing_strategy("file_system")
    pl.seed_everything(0, verbose=False)
    from speedkit.lightning import OOMFallback, SpeedProfiler

    ladder = SpeedLadder(
        rungs=["gc_freeze"] if all_three else ["gc_freeze", FailsOnRank1(), OutOfMemoryOnRank1()],
        trials="always",
        measure=QUICK,
        report_dir=f"{out}/report",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=10,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            *([SpeedProfiler(), ladder, OOMFallback()] if all_three else [ladder] if trials else []),
            Saver(out),
            ModelCheckpoint(dirpath=f"{out}/ckpt", every_n_train_steps=6, save_top_k=-1),
            EndProcessGroupAtExit(),
        ],
    )
    trainer.fit(Net(), ckpt_path=resume)


def _run(out: Path, trials: bool, resume: Path | None = None, all_three: bool = False) -> list[dict]:
    out.mkdir()
    call = f"ddp_fit({str(out)!r}, {trials}, {str(resume) if resume else None!r}, {all_three})"
    run_in_process("test_ladder_ddp", call, timeout_s=300)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_trials_across_two_ranks_decide_alike_survive_a_one_rank_failure_and_train_as_without(tmp_path):
    reference = _run(tmp_path / "without", trials=False)
    ranks = _run(tmp_path / "with", trials=True)
    assert ranks[0]["not_run"] is None, ranks[0]["not_run"]
    # the same decisions on both ranks, rung by rung
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    statuses = dict(ranks[0]["decisions"])
    # a rung that fails on one rank fails on both: rank 1's own error there, named on rank 0
    assert statuses["fails_on_rank_1"] == statuses["oom_on_rank_1"] == "failed"
    assert ranks[0]["reasons"]["fails_on_rank_1"].startswith("RankFailed: rank 1: ValueError: planted")
    assert "planted" in ranks[1]["reasons"]["fails_on_rank_1"]
    assert ranks[1]["reasons"]["oom_on_rank_1"] == "out of memory while trying this rung"
    assert "rank 1: OutOfMemoryError" in ranks[0]["reasons"]["oom_on_rank_1"]
    assert ranks[0]["kept"] == ranks[1]["kept"]
    # the fit after the trials: the ranks agree, and train as the fit without speedkit (rungs that keep numerics)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
    for mine, theirs in zip(ranks[0]["params"], reference[0]["params"]):
        assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    for r in range(2):
        assert ranks[r]["losses"] == pytest.approx(reference[r]["losses"], rel=1e-5)
    # one report, rank 0's, with every rank's figures
    report = json.loads((tmp_path / "with" / "report" / "report.json").read_text())
    base = report["rungs"][0]["measurement"]
    assert [r["rank"] for r in base["ranks"]] == [0, 1]
    assert base["step_ms"] == pytest.approx(max(r["step_ms"] for r in base["ranks"]), rel=0.5)
    assert report["run"]["world_size"] == 2
    scaling = report["run"]["scaling"]
    assert scaling["world_size"] == 2 and 0 < scaling["efficiency"] < 5  # a CPU's gloo: noisy, but measured
    assert scaling["efficiency"] == pytest.approx(scaling["step_ms_unsynced"] / scaling["step_ms_synced"], rel=1e-3)
    markdown = (tmp_path / "with" / "report" / "report.md").read_text()
    assert "## Across ranks" in markdown and "Scaling efficiency over 2 ranks" in markdown and "(slowest)" in markdown

    # checkpoint, then resume: the decisions come back without trials, on both ranks
    saved = tmp_path / "with" / "ckpt" / "epoch=0-step=6.ckpt"
    checkpoint = torch.load(saved, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("SpeedLadder")]
    assert checkpoint["callbacks"][key]["kept"] == [r for r in ["gc_freeze"] if r in ranks[0]["kept"]]
    # as a fit that kept both writes it (which rungs pay on this CPU is not what is tested here)
    checkpoint["callbacks"][key]["kept"] = ["gc_freeze", "fused_optimizer"]
    torch.save(checkpoint, tmp_path / "kept.ckpt")
    resumed = _run(tmp_path / "resumed", trials=True, resume=tmp_path / "kept.ckpt")
    for r in range(2):
        assert resumed[r]["resumed"] == ["gc_freeze", "fused_optimizer"]
        assert resumed[r]["decisions"] is None and resumed[r]["not_run"] is None  # no trials ran
        assert sorted(resumed[r]["kept"]) == ["fused_optimizer", "gc_freeze"]
        assert resumed[r]["first_step"] == 6
    assert all(torch.equal(a, b) for a, b in zip(resumed[0]["params"], resumed[1]["params"]))

    # the three callbacks together (the profiler first, the fallback last), the ladder with trials:
    # the fit trains as without speedkit
    three = _run(tmp_path / "three", trials=True, all_three=True)
    assert three[0]["decisions"] == three[1]["decisions"] and three[0]["not_run"] is None
    for r in range(2):
        assert three[r]["losses"] == pytest.approx(reference[r]["losses"], rel=1e-5)
    for mine, theirs in zip(three[0]["params"], reference[0]["params"]):
        assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)
