"""Which DDP training steps a whole-step CUDA graph captures, on 2 GPUs over NCCL: a diagnostic, not a
benchmark (it times nothing and writes no result rows).

Why it exists: on 2 H200s the ``cuda_graph`` rung captured DDP's step for an MLP and for the zoo's
ResNet-50, but not for the compiled GPT-2 small ("operation failed due to a previous error during
capture", with Lightning's DDP defaults and with the ``ddp_*`` knobs; it captures on one GPU). The
guess to test is GPT-2's tied input/output embedding: one parameter with two gradient producers,
whose AccumulateGrad node DDP keeps alive on the stream the wrapper was built on (Lightning builds
it on a side stream of its own), so the accumulation crosses streams inside the capture.

Each configuration runs in fresh processes, one per GPU, under a deadline. Each process:
1. builds the model: an MLP, or NaiveGPT "mini" with its tied embedding or untied, eager or compiled;
2. wraps it in DDP on a side stream (as Lightning's ``DDPStrategy`` does);
3. runs 13 eager steps (bf16 autocast, fused capturable AdamW) on the capture stream;
4. captures one step, on a stream of its own, or, with ``-ddpstream``, on the stream DDP was built on.

The ranks agree that every capture succeeded before anything replays (a rank replaying alone would
wait in the all-reduce forever). The table says, per configuration and rank: captured, failed (with
torch's error), or timed out. Where every rank captured, it also gives 5 replays' loss next to an
eager step's.

Usage (on the device machine, from the repository root):
    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD python bench/ddp_capture_probe.py [--configs mlp,gpt-eager-tied] [--timeout-s 90]
    PYTHONPATH=. python bench/ddp_capture_probe.py --dry     # CPU, gloo: the plumbing without a capture
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: name -> (model, compiled, capture on DDP's own stream)
CONFIGS = {
    "mlp": ("mlp", False, False),
    "gpt-eager-untied": ("gpt-untied", False, False),
    "gpt-eager-tied": ("gpt-tied", False, False),
    "gpt-eager-tied-ddpstream": ("gpt-tied", False, True),
    "gpt-compile-untied": ("gpt-untied", True, False),
    "gpt-compile-tied": ("gpt-tied", True, False),
    "gpt-compile-tied-ddpstream": ("gpt-tied", True, True),
}
WARM_STEPS = 13  # past DDP's first 11 iterations (its reducer syncs on its timing events in those)


def _model(kind: str, device: torch.device) -> tuple[torch.nn.Module, object]:
    """The module and a function drawing one batch and its loss."""
    if kind == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).to(device)
        batch = (torch.randn(16, 32, device=device), torch.randint(0, 10, (16,), device=device))
        return model, (batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    from speedkit.demos import NaiveGPT

    model = NaiveGPT("mini", attention="sdpa", block_size=128).to(device)
    if kind == "gpt-untied":
        model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    vocab = model.config["vocab_size"]
    batch = (torch.randint(0, vocab, (8, 128), device=device), torch.randint(0, vocab, (8, 128), device=device))
    return model, (batch, lambda m, b: m(b[0], b[1]))


def worker(rank: int, port: int, name: str, out: str, world: int, dry: bool) -> None:
    kind, compiled, on_ddp_stream = CONFIGS[name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist = torch.distributed
    device = torch.device("cpu") if dry else torch.device("cuda", rank)
    if not dry:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if dry else "nccl", rank=rank, world_size=world)
    torch.manual_seed(0)
    result: dict = {"rank": rank}
    try:
        model, (batch, loss_of) = _model(kind, device)
        if compiled:
            model.compile(backend="eager" if dry else "inductor")
        ddp_stream = None if dry else torch.cuda.Stream()
        if dry:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
        else:
            with torch.cuda.stream(ddp_stream):
                ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        ddp._set_ddp_runtime_logging_sample_rate(2**31 - 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not dry, capturable=not dry)

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, torch.bfloat16):
                loss = loss_of(ddp, batch)
            loss.backward()
            opt.step()
            return loss.detach()

        if dry:
            for _ in range(WARM_STEPS):
                step()
            result["captured"] = True
            result["note"] = "dry run: no capture"
        else:
            stream = ddp_stream if on_ddp_stream else torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARM_STEPS):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    static_loss = step()
                result["captured"] = True
            except Exception as exc:  # noqa: BLE001 - the probe reports it
                result["captured"] = False
                result["error"] = f"{type(exc).__name__}: {exc}"[:800]
                result["traceback"] = traceback.format_exc()[-2500:]
        flag = torch.tensor([1 if result["captured"] else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank captured, or none replays
        result["all_captured"] = bool(flag.item())
        if result["all_captured"] and not dry:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            result["replayed_loss"] = float(static_loss)
            result["eager_loss"] = float(step())
    except Exception as exc:  # noqa: BLE001 - the probe reports it
        result["error"] = f"{type(exc).__name__}: {exc}"[:800]
        result["traceback"] = traceback.format_exc()[-2500:]
    Path(f"{out}.rank{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def run(name: str, out: Path, world: int, timeout_s: float, dry: bool) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    ctx = mp.start_processes(
        worker, args=(port, name, str(out / name), world, dry), nprocs=world, join=False, start_method="spawn"
    )
    timed_out = False
    try:
        while not ctx.join(timeout=max(0.1, started + timeout_s - time.monotonic())):
            if time.monotonic() > started + timeout_s:
                timed_out = True
                for p in ctx.processes:
                    p.kill()
                break
    except Exception as exc:  # noqa: BLE001 - a rank that died is reported from its file, or as missing
        print(f"{name}: a process failed: {str(exc).strip().splitlines()[-1][:300]}", flush=True)
    ranks = []
    for r in range(world):
        path = Path(f"{out / name}.rank{r}")
        seen = json.loads(path.read_text()) if path.exists() else {"rank": r, "missing": True}
        seen["timed_out"] = timed_out and "captured" not in seen
        seen["seconds"] = round(time.monotonic() - started, 1)
        ranks.append(seen)
    return ranks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=90.0, help="deadline of each configuration's processes")
    p.add_argument("--dry", action="store_true", help="CPU processes over gloo, without a capture")
    args = p.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"bench/ddp_capture_probe.py: --configs {unknown[0]!r} is not one of {', '.join(CONFIGS)}")
    if not args.dry and torch.cuda.device_count() < args.devices:
        raise SystemExit(
            f"bench/ddp_capture_probe.py: {args.devices} GPUs asked for, {torch.cuda.device_count()} found (--dry for CPU)"
        )
    out = Path(tempfile.mkdtemp(prefix="ddp-capture-probe-"))
    print(
        f"{'configuration':28s} {'rank':>4s} {'captured':>8s} {'all':>5s} {'s':>5s}  replayed / eager loss, or error", flush=True
    )
    for name in names:
        for seen in run(name, out, args.devices, args.timeout_s, args.dry):
            state = "TIMEOUT" if seen.get("timed_out") else "missing" if seen.get("missing") else str(seen.get("captured"))
            detail = (
                f"{seen['replayed_loss']:.5f} / {seen['eager_loss']:.5f}"
                if "replayed_loss" in seen
                else seen.get("error") or seen.get("note") or ""
            )
            print(
                f"{name:28s} {seen['rank']:4d} {state:>8s} {str(seen.get('all_captured', '-')):>5s} {seen['seconds']:5.0f}  {detail}",
                flush=True,
            )
            if seen.get("traceback") and seen["rank"] == 0:
                print("    " + seen["traceback"].strip().replace("\n", "\n    ")[-1500:], flush=True)


if __name__ == "__main__":
    main()
