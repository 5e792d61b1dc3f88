"""Whole-step CUDA graphs under Lightning's DDP on two GPUs (NCCL): every rank warms up past DDP's first
iterations, captures DDP's step with its bucketed all-reduces, and replays in step with the others;
the fit trains as the same DDP fit without the graph, and the ranks' parameters stay identical. Each
fit runs in a process of its own (Lightning's launcher spawns the ranks)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from ranks import run_in_process
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.gpu

STEPS = 40
#: the trials fit's steps: the trials take theirs from the fit, and the graph bound into the fit after
#: them counts its own captures and replays (it warms up again first), so the fit needs steps left
TRIALS_STEPS = 160


class Logged(pl.LightningModule):
    """An MLP with a per-step StepLR schedule and a logged loss (165 samples: each of two ranks gets
    5 batches of 16 and a short one of 3 per epoch)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        # capturable in the run without the graph too: the graph's optimizer rounds as a capturable one does
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, capturable=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        data = TensorDataset(torch.randn(165, 32, generator=g), torch.randint(0, 10, (165,), generator=g))
        return DataLoader(data, batch_size=16)


class Ragged(Logged):
    """Batches of 16 on both ranks, except rank 1's 4th of every 10, of 12: a batch the graph's buffers
    do not fit on one rank only (as sequences padded per batch give); no DistributedSampler."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2 + self.trainer.global_rank)
        data = TensorDataset(torch.randn(160, 32, generator=g), torch.randint(0, 10, (160,), generator=g))
        sizes = [12 if self.trainer.global_rank == 1 and i % 10 == 3 else 16 for i in range(10)]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return DataLoader(data, batch_sampler=[list(range(a, a + n)) for a, n in zip(starts, sizes)])


class Saver(pl.Callback):
    """Each rank's losses, parameters, the graph's report and the ladder's decisions."""

    def __init__(self, out: str) -> None:
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        from speedkit.cudagraph.graphed_step import GraphedStep
        from speedkit.lightning import SpeedLadder

        ladder = next((c for c in trainer.callbacks if isinstance(c, SpeedLadder)), None)
        state = ladder._state if ladder is not None else None
        step = state.step if state is not None else None
        while step is not None and not isinstance(step, GraphedStep):
            step = getattr(step, "inner", None)
        result = ladder.result if ladder is not None else None
        torch.save(
            {
                "losses": self.losses,
                "params": [p.detach().cpu().clone() for p in pl_module.parameters()],
                "graph": None if step is None else {**step.counts(), "report": step.report()},
                "decisions": {r.name: (r.status, r.reason) for r in result.rungs} if result else None,
                "kept": ladder.applied if ladder is not None else None,
            },
            f"{self.out}/rank{trainer.global_rank}.pt",
        )


def ddp_graph_fit(out: str, mode: str) -> None:
    """A 2-GPU DDP fit of ``Logged``: ``plain`` (no speedkit), ``given`` (the graph from the fit's start),
    ``trials`` (SpeedLadder's trials of ddp_static_graph, which swaps DDP's wrapper, then the graph), or
    ``ragged`` / ``ragged_plain`` (``Ragged``'s batches, with the graph from the start / without speedkit)."""
    from speedkit.lightning import SpeedLadder

    torch.backends.cuda.matmul.allow_tf32 = False
    pl.seed_everything(0, verbose=False)
    ladder = {
        "plain": [],
        "given": [SpeedLadder(rungs=["cuda_graph"])],
        "ragged": [SpeedLadder(rungs=["cuda_graph"])],
        "ragged_plain": [],
        "trials": [
            SpeedLadder(
                rungs=["ddp_static_graph", "cuda_graph"],
                trials="always",
                measure={"warmup": 2, "steps": 4, "repeats": 2, "parity_steps": 3, "budget_s": 60},
                report_dir=f"{out}/report",
            )
        ],
    }[mode]
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=TRIALS_STEPS if mode == "trials" else STEPS,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*ladder, Saver(out)],
        use_distributed_sampler=not mode.startswith("ragged"),
    )
    trainer.fit(Ragged() if mode.startswith("ragged") else Logged())


def _fit(tmp_path: Path, mode: str) -> list[dict]:
    out = tmp_path / mode
    out.mkdir()
    run_in_process("test_cuda_graph_ddp_gpu", f"ddp_graph_fit({str(out)!r}, {mode!r})", timeout_s=300, what=f"the {mode} fit")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    return _fit(tmp_path_factory.mktemp("plain"), "plain")


def test_a_graphed_ddp_fit_replays_on_both_ranks_and_trains_as_without_it(plain, tmp_path):
    ranks = _fit(tmp_path, "given")
    for rank, saved in enumerate(ranks):
        graph = saved["graph"]
        assert graph is not None and graph["stopped"] is None, (rank, graph)
        # DDP's first 11 iterations and one checked step run eagerly, then the capture; 7 short batches run eagerly
        assert graph["captures"] == 1 and graph["replays"] >= STEPS - 13 - 7, (rank, graph)
    assert ranks[0]["graph"]["replays"] == ranks[1]["graph"]["replays"]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
    for saved, base in zip(ranks, plain):
        assert len(saved["losses"]) == len(base["losses"]) == STEPS
        for a, b in zip(saved["losses"], base["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (saved["losses"], base["losses"])
        worst = max(_rel(p, q) for p, q in zip(saved["params"], base["params"]))
        assert worst <= 1e-5, worst


def test_trials_of_a_graph_over_a_swapped_ddp_wrapper_decide_alike_on_both_ranks(plain, tmp_path):
    ranks = _fit(tmp_path, "trials")
    decisions = [saved["decisions"] for saved in ranks]
    assert decisions[0] == decisions[1], decisions
    status, reason = decisions[0]["cuda_graph"]
    assert status in ("kept", "reverted"), (status, reason)  # applied, its parity passed, then measured
    assert ranks[0]["kept"] == ranks[1]["kept"]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
    if "cuda_graph" in ranks[0]["kept"]:  # the fit's own replays, after the trials
        graphs = [saved["graph"] for saved in ranks]
        assert all(g is not None and g["stopped"] is None and g["replays"] > 0 for g in graphs), graphs
        assert graphs[0]["replays"] == graphs[1]["replays"], graphs


def test_a_batch_one_rank_cannot_replay_runs_eagerly_on_every_rank(tmp_path):
    """Rank 1's every 10th-plus-4th batch is shorter: both ranks step eagerly there (agreed on the host
    before each replay), replay the others in step, and train as the same fit without speedkit."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    ranks, plain = _fit(tmp_path, "ragged"), _fit(tmp_path, "ragged_plain")
    graphs = [saved["graph"] for saved in ranks]
    assert all(g is not None and g["stopped"] is None and g["captures"] == 1 for g in graphs), graphs
    assert graphs[0]["replays"] == graphs[1]["replays"] > 0, graphs
    assert graphs[0]["eager_for_other_ranks"] >= 2 and graphs[1]["eager_for_other_ranks"] == 0, graphs
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
    for saved, base in zip(ranks, plain):
        for a, b in zip(saved["losses"], base["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (saved["losses"], base["losses"])
