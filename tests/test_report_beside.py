"""The report's own process (speedkit.report.beside) takes no core the fit wants: it is put at the lowest
CPU priority the moment it exists, before its imports, and its math libraries run on one thread each.

On a 2-core CPU it had imported torch and matplotlib at the fit's own priority (1.6 s of CPU) with as many
OpenMP threads as cores, and ten of the fit's steps took 130-400 ms while it rendered; at the lowest priority
but in a session of its own (an autogroup of its own, with the same share of the CPU as the fit's), 13 steps
still took 50-900 ms more than the median."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from speedkit.report import beside
from speedkit.report.environment import collect_environment
from speedkit.results import SCHEMA_VERSION, LadderResult, RungResult


class FakeProcess:
    """What ``subprocess.Popen`` gives back, without a process: a pid and a clean exit."""

    pid = 4242
    returncode = 0

    def communicate(self):
        return b"", b""


def _result() -> LadderResult:
    return LadderResult(
        schema_version=SCHEMA_VERSION,
        recipe=None,
        environment=collect_environment(torch.device("cpu")),
        device="cpu",
        flops={"per_step": None, "convention": "", "peak_tflops": None, "peak_source": ""},
        measure={},
        rungs=[RungResult("baseline", "baseline")],
    )


def test_the_report_process_is_started_at_the_lowest_priority_with_one_thread_per_math_library(tmp_path, monkeypatch):
    result, started, policies = _result(), [], []

    def popen(args, **kwargs):
        started.append((args, kwargs))
        return FakeProcess()

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, policy, param: policies.append((pid, policy)), raising=False)
    process = beside.ReportProcess(result, tmp_path)
    ((args, kwargs),) = started
    assert args[1:3] == ["-m", "speedkit.report.beside"]
    # a process group of its own (a signal to the fit's does not reach it), in the fit's session: in a session
    # of its own the kernel's autogroups would share the CPU with it equally, whatever its priority
    assert "start_new_session" not in kwargs and (kwargs.get("process_group") == 0 or kwargs.get("preexec_fn") is os.setpgrp)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        assert kwargs["env"][name] == "1", name
    assert policies == [(FakeProcess.pid, os.SCHED_IDLE)] and process.priority == "SCHED_IDLE"
    # waited for at the fit's end, it yields to nothing of the fit's any more
    assert process.wait() is None and not process.result_path.exists()
    assert policies[-1] == (FakeProcess.pid, os.SCHED_OTHER)


def test_where_sched_idle_is_refused_niceness_19_holds(monkeypatch):
    def refuse(pid, policy, param):
        raise PermissionError("not here")

    niced = []
    monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    monkeypatch.setattr(os, "setpriority", lambda which, pid, value: niced.append((which, pid, value)), raising=False)
    assert beside.run_lowest(4242) == "nice 19" and niced == [(os.PRIO_PROCESS, 4242, 19)]


def _environ_after_exec(pid: int) -> dict[str, str]:
    """The child's environment once it has exec'd: until then ``/proc/<pid>/environ`` is the parent's (read
    too early on a loaded machine, it lacked OMP_NUM_THREADS). Read again until it holds the variable the
    report process is given, for at most 30 s (a bound, not a timing)."""
    for _ in range(3000):
        environ = dict(
            line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in line
        )
        if environ.get("OMP_NUM_THREADS") == "1":
            break
        time.sleep(0.01)
    return environ


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler") or not Path("/proc/self/environ").exists(), reason="Linux")
def test_a_real_report_process_runs_idle_from_its_start_and_writes_the_report(tmp_path):
    """Read while its interpreter still imports torch (1.6 s of CPU): the child already runs under
    SCHED_IDLE (or niceness 19 where that is refused), with one thread per math library."""
    process = beside.ReportProcess(_result(), tmp_path / "r")
    pid = process.process.pid
    policy, nice = os.sched_getscheduler(pid), os.getpriority(os.PRIO_PROCESS, pid)
    environ = _environ_after_exec(pid)
    assert process.priority in ("SCHED_IDLE", "nice 19")
    assert policy == os.SCHED_IDLE if process.priority == "SCHED_IDLE" else nice == 19
    assert environ["OMP_NUM_THREADS"] == "1" and environ["OPENBLAS_NUM_THREADS"] == "1"
    # in the fit's session (its autogroup, where its priority counts), in a process group of its own
    assert os.getsid(pid) == os.getsid(0) and os.getpgid(pid) == pid != os.getpgid(0)
    assert process.wait() is None
    assert {"report.json", "report.md", "report.html"} <= {p.name for p in (tmp_path / "r").iterdir()}
