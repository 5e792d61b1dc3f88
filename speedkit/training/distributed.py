"""Several training processes taking one decision: agreement and gradient averaging over
``torch.distributed``.

Every function here is a collective: every rank of the default process group must call it, the
same number of times, in the same order, or the ranks hang. Without an initialized process group
(one process) each is a no-op that returns its local answer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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


def _collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current CUDA device under NCCL."""
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
