"""Spawned CPU processes for tests of distributed code: ``worker(rank, port, *args)`` in each, a
free loopback port for their gloo group, and a deadline that fails the test on a hang; and a test
module's function run in a Python process of its own (a multi-process Trainer's launcher)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
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
