"""The host's CPUs as the data path uses them: the CPUs this process may run on, physical cores and
their hyperthreads, a training process's share of the machine, the CPUs left to the training process
and those for loader workers, and keeping workers (:class:`WorkerAffinity`) and the loader's threads
in this process (:func:`iterate_with_threads_kept`) on their CPUs."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class WorkerAffinity:
    """A DataLoader ``worker_init_fn`` that keeps its worker on ``cpus``, then calls ``then`` (the
    loader's own ``worker_init_fn``, if any) with the worker id. The CPUs a process runs on change no
    sample and no random draw."""

    def __init__(self, cpus: tuple[int, ...], then: Callable[[int], Any] | None = None) -> None:
        self.cpus, self.then = cpus, then

    def __call__(self, worker_id: int) -> None:
        try:
            os.sched_setaffinity(0, self.cpus)
        except (AttributeError, OSError, ValueError):  # not Linux, or CPUs gone: the worker runs where it may
            pass
        if self.then is not None:
            self.then(worker_id)


#: the threads a DataLoader iterator starts in the training process: one feeding each worker's index
#: queue, and the pinning thread
LOADER_THREADS = ("QueueFeederThread", "_pin_memory_loop")


def iterate_with_threads_kept(loader: Any) -> Iterator[Any]:
    """``iter(loader)``; the threads that iterator started in this process (:data:`LOADER_THREADS`)
    are moved onto the CPUs its workers were kept off (see :class:`WorkerAffinity`). Each of them
    takes the GIL for a moment per batch; on a CPU where a worker is busy it may wait for the CPU
    first, and the thread issuing the step waits for the GIL meanwhile."""
    before = {t.native_id for t in threading.enumerate()}
    it = iter(loader)
    keeper = getattr(loader, "worker_init_fn", None)
    if isinstance(keeper, WorkerAffinity) and getattr(loader, "num_workers", 0) > 0:
        keep_threads_on(allowed_cpus() - set(keeper.cpus), skip=before)
    return it


def keep_threads_on(cpus: set[int], *, skip: set[Any] = frozenset()) -> int:  # type: ignore[assignment]
    """Put this process's :data:`LOADER_THREADS` (but those in ``skip``, by native id) on ``cpus``;
    returns how many moved."""
    if not cpus:
        return 0
    moved = 0
    for thread in threading.enumerate():
        if thread.native_id is None or thread.native_id in skip or not any(n in thread.name for n in LOADER_THREADS):
            continue
        try:
            os.sched_setaffinity(thread.native_id, cpus)
            moved += 1
        except (AttributeError, OSError, ValueError):  # not Linux, or the thread ended
            pass
    return moved


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """How many CPUs this process may run on."""
    return len(allowed_cpus())


def parse_cpu_list(text: str) -> set[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """CPU numbers as a Linux CPU list: runs of consecutive numbers as "a-b"."""
    ordered, runs = sorted(set(cpus)), []
    for _, run in itertools.groupby(enumerate(ordered), lambda iv: iv[1] - iv[0]):
        values = [v for _, v in run]
        runs.append(f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0]))
    return ",".join(runs)


def core_siblings(cpu: int) -> set[int]:
    """The CPUs sharing ``cpu``'s physical core (its hyperthreads, itself included), from sysfs."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return parse_cpu_list(f.read()) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def current_cpu() -> int | None:
    """The CPU the calling thread last ran on (Linux), else None."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def physical_cores(cpus: set[int], siblings: Callable[[int], set[int]] = core_siblings) -> list[set[int]]:
    """``cpus`` grouped by physical core (each CPU with its hyperthread siblings among ``cpus``), in
    order of each core's lowest CPU number."""
    cores, seen = [], set()
    for cpu in sorted(cpus):
        if cpu not in seen:
            core = (siblings(cpu) & cpus) | {cpu}
            seen |= core
            cores.append(core)
    return cores


def host_share(cpus: set[int], rank: int, processes: int, siblings: Callable[[int], set[int]] = core_siblings) -> set[int]:
    """Process ``rank``'s share of ``cpus`` when ``processes`` training processes (DDP ranks on one
    machine) run on them: the physical cores, in order, cut into ``processes`` runs as even as can be
    (hyperthreads of one core never split). With fewer cores than processes, each has all of them."""
    if processes <= 1:
        return set(cpus)
    cores = physical_cores(cpus, siblings)
    if len(cores) < processes or not 0 <= rank < processes:
        return set(cpus)
    per, extra = divmod(len(cores), processes)
    start = rank * per + min(rank, extra)
    return set().union(*cores[start : start + per + (1 if rank < extra else 0)])


def machine_cpus() -> set[int] | None:
    """The CPUs every process here may use unless a launcher narrowed its own: the container's cpuset
    (cgroup v2, then v1), else the CPUs online; None where none of them can be read."""
    for path in (
        "/sys/fs/cgroup/cpuset.cpus.effective",
        "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",
        "/sys/devices/system/cpu/online",
    ):
        try:
            with open(path) as f:
                cpus = parse_cpu_list(f.read())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return None


def training_cpus(
    cores: int = 2,
    *,
    allowed: set[int] | None = None,
    here: int | None = None,
    siblings: Callable[[int], set[int]] = core_siblings,
    processes: tuple[int, int] = (0, 1),
    machine: set[int] | None = None,
) -> tuple[set[int], set[int]]:
    """Split the CPUs this process may use into those left to the training process and those for
    loader workers. The training process keeps ``cores`` physical cores, each with its hyperthread
    siblings: the one its calling thread runs on (``here``), then the lowest-numbered others. A worker
    on the sibling of the thread that issues the step slows that thread (they share one core), and on
    a GPU the step waits for it. Where fewer than two CPUs would be left to workers, none is kept.

    ``processes``: (this one's index, how many) training processes share the machine (DDP ranks). Where
    the CPUs this process may use are all of ``machine``'s (default :func:`machine_cpus`: nobody gave
    each rank its own), it takes only its :func:`host_share`, so that no rank's workers run on the
    cores another rank keeps. A process a launcher already pinned to fewer CPUs splits those as they are."""
    allowed = allowed_cpus() if allowed is None else set(allowed)
    rank, count = processes
    if count > 1:
        machine = machine_cpus() if machine is None else machine
        if machine is None or allowed >= machine:
            allowed = host_share(allowed, rank, count, siblings)
    here = current_cpu() if here is None else here
    order = ([here] if here in allowed else []) + sorted(allowed)
    kept: set[int] = set()
    taken = 0
    for cpu in order:
        if taken == cores:
            break
        if cpu in kept:
            continue
        kept |= siblings(cpu) & allowed
        taken += 1
    rest = allowed - kept
    if len(rest) < 2:
        return set(), allowed
    return kept, rest


def shared_memory_free(path: str = "/dev/shm") -> int | None:
    """Bytes free where shared memory lives (None where there is no such place to ask)."""
    try:
        stat = os.statvfs(path)
    except (AttributeError, OSError):
        return None
    return stat.f_bavail * stat.f_frsize


def physical_memory() -> int:
    """Bytes of memory the machine reports (0 where it does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0
