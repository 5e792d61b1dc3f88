"""GPT-2 small, optimized, on one GPU and on several under DDP (Lightning Trainer): throughput and
scaling efficiency, at the same batch per GPU (16 x 1024 tokens) and the same configuration.

The configuration (both variants): NaiveGPT("small", attention="sdpa") (SDPA attention), bf16-mixed,
TF32 matmuls, fused AdamW, ``torch.compile`` of the module (``module.compile()``: its forward, which
``training_step`` calls inside DDP's forward), loader with 2 workers and pinned memory.

Each variant runs in a fresh process of its own (``bench/ddp.py --worker --devices N``); the N-GPU one
trains with ``Trainer(devices=N, strategy="ddp")``, whose launcher starts the same command line again
in each other process (as ``speedkit optimize`` on a DDP recipe does). Every rank times its own
optimizer steps with StepTimer (speedkit's measurement session: CUDA events, one wait per window, the
median of windows after warm-up steps that hold the compilation); the N-GPU throughput is the sum of
the ranks' tokens at the slowest rank's throughput (DDP's gradient all-reduce keeps their steps in lock-step).

Rows (bench "ddp"): variant "1gpu" and "<N>gpu", metric "throughput" (tokens/s, with per_gpu_batch,
step_ms, noise, peak_memory_gb and, for N GPUs, each rank's throughput and step time); metric
"scaling_efficiency" (variant "<N>gpu"): N-GPU throughput / (N x 1-GPU throughput). The N-GPU variant
is timed once per DDP setting of ``--ddp`` (field ``ddp``): Lightning's defaults, the knobs of speedkit's
ddp_* rungs, and those with gradients all-reduced in bf16. With ``--graph`` the rows also carry
``graph_counts`` (per rank: captures, replayed and eager steps, why the graph stopped) and
``graph_replayed`` (every rank replayed and none stopped); where the graph replayed on one side of a
scaling figure only, no ``scaling_efficiency`` row is written (a graphed step against an eager one).

Usage (the device machine, from the repository root):
    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD python bench/ddp.py [--devices 2] [--windows 5] [--steps 10]
    PYTHONPATH=. python bench/ddp.py --tiny --cpu    # CPU smoke test: tiny GPT, gloo, rows to a temporary file
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402

#: tokens per sequence and sequences per GPU: GPT-2 small's benchmark batch (recipes/gpt2-small-ddp.yaml)
SEQ_LEN, PER_GPU_BATCH = 1024, 16


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2, help="GPUs of the DDP variant (default 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed optimizer steps (default 10; tiny 3)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per timed window (default 10; tiny 3)")
    p.add_argument("--windows", type=int, default=None, help="timed windows (default 5; tiny 3)")
    p.add_argument("--tiny", action="store_true", help="the tiny GPT at 32 tokens, batch 2 per process")
    p.add_argument("--cpu", action="store_true", help="on CPU processes (gloo), without compiling (backend eager)")
    p.add_argument("--results", default=None, help="the JSON-lines file (default: bench/results/<date>_<gpu>.jsonl)")
    p.add_argument("--timeout-s", type=float, default=420, help="wall seconds each variant may take")
    p.add_argument(
        "--ddp",
        default="default,knobs,knobs+bf16",
        help="the N-GPU variant's DDP settings, comma-separated, each timed: default (Lightning's), knobs "
        "(gradient_as_bucket_view, static_graph, 100 MB buckets: speedkit's ddp_* rungs), knobs+bf16 (and "
        "gradients all-reduced in bf16)",
    )
    p.add_argument(
        "--graph",
        action="store_true",
        help="every variant with speedkit's cuda_graph rung (SpeedLadder(rungs=['cuda_graph'])): the whole step, "
        "DDP's all-reduces included, replayed from one CUDA graph; warm-up at least 20 steps (DDP's first 11 "
        "iterations run eagerly before the capture)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # diagnostic: each rank's figures say where in the step a CUDA graph's capture became invalid
    p.add_argument("--trace-capture", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-json", default=None, help=argparse.SUPPRESS)
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    tiny = args.tiny
    return {
        "warmup": args.warmup or (20 if args.graph else 3 if tiny else 10),
        "steps": args.steps or (3 if tiny else 10),
        "windows": args.windows or (3 if tiny else 5),
        "size": "tiny" if tiny else "small",
        "seq_len": 32 if tiny else SEQ_LEN,
        "batch": 2 if tiny else PER_GPU_BATCH,
    }


def worker(args: argparse.Namespace) -> None:
    """One variant's fit (every rank of it); each rank writes its figures to ``<out-json>.rank<r>``."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import seed_everything

    from speedkit.demos import NaiveGPT, SyntheticTokens
    from speedkit.lightning import SpeedLadder, StepTimer

    class FusedAdamGPT(NaiveGPT):
        """NaiveGPT with the fused AdamW (on CUDA)."""

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.device.type == "cuda")

    s = _settings(args)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    seed_everything(0, verbose=False)
    module = FusedAdamGPT(s["size"], attention="sdpa", block_size=s["seq_len"])
    module.compile(backend="eager" if args.cpu else "inductor")
    data = SyntheticTokens(
        batch_size=s["batch"],
        seq_len=s["seq_len"],
        vocab_size=module.config["vocab_size"],
        length=s["batch"] * args.devices * 4096,
        num_workers=0 if args.cpu else 2,
        pin_memory=not args.cpu,
    )
    timer = StepTimer(warmup=s["warmup"], window=s["steps"], unit="tokens")
    graph = SpeedLadder(rungs=["cuda_graph"]) if args.graph else None
    trace = None
    if args.trace_capture:
        from bench.ddp_capture_probe import lightning_trace

        trace = lightning_trace(module)
    trainer = pl.Trainer(
        accelerator="cpu" if args.cpu else "gpu",
        devices=args.devices,
        strategy=_strategy(args.ddp) if args.devices > 1 else "auto",
        precision="32-true" if args.cpu else "bf16-mixed",
        max_steps=s["warmup"] + s["steps"] * s["windows"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *([graph] if graph is not None else []), *([trace] if trace is not None else [])],
    )
    trainer.fit(module, datamodule=data)
    m = timer.measurement
    figures = {
        "rank": trainer.global_rank,
        "graph": graph.fit_reports.get("cuda_graph") if graph is not None else None,
        "graph_counts": graph.fit_counts.get("cuda_graph") if graph is not None else None,
        "throughput": m.throughput if m else None,
        "step_ms": m.step_ms if m else None,
        "noise": m.spread if m else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() and not args.cpu else None,
        "steps": trainer.global_step,
        "trace": trace.summary() if trace is not None else None,
    }
    Path(f"{args.out_json}.rank{trainer.global_rank}").write_text(json.dumps(figures))


#: the DDP settings a variant may time (``--ddp``)
DDP_SETTINGS = {
    "default": {},
    "knobs": {"gradient_as_bucket_view": True, "static_graph": True, "bucket_cap_mb": 100},
    "knobs+bf16": {"gradient_as_bucket_view": True, "static_graph": True, "bucket_cap_mb": 100, "bf16": True},
}


def _strategy(name: str) -> Any:
    """Lightning's DDPStrategy with the DDP settings ``name`` (:data:`DDP_SETTINGS`)."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    kwargs = dict(DDP_SETTINGS[name])
    hook = default_hooks.bf16_compress_hook if kwargs.pop("bf16", False) else None
    return DDPStrategy(ddp_comm_hook=hook, **kwargs)


def run_variant(args: argparse.Namespace, devices: int, out: Path, ddp: str = "default") -> list[dict[str, Any]]:
    """The variant on ``devices`` processes, in a fresh process; every rank's figures, in rank order."""
    passed = [a for a in sys.argv[1:] if a not in ("--worker",)]
    drop = {"--devices", "--out-json", "--results", "--timeout-s", "--ddp"}
    kept: list[str] = []
    skip = False
    for a in passed:
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in drop:
            skip = "=" not in a
            continue
        kept.append(a)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--devices",
        str(devices),
        "--out-json",
        str(out),
        "--ddp",
        ddp,
        *kept,
    ]
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    started = time.monotonic()
    done = subprocess.run(command, env=env, timeout=args.timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"bench/ddp.py: the {devices}-process variant exited with {done.returncode}")
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(devices)]
    print(f"  {devices} process(es): {time.monotonic() - started:.0f} s", flush=True)
    return ranks


def _replayed(ranks: list[dict[str, Any]]) -> bool:
    """Whether every rank replayed its CUDA graph and none stopped it (its timed steps were graph replays)."""
    counts = [r.get("graph_counts") or {} for r in ranks]
    return all(c.get("replays", 0) > 0 and c.get("stopped") is None for c in counts)


def main() -> None:
    args = _parser().parse_args()
    if args.worker:
        worker(args)
        return
    if args.devices < 2:
        raise SystemExit("bench/ddp.py: --devices must be >= 2 (the DDP variant; the 1-GPU one always runs)")
    if not args.cpu and torch.cuda.device_count() < args.devices:
        raise SystemExit(f"bench/ddp.py: {args.devices} GPUs asked for, {torch.cuda.device_count()} found (--cpu for gloo)")
    s = _settings(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ddp-"))
    results_path = Path(args.results) if args.results else (tmp / "ddp.jsonl" if args.tiny else None)
    res = Results("ddp", out=results_path, model=f"gpt2-{s['size']}")
    extra = {
        "cuda_graph": args.graph,
        "per_gpu_batch": s["batch"],
        "seq_len": s["seq_len"],
        "warmup": s["warmup"],
        "window": s["steps"],
        "windows": s["windows"],
    }
    settings = [d.strip() for d in args.ddp.split(",") if d.strip()]
    unknown = [d for d in settings if d not in DDP_SETTINGS]
    if unknown:
        raise SystemExit(f"bench/ddp.py: --ddp {unknown[0]!r} is not one of {', '.join(DDP_SETTINGS)}")
    one = run_variant(args, 1, tmp / "1gpu.json")[0]
    res.add(
        "1gpu",
        "throughput",
        one["throughput"],
        "tokens/s",
        **extra,
        step_ms=one["step_ms"],
        noise=one["noise"],
        peak_memory_gb=one["peak_memory_gb"],
        graph_report=one["graph"],
        graph_counts=one["graph_counts"],
        graph_replayed=_replayed([one]) if args.graph else None,
    )
    name = f"{args.devices}gpu"
    table = [("1gpu", "-", 1, one["step_ms"], one["throughput"], one["peak_memory_gb"], None)]
    for ddp in settings:
        many = run_variant(args, args.devices, tmp / f"{name}-{ddp}.json", ddp)
        # the slowest rank sets a DDP step's pace: every rank's tokens at its throughput (conservative,
        # where a rank's own median is a little faster than the step they share)
        total = len(many) * min(r["throughput"] for r in many) if all(r["throughput"] for r in many) else None
        slowest = max((r["step_ms"] for r in many if r["step_ms"]), default=None)
        peak = max((r["peak_memory_gb"] for r in many if r["peak_memory_gb"] is not None), default=None)
        res.add(
            name,
            "throughput",
            total,
            "tokens/s",
            **extra,
            devices=args.devices,
            ddp=ddp,
            ddp_settings=DDP_SETTINGS[ddp],
            step_ms=slowest,
            noise=max((r["noise"] for r in many if r["noise"] is not None), default=None),
            peak_memory_gb=peak,
            rank_throughput=[r["throughput"] for r in many],
            rank_step_ms=[r["step_ms"] for r in many],
            graph_report=many[0]["graph"],
            graph_counts=[r["graph_counts"] for r in many],
            graph_replayed=_replayed(many) if args.graph else None,
        )
        efficiency = total / (args.devices * one["throughput"]) if total and one["throughput"] else None
        if args.graph and _replayed(many) != _replayed([one]):
            # a graphed step against an eager one is not a scaling figure: no row
            print(
                f"  no scaling_efficiency row for {name} {ddp}: the CUDA graph replayed on "
                f"{'1 GPU' if _replayed([one]) else f'{args.devices} GPUs'} only ({one['graph_counts']} vs "
                f"{[r['graph_counts'] for r in many]})",
                flush=True,
            )
            efficiency = None
        else:
            res.add(name, "scaling_efficiency", efficiency, "ratio", **extra, devices=args.devices, ddp=ddp)
        table.append((name, ddp, args.devices, slowest, total, peak, efficiency))

    print(f"\nGPT-2 {s['size']}, {s['batch']} x {s['seq_len']} tokens per GPU, on {res.device} (commit {res.commit})")
    print(
        f"{'variant':8s} {'ddp':12s} {'processes':>9s} {'step ms':>9s} {'tokens/s':>12s} {'per GPU':>12s} {'peak GB':>8s} {'scaling':>8s}"
    )
    nan = float("nan")
    for label, ddp, n, step_ms, tput, peak, eff in table:
        print(
            f"{label:8s} {ddp:12s} {n:9d} {step_ms or nan:9.2f} {tput or nan:12,.0f} {(tput or nan) / n:12,.0f} "
            f"{peak if peak is not None else nan:8.2f} {eff if eff is not None else nan:8.3f}"
        )
    print(f"rows: {res.path}")


if __name__ == "__main__":
    main()
