"""Does work on another CPU slow this one? A diagnostic of the machine, not a benchmark of record: it
prints, and writes no results file.

A process spinning on CPU 0 counts loop turns for 0.3 s: alone, then with one other process busy on
each other CPU in turn (spinning, or copying 32 MiB arrays), then with half and with all of them
busy. On a machine whose CPUs are separate cores every ratio is about 1.00; a hyperthread sibling
shows as one CPU near 0.6; a virtual machine whose CPUs float over shared cores shows many below 1.
This bounds what a loader's workers may cost a host-bound training step on the same machine
(bench/data_path.py).

Usage: python bench/cpu_siblings.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np


def spin(cpu: int, secs: float, out=None) -> None:  # type: ignore[no-untyped-def]
    os.sched_setaffinity(0, {cpu})
    n, end = 0, time.perf_counter() + secs
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    if out is not None:
        out.put(n / secs)


def burn(cpu: int, stop, kind: str) -> None:  # type: ignore[no-untyped-def]
    os.sched_setaffinity(0, {cpu})
    a = np.ones(8 << 20, dtype=np.float32)
    b = np.empty_like(a)
    while not stop.is_set():
        if kind == "spin":
            x = 0
            for _ in range(100000):
                x += 1
        else:
            np.copyto(b, a)


def rate_with(partners: list[int], kind: str) -> float:
    """CPU 0's spin rate while ``partners`` are busy with ``kind`` work."""
    stop = mp.Event()
    procs = [mp.Process(target=burn, args=(c, stop, kind)) for c in partners]
    for p in procs:
        p.start()
    time.sleep(0.05)
    q: mp.Queue = mp.Queue()
    m = mp.Process(target=spin, args=(0, 0.3, q))
    m.start()
    rate = q.get()
    m.join()
    stop.set()
    for p in procs:
        p.join()
    return rate


def main() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if 0 not in cpus or len(cpus) < 2:
        raise SystemExit("needs CPU 0 and at least one other CPU in this process's affinity")
    base = sorted(rate_with([], "spin") for _ in range(3))[1]
    print(f"CPU 0 alone: {base:,.0f} loop turns/s; with one other CPU busy (CPU:ratio, median of 3):")
    for kind in ("spin", "copy"):
        row = [f"{c}:{sorted(rate_with([c], kind) for _ in range(3))[1] / base:.2f}" for c in cpus[1:]]
        print(f"  {kind:4s} {' '.join(row)}")
        half = cpus[1 : 1 + len(cpus) // 2]
        print(
            f"  {kind:4s} half the others busy: {rate_with(half, kind) / base:.2f}, all: {rate_with(cpus[1:], kind) / base:.2f}"
        )


if __name__ == "__main__":
    main()
