"""The out-of-memory fallback (speedkit.training.accumulate, speedkit.lightning.OOMFallback) on the CPU, with
injected out-of-memory errors: a simulated memory budget (a forward of more samples than it allows
raises ``torch.OutOfMemoryError``) and errors at random points of forwards and backwards. Over 200
optimizer steps every sample counts once, with its weight, in the step it belongs to, and the
parameters after each step are those of the same run without any error (fp32, rel 1e-5): in a plain
loop (``speedkit.apply``) and in a Lightning Trainer with a scheduler, clipping and accumulation."""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from ranks import EndProcessGroupAtExit, run_in_process, spawn_ranks
from torch import nn
from torch.nn import functional as F

import speedkit
from speedkit.lightning import OOMFallback
from speedkit.training.accumulate import GradStash, MicroBatcher, OutOfMemoryAtOneSample, batch_size, split_batch

SAMPLES, BATCH, FEATURES, CLASSES = 512, 16, 12, 5


class Injector:
    """Raises ``torch.OutOfMemoryError`` where a device would: a forward of more than ``budget``
    samples, and ``random`` times at forward or backward points drawn at random (its own RNG: the
    torch generators are the run's) among the first ``horizon`` points the run passes."""

    def __init__(self, budget: int | None = None, random_errors: int = 0, horizon: int = 3000, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.budget, self.fail_at, self.points = budget, set(rng.sample(range(horizon), random_errors)), 0
        self.raised = {"budget": 0, "forward": 0, "backward": 0}

    def _point(self, where: str) -> None:
        self.points += 1
        if self.points in self.fail_at:
            self.raised[where] += 1
            raise torch.OutOfMemoryError(f"simulated at a random {where} point")

    def forward_point(self, x: torch.Tensor) -> None:
        if self.budget is not None and x.shape[0] > self.budget:
            self.raised["budget"] += 1
            raise torch.OutOfMemoryError(f"simulated: {x.shape[0]} samples over a budget of {self.budget}")
        self._point("forward")

    def backward_point(self, grad: torch.Tensor) -> None:
        self._point("backward")


class Net(nn.Module):
    """Two layers and ``seen``, one parameter per sample of the data set: the loss holds the mean of
    the batch's entries, so ``seen``'s gradient in a step is 1/batch on exactly its samples."""

    def __init__(self, injector: Injector | None = None) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(FEATURES, 32), nn.Linear(32, CLASSES)
        self.seen = nn.Parameter(torch.zeros(SAMPLES))
        self.injector = injector

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y, ids = batch
        if self.injector is not None:
            self.injector.forward_point(x)
        h = torch.tanh(self.lin1(x))
        if self.injector is not None and h.requires_grad:
            h.register_hook(self.injector.backward_point)
        return F.cross_entropy(self.lin2(h), y) + self.seen[ids].mean()

    def forward(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.loss(batch)


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g), torch.arange(SAMPLES)
    )


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(2))


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b, strict=True))


# -- the core -------------------------------------------------------------------------------------
def test_a_batch_splits_in_order_every_sample_once_shared_leaves_whole():
    batch = {"x": torch.arange(10).view(10, 1), "mask": torch.ones(3, 3), "ids": torch.arange(10), "name": "b"}
    assert batch_size(batch) == 10
    parts = split_batch(batch, 4)
    assert [n for _, n in parts] == [3, 3, 2, 2]
    assert torch.cat([p["x"] for p, _ in parts]).flatten().tolist() == list(range(10))
    assert all(p["mask"].shape == (3, 3) and p["name"] == "b" for p, _ in parts)
    assert [n for _, n in split_batch(batch, 64)] == [1] * 10  # never more parts than samples


def test_grad_stash_drops_a_failed_attempt_and_adds_in_place():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    before = p.grad
    stash = GradStash([p])
    assert p.grad is None
    (p * 5).sum().backward()
    stash.drop_fresh()  # a failed attempt's partial gradients
    (p * 3).sum().backward()
    stash.merge()
    assert p.grad is before and p.grad.tolist() == [5.0, 5.0, 5.0]


def test_splits_on_out_of_memory_keeps_the_split_and_records_the_time_lost():
    injector, clock = Injector(budget=4), iter(range(100))
    model = Net(injector)
    freed = []
    batcher = MicroBatcher(model.parameters, model=model, clock=lambda: float(next(clock)), free=lambda: freed.append(1))
    batch = next(iter(loader()))

    def fb(part, w):
        loss = model.loss(part) * w
        loss.backward()
        return loss.detach()

    batcher.run(batch, 0, fb)
    assert batcher.parts == 4 and len(freed) == 2  # 16 -> 8 -> 4 samples per micro-batch
    assert [(e.old_micro_batch, e.new_micro_batch) for e in batcher.events] == [(16, 8), (8, 4)]
    assert all(e.seconds_lost > 0 and "budget" in e.detail for e in batcher.events)
    batcher.run(batch, 1, fb)
    assert batcher.parts == 4 and len(batcher.events) == 2  # no error at 4: never grows back on its own


def test_probe_grows_back_after_steady_steps_and_never_to_a_size_that_failed():
    injector = Injector(budget=8)
    model = Net(injector)
    batcher = MicroBatcher(model.parameters, model=model, probe_after=2, free=lambda: None)
    batcher.parts = 4  # as after an earlier split
    batch = next(iter(loader()))

    def fb(part, w):
        loss = model.loss(part) * w
        loss.backward()
        return loss.detach()

    for step in range(6):  # 2 steady steps at 4 samples, a probe to 8 that fits, 2 more, a probe to 16 that fails
        batcher.run(batch, step, fb)
    kinds = [(e.kind, e.old_micro_batch, e.new_micro_batch) for e in batcher.events]
    assert kinds == [("probe", 4, 8), ("out of memory (probe)", 16, 8)] and batcher.parts == 2
    for step in range(6, 20):  # 16 failed: never probed again
        batcher.run(batch, step, fb)
    assert len(batcher.events) == 2 and batcher.parts == 2


def test_out_of_memory_at_one_sample_stops_with_the_sizes_tried():
    model = Net(Injector(budget=0))
    batcher = MicroBatcher(model.parameters, model=model, free=lambda: None)
    with pytest.raises(OutOfMemoryAtOneSample, match=r"micro-batches of 1 sample \(tried 16, 8, 4, 2, 1 of a batch of 16\)"):
        batcher.run(next(iter(loader())), 3, lambda part, w: model.loss(part))


def test_batchnorm_statistics_and_the_rng_are_those_of_a_first_attempt():
    """A failed attempt moved the running statistics and drew dropout masks; the redone batch
    starts from where the first attempt started."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    x = torch.randn(8, 4)
    calls = {"n": 0}

    def fb(part, w):
        calls["n"] += 1
        out = net(part[0])
        if calls["n"] == 1:  # the whole batch's forward ran, then its backward failed
            raise torch.OutOfMemoryError("simulated")
        loss = out.square().mean() * w
        loss.backward()
        return loss.detach()

    reference = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    reference.load_state_dict(net.state_dict())
    state = torch.get_rng_state()
    MicroBatcher(net.parameters, model=net, free=lambda: None).run((x,), 0, fb)
    torch.set_rng_state(state)
    for half in (x[:4], x[4:]):
        reference(half)
    assert torch.allclose(net[1].running_mean, reference[1].running_mean)
    assert net[1].num_batches_tracked.item() == reference[1].num_batches_tracked.item() == 2


# -- a plain loop: speedkit.apply ------------------------------------------------------------------
def _plain_run(injector: Injector | None, steps: int = 200) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = Net(injector)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    seen: list[torch.Tensor] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(model.seen.grad.clone()))
    sk = speedkit.apply(
        model,
        opt,
        loader(),
        rungs=[],
        accumulate=2,
        clip_grad_norm=1.0,
        scheduler=sched,
        loss_fn=lambda m, b, i: m.loss(b),
        oom_fallback=injector is not None,
    )
    params = []
    for group in sk.batches(steps=steps, epochs=None):
        sk.step(group)
        params.append([p.detach().clone() for p in model.parameters()])
    return params, seen, sk


def test_plain_loop_with_injected_out_of_memory_trains_like_the_run_without():
    ref_params, ref_seen, _ = _plain_run(None)
    injector = Injector(budget=4, random_errors=12, seed=7)
    params, seen, sk = _plain_run(injector)
    assert len(params) == len(ref_params) == 200
    assert injector.raised["budget"] > 0 and injector.raised["forward"] > 0 and injector.raised["backward"] > 0
    budget = [(e.step, e.old_micro_batch, e.new_micro_batch) for e in sk.fallback.events if "budget" in e.detail]
    assert budget == [(0, 16, 8), (0, 8, 4)] and sk.fallback.parts >= 4
    for step, (a, b) in enumerate(zip(seen, ref_seen, strict=True)):  # every sample once, in its step, weighted 1/16 / 2
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8), step
        assert ((a != 0).sum().item(), round(a.max().item() * BATCH * 2, 4)) == (2 * BATCH, 1.0)
    for step, (a, b) in enumerate(zip(params, ref_params, strict=True)):
        assert _close(a, b), step


def test_plain_loop_out_of_memory_in_the_optimizer_step_stops_with_one_line():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def failing_step(*a, **k):
        raise torch.OutOfMemoryError("simulated in the optimizer")

    opt.register_step_pre_hook(failing_step)
    sk = speedkit.apply(model, opt, loader(), rungs=[], loss_fn=lambda m, b, i: m.loss(b), oom_fallback=True)
    with pytest.raises(OutOfMemoryAtOneSample, match="out of memory in the optimizer step .*cannot help"):
        sk.step(next(iter(sk.batches())))


def test_apply_refuses_an_unknown_fallback_option():
    model = Net()
    with pytest.raises(speedkit.ConfigError, match="oom_fallback"):
        speedkit.apply(model, torch.optim.SGD(model.parameters(), lr=0.1), rungs=[], oom_fallback={"grow": 3})


# -- a Lightning Trainer -----------------------------------------------------------------------------
class LitNet(pl.LightningModule):
    def __init__(self, injector: Injector | None = None) -> None:
        super().__init__()
        self.net = Net(injector)
        self.params_after: list[list[torch.Tensor]] = []
        self.seen_grads: list[torch.Tensor] = []
        self.after_backward = 0

    def training_step(self, batch, batch_idx):
        loss = self.net.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_after_backward(self):
        self.after_backward += 1

    def on_before_optimizer_step(self, optimizer):  # after the closure (an optimizer's pre-hook runs before it)
        self.seen_grads.append(self.net.seen.grad.clone())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            self.params_after.append([p.detach().clone() for p in self.parameters()])


def _lightning_run(injector: Injector | None, callbacks: list, steps: int = 200) -> LitNet:
    torch.manual_seed(0)
    module = LitNet(injector)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=loader())
    assert trainer.global_step == steps
    return module


def test_lightning_fit_with_injected_out_of_memory_trains_like_the_fit_without(tmp_path):
    reference = _lightning_run(None, [])
    injector = Injector(budget=4, random_errors=12, seed=11)
    fallback = OOMFallback(report_dir=tmp_path)
    module = _lightning_run(injector, [fallback])
    assert injector.raised["budget"] > 0 and injector.raised["forward"] > 0 and injector.raised["backward"] > 0
    budget = [(e.step, e.old_micro_batch, e.new_micro_batch) for e in fallback.events if "budget" in e.detail]
    assert budget == [(0, 16, 8), (0, 8, 4)] and fallback.fallback.parts >= 4
    assert module.after_backward == reference.after_backward == 400  # once per batch, as without the fallback
    assert len(module.seen_grads) == len(reference.seen_grads) == 200
    for step, (a, b) in enumerate(zip(module.seen_grads, reference.seen_grads, strict=True)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8), step
        assert (a != 0).sum().item() == 2 * BATCH
    for step, (a, b) in enumerate(zip(module.params_after, reference.params_after, strict=True)):
        assert _close(a, b), step
    assert "training_step" not in module.__dict__  # the fit's wrappers are gone after it
    import json

    report = json.loads((tmp_path / "oom_fallback.json").read_text())
    assert report["micro_batches"] == fallback.fallback.parts and len(report["events"]) == len(fallback.events)
    assert {"step", "old_micro_batch", "new_micro_batch", "seconds_lost"} <= set(report["events"][0])


class SkippingLitNet(LitNet):
    """Skips some batches, as Lightning allows (``training_step`` returns None)."""

    def training_step(self, batch, batch_idx):
        if batch_idx % 7 == 3:
            return None
        return super().training_step(batch, batch_idx)


def test_a_batch_the_module_skips_is_skipped_whole_after_a_split(monkeypatch):
    monkeypatch.setitem(globals(), "LitNet", SkippingLitNet)
    reference = _lightning_run(None, [], steps=40)
    module = _lightning_run(Injector(budget=4), [OOMFallback()], steps=40)
    for step, (a, b) in enumerate(zip(module.params_after, reference.params_after, strict=True)):
        assert _close(a, b), step


def test_oom_fallback_refuses_bad_arguments_in_one_line():
    with pytest.raises(speedkit.ConfigError, match="probe_after"):
        OOMFallback(probe_after=0)
    with pytest.raises(speedkit.ConfigError, match="report_dir"):
        OOMFallback(report_dir=3)


# -- several processes (gloo on the CPU) -------------------------------------------------------------
def _ddp_worker(rank: int, port: int, world: int, fallback: bool, out: str) -> None:
    """One rank of a 2-process run, each on its own shard, gradients averaged: with ``fallback``, rank 1
    alone runs out of memory above 4 samples and at 3 random points, rank 0 never; without, DDP's own
    forward and backward (its reducer averages the gradients), the reference."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from speedkit.distributed import any_rank, average_gradients

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = Net(Injector(budget=4, random_errors=3, horizon=300, seed=5) if fallback and rank == 1 else None)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    shard = torch.utils.data.Subset(data(), range(rank, SAMPLES, world))
    batches = torch.utils.data.DataLoader(shard, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3))
    batcher = MicroBatcher(net.parameters, model=net, agree=any_rank, free=lambda: None)

    def forward_backward(part, weight):  # on the module DDP wraps: no collective inside an attempt
        loss = net(part) * weight
        loss.backward()
        return loss.detach()

    steps = 0
    for _ in range(2):
        for batch in batches:
            if fallback:
                batcher.run(batch, steps, forward_backward)
                average_gradients(net.parameters())
            else:
                ddp(batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
    torch.save(
        {
            "params": [p.detach() for p in net.parameters()],
            "steps": steps,
            "events": [(e.step, e.old_micro_batch, e.new_micro_batch, e.kind) for e in batcher.events],
            "raised": net.injector.raised if net.injector else None,
        },
        f"{out}/rank{rank}.pt",
    )


def _run_ranks(fallback: bool, out, timeout_s: float = 120.0) -> list[dict]:
    spawn_ranks(_ddp_worker, 2, fallback, str(out), timeout_s=timeout_s)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_ddp_where_only_rank_1_runs_out_of_memory_both_ranks_split_together_and_match_the_run_without(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "oom").mkdir()
    reference = _run_ranks(False, tmp_path / "ref")
    ranks = _run_ranks(True, tmp_path / "oom")
    assert ranks[1]["raised"]["budget"] > 0 and ranks[1]["raised"]["forward"] + ranks[1]["raised"]["backward"] > 0
    assert ranks[0]["events"] == ranks[1]["events"] and ranks[0]["events"][:2] == [
        (0, 16, 8, "out of memory"),
        (0, 8, 4, "out of memory"),
    ]
    assert ranks[0]["steps"] == reference[0]["steps"] == 32
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))  # the ranks agree exactly
    assert _close(ranks[0]["params"], reference[0]["params"])  # and train as DDP does without any error


class RankLitNet(LitNet):
    """LitNet whose rank 1 alone runs out of memory (``oom``); each rank saves its parameters and the
    fallback's events at the end of the fit."""

    def __init__(self, out: str, oom: bool) -> None:
        super().__init__(None)
        self.out, self.oom = out, oom

    def setup(self, stage):
        if self.oom and self.global_rank == 1:
            self.net.injector = Injector(budget=4, random_errors=3, horizon=300, seed=5)

    def on_train_end(self):
        fallback = next((c for c in self.trainer.callbacks if isinstance(c, OOMFallback)), None)
        torch.save(
            {
                "params": [p.detach() for p in self.parameters()],
                "steps": self.trainer.global_step,
                "events": [(e.step, e.old_micro_batch, e.new_micro_batch, e.kind) for e in fallback.events] if fallback else [],
                "raised": self.net.injector.raised if self.net.injector else None,
            },
            f"{self.out}/rank{self.global_rank}.pt",
        )


def lightning_ddp_fit(out: str, oom: bool) -> None:
    """A 2-process DDP fit on the CPU (gloo), with the fallback when ``oom``; run as its own process."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # the spawned ranks' tensors: not through /dev/shm fds
    torch.manual_seed(0)
    module = RankLitNet(out, oom)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=40,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EndProcessGroupAtExit(), *([OOMFallback()] if oom else [])],
    )
    trainer.fit(module, train_dataloaders=loader())


def test_lightning_ddp_where_only_rank_1_runs_out_of_memory_matches_the_fit_without(tmp_path):
    runs = {}
    for oom in (False, True):
        out = tmp_path / f"oom{oom}"
        out.mkdir()
        run_in_process("test_oom_fallback", f"lightning_ddp_fit({str(out)!r}, {oom})", timeout_s=240)
        runs[oom] = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    ref, ranks = runs[False], runs[True]
    assert ranks[1]["raised"]["budget"] > 0
    assert ranks[0]["events"] == ranks[1]["events"] and ranks[0]["events"][:2] == [
        (0, 16, 8, "out of memory"),
        (0, 8, 4, "out of memory"),
    ]
    assert ranks[0]["steps"] == ranks[1]["steps"] == ref[0]["steps"] == 40
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
    assert _close(ranks[0]["params"], ref[0]["params"])


class LateNet(Net):
    """Runs out of memory after its first layer: the compiled layer sees the sizes that fail too."""

    def loss(self, batch):
        x, y, ids = batch
        h = torch.tanh(self.lin1(x))
        self.injector.forward_point(x)
        return F.cross_entropy(self.lin2(h), y) + self.seen[ids].mean()


def test_a_compiled_model_after_a_split_compiles_a_few_graphs_not_one_per_step():
    """Micro-batches of other sizes are new shapes for torch.compile: the first compiles anew, the
    second makes the batch dimension dynamic (Dynamo's automatic dynamic shapes); then no more."""
    from speedkit import compat

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LateNet(Injector(budget=4))
    model.lin1 = torch.compile(model.lin1, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sk = speedkit.apply(model, opt, loader(), rungs=[], loss_fn=lambda m, b, i: m.loss(b), oom_fallback=True)
    before = compat.graph_count()
    counts = []
    for group in sk.batches(steps=40, epochs=None):
        sk.step(group)
        counts.append(compat.graph_count() - before)
    assert sk.fallback.parts == 4 and model.injector.raised["budget"] == 2  # 16 and 8 ran the layer, then failed
    assert counts[0] == counts[-1] <= 2, counts  # 16, then 8 dynamic (4 fits it): nothing compiled after step 0
    torch._dynamo.reset()


def test_a_checkpoint_keeps_the_split_and_a_resumed_fit_starts_with_it(tmp_path):
    torch.manual_seed(0)
    module = LitNet(Injector(budget=4))
    first = OOMFallback()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[first],
    )
    trainer.fit(module, train_dataloaders=loader())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    assert first.fallback.parts == 4
    resumed = OOMFallback()
    module.net.injector = Injector(budget=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[resumed],
    )
    trainer.fit(module, train_dataloaders=loader(), ckpt_path=tmp_path / "c.ckpt")
    assert trainer.global_step == 10 and resumed.fallback.parts == 4
    assert module.net.injector.raised["budget"] == 0  # it started at micro-batches of 4: nothing ran out of memory


def test_with_merged_micro_batches_the_fallback_splits_them_and_trains_like_the_fit_without():
    """SpeedLadder's micro_batch (2 loader batches a micro-batch) and OOMFallback in one Trainer: the
    merged micro-batch of 32 samples runs out of memory above 4, is split, and the fit trains as the
    plain one; trials of the same rungs beside the fallback pass their parity checks."""
    from speedkit.lightning import SpeedLadder

    reference = _lightning_run(None, [], steps=60)
    injector = Injector(budget=4, random_errors=6, seed=7)
    ladder = SpeedLadder(rungs=[{"name": "micro_batch", "options": {"factor": 2}}], trials=False)
    fallback = OOMFallback()
    module = _lightning_run(injector, [ladder, fallback], steps=60)
    assert "micro_batch" in ladder.applied_changes, ladder.skipped
    assert injector.raised["budget"] > 0 and (0, 32, 16) in [
        (e.step, e.old_micro_batch, e.new_micro_batch) for e in fallback.events
    ]
    assert len(module.seen_grads) == len(reference.seen_grads) == 60
    for step, (a, b) in enumerate(zip(module.seen_grads, reference.seen_grads, strict=True)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8), step
    for step, (a, b) in enumerate(zip(module.params_after, reference.params_after, strict=True)):
        assert _close(a, b), step
    trials = SpeedLadder(
        rungs=["micro_batch"],
        trials="always",
        measure={
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
        },
    )
    _lightning_run(Injector(budget=4), [trials, OOMFallback()], steps=10)
    entry = next(r for r in trials.result.rungs if r.name == "micro_batch")
    assert entry.status in ("kept", "reverted"), entry.reason


def test_inside_a_cuda_graph_capture_the_fallback_does_not_split_and_raises_as_it_comes(monkeypatch):
    """A graph records one split: the capture sees the error (and runs the step eagerly, split there)."""
    import speedkit.training.accumulate as accumulate

    monkeypatch.setattr(accumulate, "capturing_cuda_graph", lambda: True)
    model = nn.Linear(4, 2)
    batcher = MicroBatcher(lambda: model.parameters(), model=model)

    def forward_backward(part, weight):
        if part[0].shape[0] > 2:
            raise torch.OutOfMemoryError("simulated")
        loss = model(part[0]).sum() * weight
        loss.backward()
        return loss.detach()

    batch = (torch.randn(8, 4), torch.zeros(8))
    with pytest.raises(torch.OutOfMemoryError):
        batcher.run(batch, 0, forward_backward)
    assert batcher.parts == 1 and not batcher.events
    batcher.parts = 4  # a split made before the capture is captured as it is
    assert batcher.run(batch, 1, forward_backward) is not None and batcher.parts == 4 and not batcher.events


def test_the_fits_lightning_step_finds_the_fallback_a_cuda_graph_captures():
    from speedkit.lightning.step import LightningStep

    found: list[Any] = []

    class Look(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            found.append(LightningStep(trainer, pl_module).oom_fallback())

    fallback = OOMFallback()
    module = _lightning_run(None, [fallback, Look()], steps=2)
    assert found and all(f is fallback.fallback for f in found)
    assert speedkit.training.step.PlainStep(module, torch.optim.SGD(module.parameters(), lr=0.1), "cpu").oom_fallback() is None
