"""speedkit.distributed's agreements on two gloo processes: reductions, broadcasts, a failure on one
rank shared by both, and the engine's agreed check and apply built on them."""

from __future__ import annotations

import os

import torch
from ranks import spawn_ranks

from speedkit import distributed
from speedkit.distributed import RankFailed


class _Rung:
    """A rung whose check and apply differ by rank."""

    name = "by_rank"

    def check(self, state):
        return "not on this rank" if torch.distributed.get_rank() == 1 else None

    def apply(self, state):
        if torch.distributed.get_rank() == 1:
            raise ValueError("planted")
        from speedkit.handle import Handle

        handle = Handle(self.name)
        handle.record("a flag", lambda: state.undone.append(True))
        return handle


class _State:
    def __init__(self) -> None:
        self.undone: list[bool] = []


def _worker(rank: int, port: int, out: str) -> None:
    from speedkit.engine.stack import agreed_apply, agreed_check, agreed_problem

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    seen: dict = {"rank": distributed.rank(), "world": distributed.world_size()}
    seen["largest"] = distributed.largest([rank, 10 - rank])
    seen["mean"] = distributed.mean([rank * 2.0])
    seen["gather"] = distributed.gather(f"r{rank}")
    seen["broadcast"] = distributed.broadcast({"from": rank})
    clock = distributed.agreed_clock(lambda: 100.0 + rank)
    seen["clock"] = clock()
    try:
        with distributed.together():
            if rank == 1:
                raise torch.OutOfMemoryError("planted on rank 1")
        seen["together"] = "went on"
    except RankFailed as exc:
        seen["together"] = f"RankFailed {exc.rank}: {exc.reason}"
    except torch.OutOfMemoryError as exc:
        seen["together"] = f"own {type(exc).__name__}"
    with distributed.together():  # nothing raised anywhere: the block goes on
        seen["quiet"] = True
    state = _State()
    seen["check"] = agreed_check(_Rung(), state)
    try:
        agreed_apply(_Rung(), state)
        seen["apply"] = "applied"
    except Exception as exc:
        seen["apply"] = f"{type(exc).__name__}: {exc}"
    seen["undone"] = state.undone

    class StoppedOnRank0:  # a handle whose change stopped working on rank 0 alone
        def problem(self):
            return "stopped working" if rank == 0 else None

    seen["problem"] = agreed_problem(StoppedOnRank0())
    seen["host"] = [distributed.all_ranks_on_host(rank == 0), distributed.all_ranks_on_host(True)]
    real = torch.distributed.get_backend
    torch.distributed.get_backend = lambda group=None: "nccl"  # as under NCCL: a gloo group of its own is made
    try:
        seen["host_made"] = [distributed.all_ranks_on_host(rank == 1), distributed.all_ranks_on_host(True)]
        seen["host_group"] = distributed.host_group() is not None and distributed.host_group() is distributed.host_group()
    finally:
        torch.distributed.get_backend = real
    seen["after"] = distributed.gather(rank)  # the ranks are still in step after it
    distributed.end_process_group()
    distributed.end_process_group()  # a second call: nothing left to end
    seen["ended"] = not torch.distributed.is_initialized() and distributed._HOST_GROUP == [None, None]
    torch.save(seen, f"{out}/rank{rank}.pt")


def test_agreements_on_two_ranks(tmp_path):
    spawn_ranks(_worker, str(tmp_path), timeout_s=120)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["largest"] == r1["largest"] == [1.0, 10.0]
    assert r0["mean"] == r1["mean"] == [1.0]
    assert r0["gather"] == r1["gather"] == ["r0", "r1"]
    assert r0["broadcast"] == r1["broadcast"] == {"from": 0}
    assert r0["clock"] == r1["clock"] == 100.0  # rank 0's reading
    assert r1["together"] == "own OutOfMemoryError"  # the failing rank keeps its own error
    assert r0["together"] == "RankFailed 1: OutOfMemoryError: planted on rank 1"
    assert r0["quiet"] and r1["quiet"]
    assert r0["check"] == "on rank 1: not on this rank" and r1["check"] == "not on this rank"
    assert r0["apply"] == "RankFailed: rank 1: ValueError: planted" and r1["apply"] == "ValueError: planted"
    assert r0["undone"] == [True]  # applied on rank 0, undone there when rank 1 failed
    assert r0["problem"] == "stopped working" and r1["problem"] == "on rank 0: stopped working"
    assert r0["host"] == r1["host"] == [False, True]  # agreed on the host: every rank, or not
    assert r0["host_made"] == r1["host_made"] == [False, True] and r0["host_group"] and r1["host_group"]
    assert r0["after"] == r1["after"] == [0, 1]
    assert r0["ended"] and r1["ended"]  # the group and the host group it made let go before the interpreter


def test_one_process_is_a_no_op():
    assert distributed.world_size() == 1 and distributed.rank() == 0
    assert distributed.largest([3.0]) == [3.0] and distributed.mean([2.0]) == [2.0]
    assert distributed.gather("x") == ["x"] and distributed.broadcast(5) == 5
    assert distributed.all_ranks_on_host(False) is False and distributed.all_ranks_on_host(True) is True
    clock = lambda: 7.0  # noqa: E731
    assert distributed.agreed_clock(clock) is clock
