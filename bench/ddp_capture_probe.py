"""Which DDP training steps a whole-step CUDA graph captures, on 2 GPUs over NCCL: a diagnostic, not a
benchmark (it times nothing and writes no result rows).

Why it exists: on 2 H200s the ``cuda_graph`` rung captured DDP's step for an MLP and for the zoo's
ResNet-50, but not for the compiled GPT-2 small ("operation failed due to a previous error during
capture", with Lightning's DDP defaults and with the ``ddp_*`` knobs; it captures on one GPU). The
guess to test is GPT-2's tied input/output embedding: one parameter with two gradient producers,
whose AccumulateGrad node DDP keeps alive on the stream the wrapper was built on (Lightning builds
it on a side stream of its own), so the accumulation crosses streams inside the capture.

Each configuration runs in fresh processes, one per GPU, under a deadline. Each process:
1. builds the model: an MLP, or NaiveGPT "mini" (one DDP bucket) or "small" (GPT-2 124M, many buckets)
   with its tied embedding or untied, eager or compiled, DDP's buffer broadcast on or off;
2. wraps it in DDP on a side stream (as Lightning's ``DDPStrategy`` does);
3. runs 13 eager steps (bf16 autocast, fused capturable AdamW) on the capture stream;
4. captures one step, on a stream of its own, or, with ``-ddpstream``, on the stream DDP was built on,
   reading the capture's status at points of the step (after the forward, at every gradient's
   accumulation, after the backward and the optimizer step): where it first became invalid.

The ranks agree that every capture succeeded before anything replays (a rank replaying alone would
wait in the all-reduce forever). The table says, per configuration and rank: captured, failed (with
torch's error), or timed out. Where every rank captured, it also gives 5 replays' loss next to an
eager step's.

Usage (on the device machine, from the repository root):
    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD python bench/ddp_capture_probe.py [--configs mlp,mini-eager-tied] [--timeout-s 90]
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
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: name -> (model, compiled, capture on DDP's own stream, DDP's broadcast_buffers)
CONFIGS = {
    "mlp": ("mlp", False, False, True),
    "mini-eager-untied": ("mini-untied", False, False, True),
    "mini-eager-tied": ("mini-tied", False, False, True),
    "mini-eager-tied-ddpstream": ("mini-tied", False, True, True),
    "mini-compile-untied": ("mini-untied", True, False, True),
    "mini-compile-tied": ("mini-tied", True, False, True),
    "mini-compile-tied-ddpstream": ("mini-tied", True, True, True),
    "small-eager-tied": ("small-tied", False, False, True),
    "small-eager-untied": ("small-untied", False, False, True),
    "small-eager-tied-nobroadcast": ("small-tied", False, False, False),
    "small-compile-tied": ("small-tied", True, False, True),
    "small-compile-untied": ("small-untied", True, False, True),
}
WARM_STEPS = 13  # past DDP's first 11 iterations (its reducer syncs on its timing events in those)


def _model(kind: str, device: torch.device) -> tuple[torch.nn.Module, object]:
    """The module and a function drawing one batch and its loss."""
    if kind == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).to(device)
        batch = (torch.randn(16, 32, device=device), torch.randint(0, 10, (16,), device=device))
        return model, (batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    from speedkit.demos import NaiveGPT

    size, tying = kind.split("-")
    model = NaiveGPT(size, attention="sdpa", block_size=128).to(device)
    if tying == "untied":
        model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    vocab = model.config["vocab_size"]
    batch = (torch.randint(0, vocab, (8, 128), device=device), torch.randint(0, vocab, (8, 128), device=device))
    return model, (batch, lambda m, b: m(b[0], b[1]))


def _capture_status() -> Any:
    """A function of a CUDA stream: 0 not capturing, 1 capturing, 2 capture invalidated (CUDA's
    ``cudaStreamIsCapturing``, through the runtime library torch loaded), or None where it cannot be read."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart" in line), None)
        lib = ctypes.CDLL(path or "libcudart.so")
    except OSError:
        return lambda stream: None

    def status(stream: Any) -> int | None:
        if not hasattr(stream, "cuda_stream"):  # a torch.Stream (current_stream() may return one)
            stream = torch.cuda.Stream(
                stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
            )
        out = ctypes.c_int(-1)
        rc = lib.cudaStreamIsCapturing(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(out))
        return out.value if rc == 0 else None

    return status


class _Trace:
    """Where, during the captured step, the capture stream's capture became invalid: its status read
    after the forward, in every parameter's post-accumulate-grad hook (on the autograd engine's thread,
    with the stream the hook runs on), after the backward and after the optimizer step."""

    def __init__(self, model: torch.nn.Module, capture_stream: Any) -> None:
        self.on = False
        self.seen: list[tuple[str, Any, Any]] = []
        self.status = _capture_status()
        self.stream = capture_stream
        for name, param in model.named_parameters():  # a tied parameter once, under its first name
            param.register_post_accumulate_grad_hook(self._hook(f"grad {name}"))

    def _hook(self, where: str) -> Any:
        return lambda param: self.mark(where)

    def mark(self, where: str) -> None:
        if self.on:
            here = torch.cuda.current_stream()
            self.seen.append((where, self.status(self.stream), f"{here.stream_id}:{self.status(here)}"))

    def summary(self) -> str:
        bad = next((i for i, (_, status, _) in enumerate(self.seen) if status == 2), None)
        streams = sorted({s for _, _, s in self.seen})
        head = f"{len(self.seen)} points; streams (id:status) {streams}"
        if bad is None:
            return head + "; the capture stream never read invalid"
        before = self.seen[bad - 1] if bad else None
        return f"{head}; first invalid at {self.seen[bad]} (point {bad}), after {before}"


def lightning_trace(module: torch.nn.Module) -> Any:
    """A Lightning callback reading the current stream's capture status through every step (Lightning's
    hooks around the backward and the optimizer step, and every gradient's accumulation), for a fit
    through speedkit's ``cuda_graph`` rung: where its capture became invalid. ``bench/ddp.py
    --trace-capture`` adds it; its summary goes to the worker's figures."""
    import lightning.pytorch as pl

    status = _capture_status()
    seen: list[tuple[int, str, int, Any]] = []
    steps = [0]

    def mark(where: str) -> None:
        if torch.cuda.is_available():
            here = torch.cuda.current_stream()
            try:
                seen.append((steps[0], where, here.stream_id, status(here)))
            except Exception as exc:  # noqa: BLE001 - a trace must not stop the fit
                seen.append((steps[0], where, here.stream_id, f"{type(exc).__name__}: {exc}"[:80]))

    for name, param in module.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, where=f"grad {name}": mark(where))
    training_step = module.training_step

    def traced_step(*args: Any, **kwargs: Any) -> Any:
        mark("training_step start")
        out = training_step(*args, **kwargs)
        mark("training_step end")
        return out

    module.training_step = traced_step

    class Trace(pl.Callback):
        def __init__(self) -> None:
            # Lightning's in-step hooks, set on the instance: the cuda_graph rung refuses a class that
            # overrides them (their host code runs at capture only), and at capture is all this reads
            for hook in ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad"):
                setattr(self, hook, lambda *args, where=hook: mark(where))

        def on_train_batch_start(self, *args: Any) -> None:
            steps[0] += 1
            mark("batch start")

        def on_train_batch_end(self, *args: Any) -> None:
            mark("batch end")

        def summary(self) -> str:
            capturing = [m for m in seen if m[3] in (1, 2)]
            bad = next((i for i, m in enumerate(seen) if m[3] == 2), None)
            head = f"{len(capturing)} points read capturing, in steps {sorted({m[0] for m in capturing})}"
            if bad is None:
                return head + "; none read invalid"
            return f"{head}; first invalid: {seen[bad]}; the 4 before: {seen[max(0, bad - 4) : bad]}"

    return Trace()


def worker(rank: int, port: int, name: str, out: str, world: int, dry: bool) -> None:
    kind, compiled, on_ddp_stream, broadcast_buffers = CONFIGS[name]
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
            ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
        else:
            with torch.cuda.stream(ddp_stream):
                ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], broadcast_buffers=broadcast_buffers)
        ddp._set_ddp_runtime_logging_sample_rate(2**31 - 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not dry, capturable=not dry)

        stream = None if dry else ddp_stream if on_ddp_stream else torch.cuda.Stream()
        trace = None if dry else _Trace(model, stream)

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, torch.bfloat16):
                loss = loss_of(ddp, batch)
            if trace is not None:
                trace.mark("forward done")
            loss.backward()
            if trace is not None:
                trace.mark("backward done")
            opt.step()
            if trace is not None:
                trace.mark("optimizer step done")
            return loss.detach()

        if dry:
            for _ in range(WARM_STEPS):
                step()
            result["captured"] = True
            result["note"] = "dry run: no capture"
        else:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARM_STEPS):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                trace.on = True
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    static_loss = step()
                result["captured"] = True
            except Exception as exc:  # noqa: BLE001 - the probe reports it
                result["captured"] = False
                result["error"] = f"{type(exc).__name__}: {exc}"[:800]
                result["traceback"] = traceback.format_exc()[-2500:]
            finally:
                trace.on = False
                result["trace"] = trace.summary()
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
    files = [Path(f"{out / name}.rank{r}") for r in range(world)]
    try:
        # done when every rank wrote its result (a process may then hang in NCCL's teardown: killed)
        while not all(f.exists() for f in files) and not ctx.join(timeout=0.5):
            if time.monotonic() > started + timeout_s:
                timed_out = True
                break
    except Exception as exc:  # noqa: BLE001 - a rank that died is reported from its file, or as missing
        print(f"{name}: a process failed: {str(exc).strip().splitlines()[-1][:300]}", flush=True)
    time.sleep(1.0)  # the last file's writer closes it
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
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
            if seen.get("trace"):
                print(f"    trace: {seen['trace'][:600]}", flush=True)
            if seen.get("traceback") and seen["rank"] == 0:
                print("    " + seen["traceback"].strip().replace("\n", "\n    ")[-1500:], flush=True)


if __name__ == "__main__":
    main()
