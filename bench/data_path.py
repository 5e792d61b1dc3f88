"""The data_path rung on a data-bound image run, side by side in one process.

Models (--model):
  image-data-bound  recipes/image-data-bound.yaml: a small ResNet, bf16-mixed, batch 128 of 128-px crops.
                    Its step is host-bound (Lightning's per-step work and launches take longer than the
                    GPU's), so whatever slows the fit's thread, the loader's workers beside it included,
                    shows in full
  timm-vit          the data path's anchor (shared ANCHORS.md): timm's ViT-B/16 with the user's three
                    switches (bf16-mixed, torch.compile, TF32), batch 64 of 224-px crops decoded from
                    256-px JPEGs; a step the GPU bounds

Variants (the same model, precision and seeds; each a Lightning fit timed by StepTimer on
speedkit's measurement session: CUDA events after each step, one wait per window, the median of
windows after warm-up steps):
  stock         the recipe's naive loader: JPEG decode + crop + flip + normalize in the main process, not pinned
  speedkit      the same loader under SpeedLadder(rungs=["data_path"]): workers and pinning chosen by
                measurement, the next batch copied on a side stream while the step runs
  gpu_resident  the bound: the same kind of batches made once and kept on the GPU (no decode, no copy)
  speedkit/K=V  (with --try K=V[,K=V] ...) the rung with those options (e.g. workers=8, prefetch=false):
                diagnostics of where the loader's cost lands (data wait, or host time inside the step)
  --with R,...  every variant's step also gets these rungs (e.g. cuda_graph: the step's host work, which
                the loader's CPU work beside it slows, out of the way); rows carry them as step_rungs
  V+burnN[iso]  (diagnostic) variant V while N processes do the dataset's per-sample work in a loop,
                anywhere, or with "iso" off the CPUs speedkit leaves to the training process: does
                CPU work beside the fit, without any data reaching it, slow the fit's own thread?

Per variant it also prints the fit thread's CPU time and context switches per step (/proc): a thread
slowed by a neighbour on its core runs longer; one waiting (for the GIL, or preempted) switches more.

Rows: bench "data_path", metric "throughput" (samples/s) per variant, plus data_wait_ms, host_ms and
step_ms, and speedkit's fraction of gpu_resident (target >= 0.95 on a GPU).

Usage: PYTHONPATH=. python bench/data_path.py [--steps 20] [--windows 5] [--repeats 3]
       PYTHONPATH=. python bench/data_path.py --tiny      # CPU smoke test, rows to a temporary directory
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from bench.common import Results  # noqa: E402
from speedkit.demos import DecodedImages, SmallResNet  # noqa: E402
from speedkit.lightning import SpeedLadder, StepTimer  # noqa: E402

#: per --model (the rows' model field): the data at full size and tiny (--tiny, CPU)
DATA = {
    "image-data-bound": {
        "full": dict(batch_size=128, size=144, crop=128, classes=100, length=16384),
        "tiny": dict(batch_size=8, size=40, crop=32, classes=10, length=512),
    },
    "timm-vit": {
        "full": dict(batch_size=64, size=256, crop=224, classes=100, length=16384),
        "tiny": dict(batch_size=4, size=40, crop=32, classes=10, length=256),
    },
}


def make_model(name: str, data: dict, tiny: bool, prog_bar: bool = True) -> pl.LightningModule:
    """The model of ``name`` with the user's own switches (for timm-vit: TF32 on and the network under
    torch.compile, on a GPU; bf16-mixed is the Trainer's, for every model)."""
    if name == "image-data-bound":
        return SmallResNet(classes=data["classes"], width=8 if tiny else 32, prog_bar=prog_bar)
    if not prog_bar:
        raise SystemExit("--prog-bar off: only the image-data-bound model has the switch")
    from speedkit.demos.zoo import TimmViT

    module = TimmViT(size="tiny" if tiny else "full", classes=data["classes"])
    if not tiny:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        module.model = torch.compile(module.model)
    return module


class ThreadCounters(Callback):
    """Per step (batch start to the next), of the thread running the fit: wall and CPU time, and its
    voluntary and involuntary context switches, averaged over the steps after ``warmup``."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.marks, self.steps = warmup, None, 0
        self.sums = [0.0, 0.0, 0, 0]

    @staticmethod
    def read() -> tuple[float, float, int, int]:
        switches = {"voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0}
        try:
            for line in Path("/proc/thread-self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in switches:
                    switches[key] = int(value)
        except OSError:
            pass
        return (
            time.perf_counter(),
            time.thread_time(),
            switches["voluntary_ctxt_switches"],
            switches["nonvoluntary_ctxt_switches"],
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        now = self.read()
        if self.marks is not None and batch_idx > self.warmup:
            self.sums = [a + (n - m) for a, n, m in zip(self.sums, now, self.marks)]
            self.steps += 1
        self.marks = now

    def line(self) -> str:
        if not self.steps:
            return "fit thread: no step counted"
        wall, cpu, vol, invol = (v / self.steps for v in self.sums)
        return (
            f"fit thread per step: wall {wall * 1e3:.2f} ms, CPU {cpu * 1e3:.2f} ms ({cpu / wall:.0%}), "
            f"context switches {vol:.1f} voluntary, {invol:.1f} involuntary"
        )


def _burn(dataset, cpus, stop) -> None:  # type: ignore[no-untyped-def]
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(1)
    i = 0
    while not stop.is_set():
        dataset[i % len(dataset)]
        i += 1


def start_burners(n: int, isolated: bool, data: dict) -> tuple[list, object]:
    """``n`` processes doing the dataset's per-sample work until the returned event is set."""
    import multiprocessing

    from speedkit.data.topology import training_cpus
    from speedkit.demos.data import _JpegSamples

    dataset = _JpegSamples(data["length"], data["size"], data["crop"], data["classes"], seed=1)
    cpus = tuple(sorted(training_cpus()[1])) if isolated else None
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_burn, args=(dataset, cpus, stop), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return procs, stop


def run_variant(
    variant: str,
    data: dict,
    *,
    steps: int,
    windows: int,
    warmup: int,
    tiny: bool,
    options: dict | None = None,
    step_rungs: tuple[str, ...] = (),
    model_name: str = "image-data-bound",
    prog_bar: bool = True,
) -> tuple[StepTimer, SpeedLadder | None, ThreadCounters]:
    base, _, burn = variant.partition("+burn")
    pl.seed_everything(0, verbose=False)
    device = "cpu" if tiny else "cuda"
    datamodule = DecodedImages(**data, resident=base == "gpu_resident", device=device, batches=16)
    model = make_model(model_name, data, tiny, prog_bar)
    timer = StepTimer(warmup=warmup, window=steps)
    counters = ThreadCounters(warmup)
    rung = {"name": "data_path", "options": options} if options else "data_path"
    rungs = ([rung] if base.startswith("speedkit") else []) + list(step_rungs)
    ladder = SpeedLadder(rungs=rungs) if rungs else None
    callbacks = [c for c in (ladder, timer, counters) if c is not None]  # the ladder first: the timer starts after it applied
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        precision="32-true" if tiny else "bf16-mixed",
        max_steps=warmup + steps * windows,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    burners, stop = start_burners(int(burn.removesuffix("iso")), burn.endswith("iso"), data) if burn else ([], None)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            trainer.fit(model, datamodule)
    finally:
        if stop is not None:
            stop.set()  # type: ignore[attr-defined]
            for p in burners:
                p.join(timeout=10)
    return timer, ladder, counters


def print_cpus() -> None:
    """The CPUs this process may use and which share a core (a diagnostic's context)."""
    from speedkit.data.topology import allowed_cpus, core_siblings, current_cpu, format_cpu_list, training_cpus

    cpus = sorted(allowed_cpus())
    pairs = sorted({format_cpu_list(core_siblings(c)) for c in cpus})
    kept, rest = training_cpus()
    print(
        f"CPUs {format_cpu_list(cpus)}; cores (hyperthread siblings): {' '.join(pairs)}; this thread on CPU {current_cpu()}; "
        f"kept for training: {format_cpu_list(kept) or 'none'}, workers on {format_cpu_list(rest)}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny images on the CPU, a smoke test; rows go to a temporary directory"
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per timed window (default 20; --tiny 2)")
    parser.add_argument("--windows", type=int, default=None, help="timed windows per variant (default 5; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; --tiny 1)")
    parser.add_argument("--model", choices=sorted(DATA), default="image-data-bound", help="see above")
    parser.add_argument("--variants", default="stock,speedkit,gpu_resident")
    parser.add_argument(
        "--prog-bar",
        choices=("on", "off"),
        default="on",
        help="off: the model logs its loss without prog_bar=True, so Lightning does not turn it into a "
        "float (a host sync) after every step (a diagnostic of what that sync costs)",
    )
    parser.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        help="also run speedkit with these rung options, K=V[,K=V] (e.g. workers=8,prefetch=false); repeatable",
    )
    parser.add_argument(
        "--with",
        dest="step_rungs",
        default="",
        help="rungs every variant's step also gets, comma-separated (e.g. cuda_graph); after data_path",
    )
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the whole run (s)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the variants this many times in rotation (a machine's slow spell then hits every variant "
        "alike); the fraction is the median of the repeats' fractions, each repeat's rows kept",
    )
    parser.add_argument("--results", default=None, help="the JSON-lines file (default: bench/results/<date>_<gpu>.jsonl)")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench/data_path.py needs a CUDA GPU (or --tiny)")
    steps = args.steps or (2 if args.tiny else 20)
    windows = args.windows or (2 if args.tiny else 5)
    warmup = args.warmup or (1 if args.tiny else 10)
    out = Path(args.results) if args.results else (Path(tempfile.mkdtemp()) / "data_path.jsonl" if args.tiny else None)
    res = Results("data_path", out, model=args.model)
    print_cpus()
    data = DATA[args.model]["tiny" if args.tiny else "full"]
    print(f"model {args.model}, data {data}", flush=True)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    runs = [(v, None) for v in args.variants.split(",") if v]
    runs += [
        (f"speedkit/{spec}", {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in spec.split(","))})
        for spec in args.tries
    ]
    step_rungs = tuple(r for r in args.step_rungs.split(",") if r)
    #: what every row of this run carries besides the model: the rungs every step got, the logging
    setup = {
        **({"step_rungs": list(step_rungs)} if step_rungs else {}),
        **({"prog_bar": False} if args.prog_bar == "off" else {}),
    }
    fractions, speedups = [], []
    for repeat in range(args.repeats):
        throughput = run_once(
            runs,
            data,
            res,
            steps=steps,
            windows=windows,
            warmup=warmup,
            tiny=args.tiny,
            repeat=repeat if args.repeats > 1 else None,
            step_rungs=step_rungs,
            model_name=args.model,
            prog_bar=args.prog_bar == "on",
            setup=setup,
        )
        if "speedkit" in throughput and "gpu_resident" in throughput:
            fractions.append(throughput["speedkit"] / throughput["gpu_resident"])
            res.add(
                "speedkit",
                "fraction_of_gpu_resident",
                fractions[-1],
                "fraction",
                target=0.95,
                model=args.model,
                **setup,
                **({"repeat": repeat} if args.repeats > 1 else {}),
            )
            print(f"speedkit / gpu_resident: {fractions[-1]:.1%} (target >= 95%)")
        if "speedkit" in throughput and "stock" in throughput:
            speedups.append(throughput["speedkit"] / throughput["stock"])
            print(f"speedkit / stock: {speedups[-1]:.2f}x")
    if args.repeats > 1 and fractions:
        median = statistics.median(fractions)
        res.add(
            "speedkit",
            "fraction_of_gpu_resident_median",
            median,
            "fraction",
            target=0.95,
            model=args.model,
            repeats=len(fractions),
            fractions=fractions,
            **setup,
        )
        print(
            f"median of {len(fractions)} repeats: speedkit / gpu_resident {median:.1%} "
            f"(each: {', '.join(f'{f:.1%}' for f in fractions)})"
            + (f"; speedkit / stock {statistics.median(speedups):.2f}x" if speedups else "")
        )
    print(f"rows appended to {res.path}")


def run_once(
    runs: list,
    data: dict,
    res: Results,
    *,
    steps: int,
    windows: int,
    warmup: int,
    tiny: bool,
    repeat: int | None,
    step_rungs: tuple[str, ...] = (),
    model_name: str = "image-data-bound",
    prog_bar: bool = True,
    setup: dict | None = None,
) -> dict[str, float]:
    """Each variant once, one after the other; its rows appended (with ``repeat`` when repeating, and
    ``setup``: what every row of the run carries)."""
    throughput: dict[str, float] = {}
    tag = {"model": model_name, **(setup or {}), **({"repeat": repeat} if repeat is not None else {})}
    for variant, options in runs:
        timer, ladder, counters = run_variant(
            variant,
            data,
            steps=steps,
            windows=windows,
            warmup=warmup,
            tiny=tiny,
            options=options,
            step_rungs=step_rungs,
            model_name=model_name,
            prog_bar=prog_bar,
        )
        m = timer.measurement
        if m is None:
            raise SystemExit(f"{variant}: no window was timed (raise --windows or lower --warmup)")
        extra = {
            "noise": m.spread,
            "windows": len(m.window_ms),
            "steps_per_window": m.steps,
            "switch_interval_s": sys.getswitchinterval(),
            **tag,
        }
        if ladder is not None:
            extra["changes"] = [
                line
                for r in ladder.rungs
                for line in (ladder.applied_changes.get(r.name, []) or [f"{r.name} skipped: {ladder.skipped.get(r.name, '')}"])
            ]
        res.add(variant, "throughput", m.throughput, m.throughput_unit, **extra)
        res.add(variant, "step_ms", m.step_ms, "ms", noise=m.spread, **tag)
        res.add(variant, "data_wait_ms", m.data_wait_ms, "ms per step (host time between steps)", **tag)
        res.add(variant, "host_ms", m.host_ms, "ms per step (host time inside the step)", **tag)
        throughput[variant] = m.throughput
        print(
            f"{variant:14s} {m.throughput:>10,.1f} {m.throughput_unit}  {m.step_ms:8.2f} ms/step ±{m.spread:5.1%}  "
            f"data wait {m.data_wait_ms or 0:7.2f} ms/step, host {m.host_ms or 0:7.2f} ms/step",
            flush=True,
        )
        print(f"    {counters.line()}", flush=True)
        if ladder is not None:
            for line in extra["changes"]:
                print(f"    {line}", flush=True)
    return throughput


if __name__ == "__main__":
    main()
