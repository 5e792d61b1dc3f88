"""SpeedLadder() across GPUs against the user's own switches, in the same processes, and the scaling
against one GPU at the same per-GPU batch (issues 58 and 73). Two workloads (``--model``):

``llama-1b`` (bench "fsdp"): transformers' ``LlamaForCausalLM`` at TinyLlama-1.1B's shape (22 layers of
width 2048, SwiGLU 5632, 32 heads over 4 key-value heads, vocabulary 32000; 1.10B parameters), random
tokens, 4 sequences of 2048 tokens per GPU (torchtitan's Llama default), AdamW; sharded with FSDP2
under Lightning's ``ModelParallelStrategy`` as FSDP2's users shard it, in the LightningModule's
``configure_model``: ``fully_shard`` on each decoder layer, then on the whole model.

``resnet50`` (bench "ddp"): the zoo's torchvision ResNet-50 (``speedkit.demos.zoo``'s ``tv-resnet50``:
``torchvision.models.resnet50``, SGD with momentum, 64 images of 224 px per GPU made by loader workers)
under Lightning's DDP (``strategy="ddp"``).

Variants, one after the other in the same processes (``--variants``):

  switches  the user's own switches: ``Trainer(precision="bf16-mixed")``, TF32 matmuls and
            ``torch.compile``: the Llama's attention switch (``attn_implementation="sdpa"``) and each
            decoder layer compiled before it is sharded (``layer.compile()``, as torchtitan and
            Lightning's FSDP2 examples compile); the ResNet's ``self.model = torch.compile(self.model)``
  speedkit  ``SpeedLadder()`` with its defaults in an fp32 Trainer, the model as built (no compile, the
            library's default attention); with ``--kept a,b`` instead those rungs given by hand, no trials
            (the 2-GPU run's decision on one GPU, for the scaling at the same configuration)
  kept=a+b  the speedkit variant with the rungs a and b given by hand (no trials): several such variants
            in one call measure rungs by hand side by side with the switches

``--runs N`` repeats the variants N times in the same processes (rows carry ``run``, from
``--first-run``). ``--cache off`` (default) runs SpeedLadder(cache=False); ``--cache fresh`` gives each
run a new, empty decisions' folder (``<out>/cache/<model>/run<k>``: it reads nothing, climbs and keeps its
decision); ``--cache on`` the folder of run ``--cache-from`` (default: the run before the first), whose
decision it re-checks; rows carry ``cache_mode`` and ``cache_status``.

``--profile-host DIR``: each variant's rank 0 profiles 3 steps of its warm-up (host and device ops, the
warm-up's 3rd to 5th step; the window opens after them) and writes the ops by host time to DIR.

Each variant is timed on the fit's own optimizer steps by wall clock (bench/zoo_runs.py's
``WallClockWindow``: ``--steps`` steps after ``--warmup`` more once the fit is ready: for speedkit after
its trials, the fit's steps it times after them and its report); each rank times its own window, and the
throughput is all ranks' items over the slowest rank's window (the collectives keep them in step).

Rows (bench "fsdp" or "ddp"), written by rank 0: variant "<variant>_<N>gpu", metric "throughput"
(tokens/s or samples/s, with per_gpu_batch, step_ms, each rank's figures, peak memory, model TFLOP/s a
GPU for the Llama, kept and trials_s for speedkit, run); metric "vs_switches" (speedkit's throughput
over the switches' of the same run); and, where this results file holds the other GPU count's row of the
same variant and commit, "scaling_efficiency": N-GPU throughput / (N x 1-GPU throughput).

Usage (the device machine, from the repository root; the launcher starts the other ranks):
    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python bench/across_gpus.py --model llama-1b --devices 2 --commit C --out $OUT
    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python bench/across_gpus.py --model resnet50 --devices 2 --runs 3 --commit C --out $OUT
    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python bench/across_gpus.py --model resnet50 --devices 1 --commit C --kept tf32,autocast,compile
    PYTHONPATH=. python bench/across_gpus.py --tiny --model resnet50 --devices 2    # CPU smoke test (gloo), rows to a temporary file
    python bench/across_gpus.py --pair-commits A,B --results FILE   # scaling rows across two calls' commits (same speedkit/)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from bench.zoo import compile_as_a_user_would, tf32_matmuls  # noqa: E402
from bench.zoo_runs import WallClockWindow  # noqa: E402
from speedkit.demos.zoo import ZOO, _HFCausalLM  # noqa: E402
from speedkit.lightning import SpeedLadder  # noqa: E402

#: TinyLlama-1.1B's shape; "tiny" for the CPU smoke test
SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        vocab_size=512,
    ),
}


class ShardedLlama(_HFCausalLM):
    """transformers' Llama sharded with FSDP2 in ``configure_model`` (each decoder layer, then the whole
    model, over the data-parallel mesh); ``compile_layers``: each layer compiled first (the user's switch)."""

    def __init__(self, shape: str, attn_implementation: str | None, compile_layers: bool, device: torch.device) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        dims = SHAPES[shape]
        super().__init__(dims["vocab_size"], lr=3e-4)
        self.compile_layers = compile_layers
        with device:  # built where it trains: 4.4 GB of fp32 weights, not initialized on the host
            self.model = LlamaForCausalLM(LlamaConfig(**dims, attn_implementation=attn_implementation))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            if self.compile_layers:
                layer.compile()
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What ``--model`` trains: the module and loader as the variant's user builds them, the strategy, and
    the rows' names."""

    name: str
    bench: str  # the rows' bench
    unit: str  # "tokens" or "samples"
    defaults: dict[str, tuple[int, int]]  # per setting: (full, tiny)

    def build(self, args: argparse.Namespace, switches: bool, device: torch.device) -> tuple[pl.LightningModule, DataLoader]:
        if self.name == "llama-1b":
            shape = "tiny" if args.tiny else "1b"
            module = ShardedLlama(shape, "sdpa" if switches else None, switches and not args.tiny, device)
            return module, _loader(args, SHAPES[shape]["vocab_size"], steps=400)
        module, loader = ZOO["tv-resnet50"].build("tiny" if args.tiny else "full", batch_size=args.batch)
        if switches:  # the zoo's switches: the library model compiled (no channels_last), TF32 and bf16-mixed around the fit
            module = compile_as_a_user_would(module, "eager" if args.tiny else "inductor")
        return module, loader

    def strategy(self, args: argparse.Namespace) -> Any:
        if self.name == "llama-1b":
            from lightning.pytorch.strategies import ModelParallelStrategy

            return ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
        return "ddp" if args.devices > 1 else "auto"

    def model_row(self, args: argparse.Namespace) -> str:
        return {"llama-1b": "llama-1.1b", "resnet50": "tv-resnet50"}[self.name] + ("-tiny" if args.tiny else "")

    def flops_per_item(self, params: int, args: argparse.Namespace) -> float | None:
        if self.name != "llama-1b":
            return None
        return _flops_per_token(SHAPES["tiny" if args.tiny else "1b"], params, args.seq_len)


#: per setting (full, tiny); ``seq_len`` only where the items are tokens
WORKLOADS = {
    "llama-1b": Workload(
        "llama-1b", "fsdp", "tokens", {"batch": (4, 2), "seq_len": (2048, 32), "steps": (30, 3), "warmup": (8, 2)}
    ),
    "resnet50": Workload("resnet50", "ddp", "samples", {"batch": (64, 4), "steps": (30, 3), "warmup": (8, 2)}),
}


class HostProfile(pl.Callback):
    """Rank 0's ops by host time over 3 steps of the timer's warm-up (its 3rd to 5th step after the fit is
    ready), written to ``folder/<variant>.txt``; the window opens after them."""

    def __init__(self, timer: WallClockWindow, folder: Path, variant: str) -> None:
        self.timer, self.folder, self.variant, self.prof = timer, folder, variant, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        ready = self.timer.ready_step
        if trainer.global_rank == 0 and ready is not None and self.prof is None and trainer.global_step == ready + 2:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        prof = self.prof
        if prof is None or trainer.global_step != self.timer.ready_step + 5 or self.folder is None:
            return
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=70)
        self_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
        name = self.variant.replace("=", "_").replace("+", "-")
        (self.folder / f"{name}.txt").write_text(f"3 steps, by total host time\n{table}\n\nby self host time\n{self_table}\n")
        self.folder = None


class GcWatch(pl.Callback):
    """Python's garbage collections during the timed window (count and seconds per generation, the
    longest) and the objects the collector tracks when the window opens: a stall of the fit's steps
    that no hook owns is often a full collection over a large heap."""

    def __init__(self, timer: WallClockWindow) -> None:
        self.timer = timer
        self.times: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.tracked_at_window: int | None = None
        self._t0 = 0.0
        self.between_ms: list[float] = []  # from a batch's end to the next one's start, in the window
        self._ended: float | None = None

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if self.timer.start is None or self.timer.elapsed is not None:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.times[info["generation"]].append(time.perf_counter() - self._t0)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        gc.callbacks.append(self._callback)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._ended is not None and self.timer.start is not None and self.timer.elapsed is None:
            self.between_ms.append(round((time.perf_counter() - self._ended) * 1e3, 1))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.timer.start is not None and self.tracked_at_window is None:
            self.tracked_at_window = len(gc.get_objects())
        self._ended = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def figures(self) -> dict[str, Any]:
        return {
            "tracked_objects_at_window": self.tracked_at_window,
            "frozen_objects": gc.get_freeze_count(),
            "between_steps_ms": self.between_ms,
            **{
                f"gc_gen{g}": [len(t), round(sum(t) * 1e3, 1), round(max(t, default=0.0) * 1e3, 1)] for g, t in self.times.items()
            },
        }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b", choices=sorted(WORKLOADS), help="what trains (see the module doc)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--runs", type=int, default=1, help="the variants this many times over, in the same processes")
    p.add_argument("--first-run", type=int, default=1, help="the first run's number (rows' run)")
    p.add_argument("--cache", choices=("off", "fresh", "on"), default="off", help="SpeedLadder's decisions (module doc)")
    p.add_argument("--cache-from", type=int, default=None, help="with --cache on: whose run's folder (default: the run before)")
    p.add_argument("--variants", default="switches,speedkit", help="comma-separated, run in this order")
    p.add_argument("--kept", default=None, help="the speedkit variant: these rungs given by hand, no trials")
    p.add_argument("--batch", type=int, default=None, help="sequences or images per GPU (Llama 4, ResNet 64; tiny 2, 4)")
    p.add_argument("--seq-len", type=int, default=None, help="the Llama's tokens per sequence (default 2048; tiny 32)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps timed (default 30; tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps before the window once ready (default 8; tiny 2)")
    p.add_argument("--profile-host", default=None, help="a folder: each variant's ops by host time (3 warm-up steps)")
    p.add_argument("--tiny", action="store_true", help="the tiny model on CPU processes (gloo)")
    p.add_argument("--commit", default=None, help="the commit the rows name (the device's copy has no .git)")
    p.add_argument("--results", default=None, help="the JSON-lines file (default: bench/results/<date>_<gpu>.jsonl)")
    p.add_argument("--out", default=None, help="a folder for the speedkit reports and each rank's figures")
    p.add_argument(
        "--pair-commits",
        default=None,
        help="A,B: no fit; the scaling rows of --results's rows at commit B against those at A, where speedkit/ is "
        "the same code at both (git diff; on this machine)",
    )
    return p


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    for name, (full, small) in WORKLOADS[args.model].defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.tiny else full)
    if args.runs < 1:
        raise SystemExit(f"--runs must be 1 or more, found {args.runs}")
    if args.cache != "off" and not args.out:
        raise SystemExit("--cache fresh|on needs --out: the decisions' folders live under <out>/cache")
    return args


def cache_folder(args: argparse.Namespace, run: int) -> Path | None:
    """The run's decisions' folder (``--cache fresh``: its own, new; ``on``: ``--cache-from``'s), or None."""
    if args.cache == "off":
        return None
    owner = run if args.cache == "fresh" else (args.cache_from if args.cache_from is not None else args.first_run - 1)
    return Path(args.out).resolve() / "cache" / args.model / f"run{owner}"


def _loader(args: argparse.Namespace, vocab: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch * args.devices * steps, args.seq_len), generator=g)
    return DataLoader(
        TensorDataset(tokens, tokens),
        batch_size=args.batch,
        shuffle=True,
        num_workers=0 if args.tiny else 2,
        pin_memory=not args.tiny,
    )


def _gather(obj: Any) -> list[Any]:
    if not torch.distributed.is_initialized():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def fit_variant(args: argparse.Namespace, variant: str, run: int = 1) -> dict[str, Any]:
    """One fit until its window is timed; this rank's figures and, for speedkit, its decisions."""
    workload = WORKLOADS[args.model]
    pl.seed_everything(0, verbose=False)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if args.tiny else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    switches = variant == "switches"
    kept = variant.split("=", 1)[1].replace("+", ",") if variant.startswith("kept=") else args.kept
    ladder = None
    if variant == "speedkit" or variant.startswith("kept="):
        began = time.monotonic()

        def on_event(line: str) -> None:
            if int(os.environ.get("LOCAL_RANK", 0)) == 0:
                print(f"  [speedkit {time.monotonic() - began:6.1f}s] {line}", flush=True)

        folder = cache_folder(args, run)
        cache: Any = str(folder) if folder is not None else False
        if kept:
            ladder = SpeedLadder(rungs=kept.split(","))
        elif args.tiny:
            knobs = ["fsdp_reshard", "fsdp_prefetch"] if workload.bench == "fsdp" else ["ddp_bucket_view", "ddp_static_graph"]
            ladder = SpeedLadder(
                [{"name": "compile", "options": {"backend": "eager"}}, *knobs, "fused_optimizer"],
                trials="always",
                on_event=on_event,
                cache=cache,
            )
        else:
            ladder = SpeedLadder(trials="always", on_event=on_event, cache=cache)
    module, loader = workload.build(args, switches, device)
    params = sum(p.numel() for p in module.parameters())
    # rungs given by hand: the fit is ready at once (the timer waits for trials only where there are some)
    timer = WallClockWindow(args.steps, args.warmup, workload.unit, None if kept else ladder)
    profiler = [HostProfile(timer, Path(args.profile_host), variant)] if args.profile_host and args.warmup >= 6 else []
    gc_watch = GcWatch(timer)
    trainer = pl.Trainer(
        accelerator="cpu" if args.tiny else "gpu",
        devices=args.devices,
        strategy=workload.strategy(args),
        precision="bf16-mixed" if switches else "32-true",
        max_steps=100_000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            *([ladder] if ladder else []),
            timer,
            gc_watch,
            *profiler,
        ],  # the ladder first: its batch end runs before the timer's
    )
    t0 = time.perf_counter()
    if switches:
        with tf32_matmuls():
            trainer.fit(module, train_dataloaders=loader)
    else:
        trainer.fit(module, train_dataloaders=loader)
    figures = timer.figures() or {}
    mine = {
        "rank": trainer.global_rank,
        "items": timer.items,
        "elapsed_s": timer.elapsed,
        "step_ms": figures.get("step_ms"),
        "step_ms_median": figures.get("step_ms_median"),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None,
        "fit_wall_s": round(time.perf_counter() - t0, 1),
        "step_ms_each": [round((b - a) * 1e3, 1) for a, b in zip([timer.start, *timer.step_ends], timer.step_ends)]
        if timer.start is not None
        else None,
        **gc_watch.figures(),  # [collections, ms in all, longest ms] per generation in the window
    }
    out: dict[str, Any] = {"variant": variant, "run": run, "params": params, "ranks": _gather(mine)}
    if ladder is not None and ladder.result is not None:
        result = ladder.result
        out.update(
            kept=[r.name for r in result.kept],
            trials_s=result.run.get("trials_s"),
            scaling=result.run.get("scaling"),
            communication=result.run.get("ranks_communication"),
            failed_rungs=[{"rung": r.name, "reason": r.reason} for r in result.rungs[1:] if r.status == "failed"],
            ladder_vs_switches=(result.to_dict()["summary"].get("vs_switches") or [None])[0],
            cache_mode=args.cache,
            cache_status=result.run.get("cache"),
        )
        if args.out and trainer.is_global_zero:
            from speedkit.report import write_report

            folder = Path(args.out) / f"report_{args.model}_{args.devices}gpu_run{run}"
            write_report(result, folder, formats=("json", "md"))
    elif ladder is not None:
        out.update(kept=sorted(ladder.applied_changes), by_hand=True, not_run=ladder.not_run, skipped=dict(ladder.skipped))
    del trainer, module, ladder
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _flops_per_token(shape: dict[str, int], params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x parameters (embedding included, as torchtitan counts) plus attention's
    12 x layers x width x sequence (forward and backward of the scores and their product with the values)."""
    return 6 * params + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq_len


def write_rows(args: argparse.Namespace, fits: list[dict[str, Any]], res: Results) -> None:
    workload = WORKLOADS[args.model]
    n = args.devices
    throughput: dict[tuple[int, str], float] = {}
    for fit in fits:
        ranks = fit["ranks"]
        if any(r["elapsed_s"] is None for r in ranks):
            res.add(f"{fit['variant']}_{n}gpu", "status", None, "", status="window not reached", run=fit["run"], ranks=ranks)
            continue
        value = sum(r["items"] for r in ranks) / max(r["elapsed_s"] for r in ranks)
        throughput[fit["run"], fit["variant"]] = value
        extra = {k: v for k, v in fit.items() if k not in ("variant", "ranks")}
        flops = workload.flops_per_item(fit["params"], args)
        res.add(
            f"{fit['variant']}_{n}gpu",
            "throughput",
            round(value, 1),
            f"{workload.unit}/s",
            gpus=n,
            per_gpu_batch=args.batch,
            **({"seq_len": args.seq_len} if workload.unit == "tokens" else {}),
            step_ms=max(r["step_ms"] for r in ranks),
            **({"model_tflops_per_gpu": round(value / n * flops / 1e12, 1)} if flops else {}),
            ranks=ranks,
            **extra,
        )
    for run in sorted({run for run, _ in throughput}):
        if (run, "switches") in throughput and (run, "speedkit") in throughput:
            res.add(
                f"speedkit_{n}gpu",
                "vs_switches",
                round(throughput[run, "speedkit"] / throughput[run, "switches"], 4),
                "x",
                gpus=n,
                run=run,
                kept=next(f.get("kept") for f in fits if f["variant"] == "speedkit" and f["run"] == run),
                by_hand=bool(args.kept),
            )
    # the scaling, where this file holds the other GPU count's throughput of a variant at this commit
    mine = [r for r in res.rows if r["metric"] == "throughput"]
    scaling_rows(mine, _rows(res.path), res, commits={res.commit})


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def scaling_rows(new: list[dict[str, Any]], earlier: list[dict[str, Any]], res: Results, commits: set[str]) -> None:
    """A "scaling_efficiency" row for each throughput row in ``new`` whose variant ``earlier`` holds at
    another GPU count, the same per-GPU batch and one of ``commits``: N-GPU / (N x fewer-GPU) throughput
    (the latest such row)."""
    for row in new:
        variant, n = row["variant"].rsplit("_", 1)[0], row["gpus"]
        for other in reversed(earlier):
            m = other.get("gpus")
            if (
                other.get("bench") == res.bench
                and other.get("model") == row.get("model")
                and other.get("metric") == "throughput"
                and other.get("commit") in commits
                and other.get("variant") == f"{variant}_{m}gpu"
                and m not in (None, n)
                and other.get("per_gpu_batch") == row["per_gpu_batch"]
            ):
                (many, k), (few, j) = sorted([(row["value"], n), (other["value"], m)], key=lambda t: -t[1])
                res.add(
                    f"{variant}_{k}gpu",
                    "scaling_efficiency",
                    round(many / (k / j * few), 4),
                    "ratio",
                    gpus=k,
                    against=f"{variant}_{j}gpu",
                    measured_at={f"{n}gpu": row["commit"], f"{m}gpu": other["commit"]},  # each throughput's commit
                    per_gpu_batch=row["per_gpu_batch"],
                    device=row["device"],
                )
                break


def pair_commits(path: Path, first: str, second: str, bench: str) -> None:
    """Scaling rows from the throughput rows ``path`` holds at two commits whose ``speedkit/`` is the same
    code (``git diff --quiet``; the bench's own fixes between them allowed): the rows of ``second``
    paired with those of ``first``, written to ``path``, named ``second``."""
    import subprocess

    same = subprocess.run(["git", "diff", "--quiet", first, second, "--", "speedkit"], cwd=REPO).returncode == 0
    if not same:
        raise SystemExit(f"speedkit/ differs between {first} and {second}: their rows measure different code")
    rows = _rows(path)
    res = Results(bench, out=path)
    res.commit = second
    new = [r for r in rows if r.get("bench") == bench and r.get("metric") == "throughput" and r.get("commit") == second]
    scaling_rows(new, rows, res, commits={first})
    for row in res.rows:
        print(json.dumps({k: row[k] for k in ("variant", "metric", "value", "against", "measured_at")}))


def main() -> None:
    args = _settings(_parser().parse_args())
    if args.pair_commits:
        first, second = args.pair_commits.split(",")
        pair_commits(Path(args.results), first, second, WORKLOADS[args.model].bench)
        return
    if args.commit:
        os.environ["SPEEDKIT_BENCH_COMMIT"] = args.commit
    runs = range(args.first_run, args.first_run + args.runs)
    fits = [fit_variant(args, v, run) for run in runs for v in args.variants.split(",")]
    if int(os.environ.get("LOCAL_RANK", 0)) != 0 or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    workload = WORKLOADS[args.model]
    out = Path(args.results) if args.results else (Path(tempfile.mkdtemp()) / f"{workload.bench}.jsonl" if args.tiny else None)
    res = Results(workload.bench, out=out, model=workload.model_row(args))
    if args.commit:
        res.commit = args.commit
    write_rows(args, fits, res)
    for row in res.rows:
        shown = {k: row[k] for k in ("variant", "metric", "value", "unit") if k in row}
        shown.update({k: row[k] for k in ("kept", "trials_s", "step_ms", "model_tflops_per_gpu") if row.get(k) is not None})
        print(json.dumps(shown), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.model}_{args.devices}gpu_runs{runs.start}-{runs.stop - 1}.json").write_text(
            json.dumps(fits, indent=1, default=str)
        )
    print(f"rows in {res.path}")


if __name__ == "__main__":
    main()
