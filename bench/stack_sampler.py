"""Where a run's wall time goes, by sampling one thread's Python stack (a benchmark diagnostic).

A background thread reads the watched thread's frame every ``interval_s`` (``sys._current_frames``)
and counts each stack it sees, under a label the caller gives (e.g. the ladder's phase). Unlike
cProfile it costs the watched thread nothing but the GIL for a moment, and it counts time spent
waiting in C (a CUDA synchronize, a compile's worker pool, a DataLoader's queue) where it is spent.
The garbage collector's pauses are timed too (``gc.callbacks``), by label and generation: a collection
runs inside whatever allocation set it off, where a stack cannot name it. Each sample stands for ``interval_s`` of wall time (the sampler's own lateness aside: the report says
how many samples were taken against how many the wall time would hold).

``write(path)`` writes, per label, the functions by inclusive seconds (a function counted once per
sample however deep it recurs) and the most frequent stacks, innermost last; beside it (``.collapsed``)
every stack with its count, as flame-graph tools read them.

    sampler = StackSampler(label=lambda: ladder_phase())
    sampler.start(); ...; sampler.stop(); sampler.write("stacks.txt")
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


class StackSampler:
    def __init__(
        self, interval_s: float = 0.01, label: Callable[[], str] | None = None, depth: int = 60, cpu_every: int = 50
    ) -> None:
        self.interval_s, self.label, self.depth, self.cpu_every = interval_s, label, depth, cpu_every
        #: (label, who) -> CPU seconds; who is "thread <name>" (this process), "child <comm>" (its
        #: descendants) or "other <comm>"
        self.cpu: collections.Counter[tuple[str, str]] = collections.Counter()
        #: label -> wall seconds between CPU readings
        self.cpu_wall: collections.Counter[str] = collections.Counter()
        self._last_cpu: dict[int, tuple[str, float]] | None = None
        self._last_cpu_at = 0.0
        self._commands: dict[int, str] = {}
        self.target = threading.get_ident()  # the thread that makes the sampler: the one watched
        self.stacks: collections.Counter[tuple[str, tuple[str, ...]]] = collections.Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.began = self.ended = 0.0
        #: (label, generation) -> [collections, seconds] of the garbage collector's pauses
        self.gc_pauses: collections.defaultdict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0])
        self._gc_from = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_from = time.perf_counter()
            return
        try:
            label = self.label() if self.label is not None else ""
        except Exception:
            label = "?"
        entry = self.gc_pauses[(str(label), int(info.get("generation", -1)))]
        entry[0] += 1
        entry[1] += time.perf_counter() - self._gc_from

    def _frame_names(self) -> tuple[str, ...] | None:
        frame = sys._current_frames().get(self.target)
        names = []
        while frame is not None:
            code = frame.f_code
            names.append(f"{Path(code.co_filename).name}:{code.co_name}")
            frame = frame.f_back
        return tuple(reversed(names)) if names else None

    def _cpu_reading(self) -> dict[int, tuple[str, float]]:
        """CPU seconds used so far by each thread of this process and each other process (by thread or
        process id: who it is, seconds)."""
        tick = os.sysconf("SC_CLK_TCK")
        names = {t.native_id: t.name for t in threading.enumerate()}
        used: dict[int, tuple[str, float]] = {}

        def stat(path: str) -> tuple[str, int, float] | None:
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                return None
            comm = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / tick

        me = os.getpid()
        for tid in os.listdir(f"/proc/{me}/task"):
            got = stat(f"/proc/{me}/task/{tid}/stat")
            if got is not None:
                used[int(tid)] = (f"thread {names.get(int(tid), got[0])}", got[2])
        parents, procs = {}, {}
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != me:
                got = stat(f"/proc/{pid}/stat")
                if got is not None:
                    parents[int(pid)], procs[int(pid)] = got[1], got
        for pid, (comm, _, seconds) in procs.items():
            up, hops = parents.get(pid), 0
            while up not in (None, 0, 1, me) and hops < 20:
                up, hops = parents.get(up), hops + 1
            if up == me:  # a forked worker runs this process's command; another program is named by its own
                command = self._command(pid)
                used[pid] = (f"child {'(forked)' if command == self._command(me) else command}", seconds)
            else:
                used[pid] = (f"other {comm.split('-')[0]}", seconds)
        return used

    def _command(self, pid: int) -> str:
        """A process's command line, shortened (read once per process)."""
        if pid not in self._commands:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    words = f.read().split(b"\0")
                text = " ".join(w.decode(errors="replace").rsplit("/", 1)[-1] for w in words[:4] if w)
            except OSError:
                text = "?"
            self._commands[pid] = text[:70]
        return self._commands[pid]

    def _charge_cpu(self, label: str) -> None:
        try:
            reading, now = self._cpu_reading(), time.monotonic()
        except Exception:  # not Linux: no CPU account
            return
        if self._last_cpu is not None:
            self.cpu_wall[label] += now - self._last_cpu_at
            for key, (who, seconds) in reading.items():
                spent = seconds - self._last_cpu.get(key, ("", 0.0))[1]
                if spent > 0:
                    self.cpu[(label, who)] += spent
        self._last_cpu, self._last_cpu_at = reading, now

    def _run(self) -> None:
        samples = 0
        while not self._stop.wait(self.interval_s):
            samples += 1
            if samples % self.cpu_every == 0:
                try:
                    cpu_label = self.label() if self.label is not None else ""
                except Exception:
                    cpu_label = "?"
                self._charge_cpu(str(cpu_label))
            names = self._frame_names()
            if names is None:
                continue
            try:
                label = self.label() if self.label is not None else ""
            except Exception:
                label = "?"
            self.stacks[(str(label), names)] += 1

    def start(self) -> StackSampler:
        self.began = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.ended = time.monotonic()

    def write(self, path: str | Path, top_functions: int = 60, top_stacks: int = 25) -> None:
        wall = (self.ended or time.monotonic()) - self.began
        taken = sum(self.stacks.values())
        lines = [
            f"{taken} samples every {self.interval_s * 1000:.0f} ms over {wall:.1f} s of wall time ({wall / self.interval_s:.0f} possible)"
        ]
        by_label: dict[str, collections.Counter[tuple[str, ...]]] = collections.defaultdict(collections.Counter)
        for (label, names), n in self.stacks.items():
            by_label[label][names] += n
        order = sorted(by_label, key=lambda k: -sum(by_label[k].values()))
        for label in order:
            stacks = by_label[label]
            total = sum(stacks.values())
            lines += ["", f"== {label or '(no label)'}: {total * self.interval_s:.1f} s"]
            pauses = sorted((g, n, t) for (lab, g), (n, t) in self.gc_pauses.items() if lab == label)
            wall_s = self.cpu_wall.get(label, 0.0)
            if wall_s:
                spent = sorted(((s, who) for (lab, who), s in self.cpu.items() if lab == label), reverse=True)[:14]
                lines.append(
                    f"  CPU over {wall_s:.1f} s of readings (cores busy on average): "
                    + ", ".join(f"{who} {s / wall_s:.2f}" for s, who in spent)
                )
            if pauses:
                lines.append("  garbage collector: " + ", ".join(f"gen {g}: {int(n)} pauses, {t:.2f} s" for g, n, t in pauses))
            inclusive: collections.Counter[str] = collections.Counter()
            for names, n in stacks.items():
                for fn in set(names):
                    inclusive[fn] += n
            for fn, n in inclusive.most_common(top_functions):
                lines.append(f"  {n * self.interval_s:8.2f} s  {fn}")
            lines.append("  -- stacks (innermost last, the last 12 frames)")
            for names, n in stacks.most_common(top_stacks):
                lines.append(f"  {n * self.interval_s:8.2f} s  " + " > ".join(names[-12:]))
        Path(path).write_text("\n".join(lines) + "\n")
        # every stack, as flame-graph tools read them ("label;outer;...;inner count"), for a closer look
        collapsed = [f"{label};{';'.join(names)} {n}" for (label, names), n in self.stacks.most_common()]
        Path(path).with_suffix(".collapsed").write_text("\n".join(collapsed) + "\n")
