"""Spawned CPU processes for tests of distributed code: ``worker(rank, port, *args)`` in each, a
free loopback port for their gloo group, and a deadline that fails the test on a hang; a test
module's function run in a Python process of its own (a multi-process Trainer's launcher); and a
callback that ends each rank's process group before its interpreter does."""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback

from speedkit.distributed import end_process_group


def spawn_ranks(worker: Callable[..., None], *args: Any, nprocs: int = 2, timeout_s: float = 120.0) -> None:
    """Run ``worker(rank, port, *args)`` in ``nprocs`` spawned processes and wait for them all (each
    rank's process group, where the worker left one, ended before its interpreter: see
    :func:`speedkit.distributed.end_process_group`); the test fails (the processes killed) when they
    have not finished within ``timeout_s``."""
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port on the loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_worker_then_end, args=(worker, port, *args), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the ranks did not finish within {timeout_s:.0f} s: a hang")


def _worker_then_end(rank: int, worker: Callable[..., None], port: int, *args: Any) -> None:
    try:
        worker(rank, port, *args)
    finally:
        end_process_group()


def run_in_process(module: str, call: str, timeout_s: float, what: str = "the 2-process fit") -> None:
    """``module.call`` (e.g. ``"ddp_fit('/tmp/x', True)"``) in a Python process of its own started in
    the tests' folder; the test fails with its stderr where it exits non-zero, and on a hang."""
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            [sys.executable, "-c", f"import {module} as t; t.{call}"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": f"{here}:{here.parent}"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish within {timeout_s:.0f} s: a hang")
    assert done.returncode == 0, done.stderr[-4000:]


class EndProcessGroupAtExit(Callback):
    """Ends the process group Lightning's launcher began, in each rank, as its interpreter exits
    (:func:`speedkit.distributed.end_process_group`: left to the interpreter's own teardown, a rank of a
    fit that succeeded aborted now and then, "terminate called without an active exception")."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        atexit.unregister(end_process_group)  # once per process, however many fits it runs
        atexit.register(end_process_group)
