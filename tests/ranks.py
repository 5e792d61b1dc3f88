"""Spawned CPU processes for tests of distributed code: ``worker(rank, port, *args)`` in each, a
free loopback port for their gloo group, and a deadline that fails the test on a hang."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest


def spawn_ranks(worker: Callable[..., None], *args: Any, nprocs: int = 2, timeout_s: float = 120.0) -> None:
    """Run ``worker(rank, port, *args)`` in ``nprocs`` spawned processes and wait for them all; the
    test fails (the processes killed) when they have not finished within ``timeout_s``."""
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port on the loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(worker, args=(port, *args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the ranks did not finish within {timeout_s:.0f} s: a hang")
