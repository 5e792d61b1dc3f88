"""The CUDA graph's agreement across DDP ranks, on two gloo processes with CUDA's stream calls and the
capture itself stood in for (CPU): the warm-up waits out DDP's first iterations and checks the step
after them, the warm-up and the capture run DDP's own step inside a guarded stretch, and a check or a
capture that fails on one rank stops the graph on both with that rank's reason. The capture on the
GPU is tests/test_cuda_graph_ddp_gpu.py's."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from ranks import spawn_ranks
from torch import nn

from speedkit import compat
from speedkit.cudagraph import graphed_step
from speedkit.cudagraph.graphed_step import GraphedStep
from speedkit.data.static import StaticBatch
from speedkit.training.step import PlainStep, StepWrapper


class DDPLike(StepWrapper):
    """A CPU step that counts its forwards the way DDP's reducer logs them (one behind) and says how
    many more a capture needs, as ``LightningStep.prepare_capture`` reads a DDP wrapper; it records
    whether each step ran guarded."""

    def __init__(self, inner, forwards: int = 0) -> None:
        super().__init__(inner)
        self.forwards = forwards
        self.guard = False
        self.guards_seen: list[bool] = []

    def compute(self, batches, batch_idx):
        self.forwards += 1
        self.guards_seen.append(self.guard)
        return self.inner.compute(batches, batch_idx)

    def __call__(self, batches, batch_idx):
        self.forwards += 1
        self.guards_seen.append(self.guard)
        return self.inner(batches, batch_idx)

    def prepare_capture(self) -> int:
        return max(0, 10 - max(0, self.forwards - 1))

    @contextlib.contextmanager
    def guarded(self, on: bool = True):
        saved, self.guard = self.guard, on
        try:
            yield
        finally:
            self.guard = saved


class _StandIn:
    """A CUDA stream, a graph: what the CPU run needs of them."""

    device = None

    def wait_stream(self, other) -> None:
        pass

    def reset(self) -> None:
        pass

    def replay(self) -> None:
        pass


class Planted(GraphedStep):
    """A graphed step whose capture is stood in for: it succeeds, or fails where ``fails_here``."""

    def __init__(self, inner, fails_here: bool) -> None:
        super().__init__(inner, warmup=2)
        self.fails_here = fails_here
        self.capture_at: list[int] = []

    def _side_stream(self):
        return _StandIn()

    def _capture_here(self, batch, batch_idx):
        self.capture_at.append(self.inner.forwards)
        self.inner.guards_seen.append(self.inner.guard)
        if self.fails_here:
            self.stop("capture failed: planted")
            return None
        self.graph, self.static_loss, self.logs = _StandIn(), torch.zeros(()), []
        return batch


class PlantedWithBuffers(Planted):
    """A planted capture that also sets up static batch buffers, so later steps replay (stood in for)."""

    def _capture_here(self, batch, batch_idx):
        if super()._capture_here(batch, batch_idx) is None:
            return None
        self.static = StaticBatch(batch)
        self._record_captured_state()  # what the graph depends on, as a real capture records it
        self._captured_at = graphed_step.in_place_changes()
        return self.static.fill(batch)


def _plain() -> PlainStep:
    """A linear model's step under SGD on the CPU."""
    model = nn.Linear(3, 1)
    mse = lambda m, batch, i: nn.functional.mse_loss(m(batch[0]), batch[1])  # noqa: E731
    return PlainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu", loss_fn=mse)


def _steps(step: GraphedStep, n: int) -> None:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    for i in range(n):
        step([(x, x.sum(1, keepdim=True))], i)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.current_stream = lambda device=None: _StandIn()  # this process's CPU stand-ins
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    checked_at: list[int] = []
    syncs_on_rank_1: list[bool] = [False]

    def find_syncs(run):
        checked_at.append(current.inner.forwards + 1)  # the forward the checked step runs
        result = run()
        return result, ["loss.item() at step.py:1 (planted)"] if rank == 1 and syncs_on_rank_1[0] else []

    graphed_step.find_syncs = find_syncs
    graphed_step.find_host_draws = lambda run, locate=True: (run(), [])
    seen: dict = {}

    # a fresh DDP wrapper: 11 forwards it times, one checked after them, then the capture; rank 1's fails
    current = Planted(DDPLike(_plain()), fails_here=rank == 1)
    with current.inner.guarded():  # a guarded stretch (parity steps): the graph's own steps lift it
        _steps(current, 16)
    seen["fresh"] = {
        "checked_at": list(checked_at),
        "capture_at": current.capture_at,
        "stopped": current.stopped,
        "graph": current.graph is not None,
        "guarded_graph_steps": [g for g in current.inner.guards_seen[:13]],
        "guarded_after": current.inner.guards_seen[13:],
        "sync_fixed": current.gradient_sync_fixed(),  # stopped: its eager steps can leave the all-reduce out
    }
    # a wrapper past its first iterations: two warm-up steps, the second checked; rank 1 finds a sync there
    checked_at.clear()
    syncs_on_rank_1[0] = True
    current = Planted(DDPLike(_plain(), forwards=40), fails_here=False)
    _steps(current, 4)
    seen["warm"] = {"checked_at": list(checked_at), "capture_at": current.capture_at, "stopped": current.stopped}
    # both ranks capture: the graph replays on both
    syncs_on_rank_1[0] = False
    current = Planted(DDPLike(_plain(), forwards=40), fails_here=False)
    _steps(current, 3)
    seen["both"] = {"capture_at": current.capture_at, "stopped": current.stopped, "replays": current.replays}
    seen["both_sync_fixed"] = current.gradient_sync_fixed()  # the ladder's scaling phase is not measured then
    # rank 1's batch at step 4 does not fit its buffers (shorter): every rank steps eagerly there
    current = PlantedWithBuffers(DDPLike(_plain(), forwards=40), fails_here=False)
    for i in range(6):
        rows = 3 if rank == 1 and i == 4 else 4
        x = torch.randn(rows, 3, generator=torch.Generator().manual_seed(i))
        current([(x, x.sum(1, keepdim=True))], i)
    seen["shapes"] = {
        "replays": current.replays,
        "eager_for_other_ranks": current.eager_for_other_ranks,
        "refused": current.static.refused,
        "counts": current.counts(),
    }
    # DDP's own count, as compat reads it off a real wrapper (gloo, CPU)
    ddp = torch.nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
    counts = []
    for _ in range(12):
        counts.append(compat.ddp_forwards_before_capture(ddp))
        ddp(torch.randn(2, 3)).sum().backward()
    seen["ddp_counts"] = counts
    from speedkit.lightning.step import LightningStep

    module = SimpleNamespace(training_step=lambda batch, batch_idx: None)
    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(root_device=torch.device("cpu"), model=ddp))
    seen["lightning"] = LightningStep(trainer, module).prepare_capture()
    Path(f"{out}/rank{rank}.json").write_text(json.dumps(seen))


def test_ranks_warm_up_past_ddps_first_iterations_and_agree_on_check_and_capture(tmp_path):
    spawn_ranks(_worker, str(tmp_path), timeout_s=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for seen in ranks:
        fresh = seen["fresh"]
        # forwards 1-11 are timed by DDP (the 11th reads the 10th's events back): the 12th is checked,
        # the 13th step is captured
        assert fresh["checked_at"] == [12] and fresh["capture_at"] == [12], fresh
        assert fresh["guarded_graph_steps"] == [False] * 13, fresh  # DDP's own step, the capture included
        # stopped: the failed capture's step and the 3 after it run eagerly, guarded as the stretch is
        assert fresh["guarded_after"] == [True] * 4, fresh
        assert not fresh["graph"] and fresh["sync_fixed"] is None
        assert seen["both_sync_fixed"].startswith("the step replays a CUDA graph that holds DDP's gradient all-reduce")
        assert seen["warm"]["checked_at"] == [42] and seen["warm"]["capture_at"] == [], seen["warm"]
        assert seen["both"] == {"capture_at": [42], "stopped": None, "replays": 1}, seen["both"]
        assert seen["ddp_counts"] == [10, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0], seen["ddp_counts"]
        assert seen["lightning"] == 0
    # replays at the capture (step 2) and steps 3 and 5; step 4 eager on both ranks
    assert [seen["shapes"]["replays"] for seen in ranks] == [3, 3], [seen["shapes"] for seen in ranks]
    assert (ranks[0]["shapes"]["eager_for_other_ranks"], ranks[0]["shapes"]["refused"]) == (1, 0)
    assert (ranks[1]["shapes"]["eager_for_other_ranks"], ranks[1]["shapes"]["refused"]) == (0, 1)
    assert ranks[0]["shapes"]["counts"]["eager_for_other_ranks"] == 1
    assert ranks[1]["fresh"]["stopped"] == "capture failed: planted"
    assert ranks[0]["fresh"]["stopped"] == "on rank 1: capture failed: planted"
    assert ranks[1]["warm"]["stopped"] == "the step syncs with the host: loss.item() at step.py:1 (planted)"
    assert ranks[0]["warm"]["stopped"] == "on rank 1: the step syncs with the host: loss.item() at step.py:1 (planted)"


def test_the_steps_a_parity_trajectory_runs_first_leave_it_the_warm_up_the_capture_and_a_replay(monkeypatch):
    """A graph on a DDP wrapper made in the trials (a ddp_* knob): the parity check runs the steps the
    graph says it still needs (asked again after each, as DDP logs one behind), and the 4-step
    trajectory after them then holds a warm-up step, the checked one, the capture and a replay, as
    on a wrapper past its first iterations. One process, CUDA's stream calls stood in for."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _StandIn())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    checked_at: list[int] = []

    def find_syncs(run):
        checked_at.append(step.inner.forwards + 1)
        return run(), []

    monkeypatch.setattr(graphed_step, "find_syncs", find_syncs)
    monkeypatch.setattr(graphed_step, "find_host_draws", lambda run, locate=True: (run(), []))
    step = PlantedWithBuffers(DDPLike(_plain()), False)
    needs = []
    while (need := step.steps_before_effect()) > 0:  # as ParityCheck._ready_changes asks before each step
        needs.append(need)
        _steps(step, 1)
    assert needs == [9, 9, 8, 7, 6, 5, 4, 3, 2, 1], needs  # the first forward does not show in DDP's log yet
    assert step.inner.forwards == 10 and step.graph is None
    _steps(step, 4)  # the trajectory
    # steps 11 (warm-up) and 12 (checked) eager, 13 captured (after 12 forwards), 14 replayed
    assert checked_at == [12] and step.capture_at == [12], (checked_at, step.capture_at)
    assert step.replays == 2 and step.steps_before_effect() == 0  # the capture's step and the one after it

    # a wrapper past its first iterations needs nothing first
    fresh = PlantedWithBuffers(DDPLike(_plain(), forwards=40), False)
    assert fresh.steps_before_effect() == 0
