"""speedkit under Lightning's sharding strategies on two GPUs (NCCL), issue 58: the CPU tests' FSDP2
workers (tests/test_fsdp.py) on CUDA, and FSDPStrategy (FSDP1), which Lightning refuses on a CPU.

FSDP1: the fit whose trials keep rungs (forced) trains exactly as the fit given them by hand, every
rank's shards after every step; a rung failing on rank 1 alone fails on both and the fit is the plain
fit; the sharding rungs of FSDP2 say why not; OOMFallback says why it stays out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def on_gpu(rank: int, port: int, out: str, worker: str) -> None:
    import test_fsdp

    test_fsdp.ACCELERATOR = "gpu"
    torch.cuda.set_device(rank)
    getattr(test_fsdp, worker)(rank, port, out)


@pytest.mark.filterwarnings("ignore")
def test_fsdp2_trials_restore_and_decide_alike_on_gpus(tmp_path, monkeypatch):
    import test_fsdp

    monkeypatch.setattr(test_fsdp, "spawn_ranks", lambda worker, *a, **k: spawn_ranks(on_gpu, *a, worker.__name__, **k))
    test_fsdp.test_trials_under_fsdp2_restore_every_ranks_shards_and_decide_alike(tmp_path)


@pytest.mark.filterwarnings("ignore")
def test_fsdp2_sharding_rungs_keep_and_revert_exactly_on_gpus(tmp_path, monkeypatch):
    import test_fsdp

    monkeypatch.setattr(test_fsdp, "spawn_ranks", lambda worker, *a, **k: spawn_ranks(on_gpu, *a, worker.__name__, **k))
    test_fsdp.test_sharding_rungs_keep_and_revert_exactly_on_both_ranks(tmp_path)


def fsdp1_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    import test_fsdp
    from lightning.pytorch.strategies import FSDPStrategy

    test_fsdp.ACCELERATOR = "gpu"
    from test_fsdp import QUICK, FailsOnRankOne, Sharded, _fit, forced
    from torch import nn

    from speedkit.lightning import OOMFallback, SpeedLadder

    class Wrapped(Sharded):
        def configure_model(self) -> None:  # FSDPStrategy wraps the module itself (its auto-wrap policy)
            pass

    def fit(callbacks: list) -> Wrapped:
        return _fit(callbacks, make=Wrapped, strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}))  # type: ignore[return-value]

    results: dict = {"plain": fit([]).params_after}
    with forced("kept"):
        tried = SpeedLadder(  # QUICK: no minimum gain, every rung timed (the forced decision keeps what is timed)
            rungs=["gc_freeze", "fused_optimizer", "fsdp_mixed_precision", "fsdp_reshard"],
            trials="always",
            measure=QUICK,
            cache=False,
        )
        results["tried"] = fit([tried]).params_after
    results["kept"] = [r.name for r in tried.result.kept]
    results["reasons"] = {r.name: r.reason for r in tried.result.rungs if r.status == "not_applicable"}
    results["strategy"] = tried.result.run["strategy"]
    results["by_hand"] = fit([SpeedLadder(rungs=results["kept"])]).params_after
    failing = SpeedLadder(rungs=[FailsOnRankOne(), "gc_freeze"], trials="always", measure=QUICK, cache=False)
    results["failing"] = fit([failing]).params_after
    entry = next(r for r in failing.result.rungs if r.name == "fails_on_rank_one")
    results["failing_entry"] = (entry.status, entry.reason)
    fallback = OOMFallback()
    fit([fallback])
    results["fallback_not_applied"] = fallback.not_applied
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.mark.filterwarnings("ignore")
def test_fsdp1_trials_restore_and_decide_alike(tmp_path):
    spawn_ranks(fsdp1_worker, str(tmp_path), timeout_s=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["strategy"] == "FSDPStrategy", got["strategy"]
        assert sorted(got["kept"]) == ["fused_optimizer", "gc_freeze"], (got["kept"], got["reasons"])
        for name in ("fsdp_mixed_precision", "fsdp_reshard"):
            assert "FSDP1 (FSDPStrategy)" in got["reasons"][name], got["reasons"]
        for step, (a, b) in enumerate(zip(got["tried"], got["by_hand"], strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, step)
        status, reason = got["failing_entry"]
        assert status == "failed" and "rank 1" in reason, reason
        for step, (a, b) in enumerate(zip(got["failing"], got["plain"], strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, step)
        assert "FSDP (FSDPStrategy) over several processes" in got["fallback_not_applied"], got["fallback_not_applied"]
