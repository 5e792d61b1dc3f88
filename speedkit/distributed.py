"""Several training processes taking one decision: agreement over ``torch.distributed``.

Under DDP every rank runs the same trials in step. What could make ranks take different paths is
agreed on here, so every rank goes the same way and calls the same collectives in the same order:

* inputs are made equal: step times reduced to the slowest rank's (:func:`largest`), losses averaged
  (:func:`mean`), rank 0's clock and objects broadcast (:func:`broadcast`, :func:`agreed_clock`);
* failures are shared: :func:`together` runs a block on every rank and, where it raised on any rank,
  raises on every rank (the failing rank's own exception there, :class:`RankFailed` on the others).

Every function here is a collective: every rank of the default process group must call it, the
same number of times, in the same order, or the ranks hang. Without an initialized process group
(one process) each is a no-op that returns its local answer.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from speedkit.errors import first_line

T = TypeVar("T")


class RankFailed(RuntimeError):
    """Another rank raised where this one did not: every rank stops the same block together."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank}: {reason}")
        self.rank, self.reason = rank, reason


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (FSDP2's sharded parameters, their gradients and
    the optimizer state made from them; a view: writing into it writes the DTensor), else ``t`` itself."""
    kind = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return t.to_local() if kind is not None and isinstance(t, kind) else t


def shard_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as ``like`` is: a DTensor of ``like``'s mesh and placements where ``like`` is one (``local``
    being this rank's shard of it), else ``local``."""
    if local_shard(like) is like:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (an all-reduce of one number, MAX)."""
    if world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def smallest(value: int) -> int:
    """The smallest of the ranks' ``value`` (an all-reduce of one number, MIN)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def largest(values: Sequence[float]) -> list[float]:
    """Each of ``values``, the largest over the ranks (one all-reduce, MAX): the slowest rank's times."""
    return _reduce(values, torch.distributed.ReduceOp.MAX) if world_size() > 1 else list(values)


def mean(values: Sequence[float]) -> list[float]:
    """Each of ``values`` averaged over the ranks (one all-reduce, in float64): DDP's loss."""
    if world_size() == 1:
        return list(values)
    return [v / world_size() for v in _reduce(values, torch.distributed.ReduceOp.SUM)]


def all_ranks_on_host(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank, agreed over :func:`host_group` (a MIN all-reduce of one
    number on the CPU): the host never waits on a device stream, as an all-reduce over the NCCL default
    group would (``.item()`` there waits for the GPU's queued work)."""
    if world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=host_group())
    return bool(t.item())


#: (the default group it was made for, a gloo group over the same ranks): see host_group
_HOST_GROUP: list[Any] = [None, None]


@atexit.register
def _let_host_group_go() -> None:
    """At exit, while the interpreter is whole: drop the gloo group host_group made. Left to the
    interpreter's teardown, freeing it aborted the process ("terminate called without an active
    exception", SIGABRT) in 7 of 16 runs of tests/test_distributed.py on a 2-core CPU."""
    _HOST_GROUP[:] = [None, None]


def end_process_group() -> None:
    """The default process group destroyed, where this process has one: for a process that owns its
    run (the command line after its fit). Lightning leaves the group to the interpreter's teardown,
    where gloo's worker threads may still hold work whose tensors need the GIL of an interpreter going
    away: the rank aborts (SIGABRT) after a fit that succeeded, now and then; NCCL warns of it."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        _let_host_group_go()
        dist.destroy_process_group()


def host_group() -> Any:
    """A process group over the default group's ranks whose collectives run on the host (gloo): the
    default group itself where it is gloo, else one made on the first call for this default group.
    Making it is a collective: every rank makes that first call at the same point (where its caller
    agrees anyway, e.g. a CUDA graph's capture)."""
    dist = torch.distributed
    if dist.get_backend() == "gloo":
        return None  # the default group
    world = dist.group.WORLD
    if _HOST_GROUP[0] is not world:
        _HOST_GROUP[:] = [world, dist.new_group(backend="gloo")]
    return _HOST_GROUP[1]


def gather(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` (picklable), on every rank: what rank 0 decided."""
    if world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def first_said(said: str | None) -> str | None:
    """What this rank says (a reason, a problem) where it says something, else what the first rank
    that does says, as "on rank r: ..."; None where no rank says anything. One gather, on every rank
    whatever this rank says (a rank that skipped it would leave the others waiting)."""
    if world_size() == 1:
        return said
    everyone = gather(said)
    if said is not None:
        return said
    return next((f"on rank {r}: {s}" for r, s in enumerate(everyone) if s is not None), None)


def agreed_clock(clock: Callable[[], float]) -> Callable[[], float]:
    """``clock`` read on rank 0 and broadcast: time budgets run out on every rank at the same call.
    Each call is a collective (one all-reduce of one number); one process: ``clock`` itself."""
    if world_size() == 1:
        return clock

    def read() -> float:
        t = torch.tensor([clock() if rank() == 0 else 0.0], dtype=torch.float64, device=_collective_device())
        torch.distributed.all_reduce(t)
        return float(t.item())

    return read


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Run the block on every rank; where it raised an ``Exception`` on any rank, raise on every
    rank: the rank's own exception where it raised (an out-of-memory error stays one), else
    :class:`RankFailed` naming the first rank that did and why. One process: the block as it is.

    The block itself must not strand another rank inside a collective: a rank that raises before
    a collective the others reach hangs them there. Put collectives at the block's edges (or run
    the steps inside guarded, :meth:`speedkit.training.step.Step.guarded`)."""
    if world_size() == 1:
        yield
        return
    error: Exception | None = None
    try:
        yield
    except Exception as exc:  # every rank learns of it before any rank goes on
        error = exc
    if not any_rank(error is not None):  # one number all-reduced; the reasons only where one failed
        return
    why = None if error is None else f"{type(error).__name__}: {first_line(error)[:300]}"
    first = next((r, w) for r, w in enumerate(gather(why)) if w is not None)
    if error is not None:
        raise error
    raise RankFailed(*first)


def average_gradients(params: Iterable[nn.Parameter]) -> None:
    """Each parameter's gradient averaged over the ranks, as DDP averages it, in one all-reduce of the
    gradients flattened together (a parameter without a gradient counts as zeros, on every rank)."""
    n = world_size()
    if n == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= n
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _reduce(values: Sequence[float], op: Any) -> list[float]:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
    torch.distributed.all_reduce(t, op=op)
    return t.tolist()


def _collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current CUDA device under NCCL."""
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
