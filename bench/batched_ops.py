"""A Python loop of small GEMMs vs the batched rung vs one hand-written torch.bmm, in one process.

Variants, each forward-only (``no_grad``) and forward+backward, with fp32 matmuls at full precision
(TF32 off, PyTorch's default) and with TF32 on:
  loop     LoopOfGEMMs as written: 40 × ``x[i] @ weight[i]``, then ``torch.stack``
  batched  the same module after ``BatchedRung().apply`` (the loop becomes one batched matmul)
  bmm      ``torch.bmm(x, weight)`` by hand, the ceiling the rung aims at

Timed on the speedkit step clock (CUDA events, one wait per window), medians over warmed-up windows;
result lines appended through ``bench.common.Results("batched_ops")``. The rung's target is >= 20x
over the loop (anchor, H200, 40 × 256×256 fp32 forward: loop 0.91 ms, bmm 0.024 ms).

Usage: python bench/batched_ops.py [--device cuda|cpu] [--repeats 5] [--steps N] [--n 40] [--dim 256]
``--device cpu`` is a smoke test: its results go to a temporary directory, never to bench/results.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from speedkit.demos.batched import LoopOfGEMMs  # noqa: E402
from speedkit.measure import summarize  # noqa: E402
from speedkit.measure.session import MeasureSession  # noqa: E402
from speedkit.rungs.batched import BatchedRung  # noqa: E402
from speedkit.training.state import TrainState  # noqa: E402

TARGET_SPEEDUP = 20.0
PRECISIONS = {"fp32": "highest", "tf32": "high"}  # name in the results: torch.set_float32_matmul_precision


def _variants(n: int, dim: int, device: torch.device) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    loop = LoopOfGEMMs(n, dim).to(device)
    batched = copy.deepcopy(loop)
    state = TrainState(model=batched, optimizer=torch.optim.SGD(batched.parameters(), lr=0.0), device=device)
    handle = BatchedRung().apply(state)
    if handle.rewrite.counts["rewritten"] != 1:
        raise SystemExit(f"the batched rung did not rewrite LoopOfGEMMs: {handle.changes}")
    print(handle.changes[0], flush=True)
    return {"loop": loop, "batched": batched, "bmm": lambda x, w=loop.weight: torch.bmm(x, w)}


def _check_same(variants: dict, x: torch.Tensor) -> None:
    with torch.no_grad():
        ref = variants["loop"](x)
        for name in ("batched", "bmm"):
            torch.testing.assert_close(variants[name](x), ref, rtol=1e-4, atol=1e-4, msg=f"{name} differs from the loop")


def _step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor, backward: bool) -> Callable[[], None]:
    if not backward:

        def forward() -> None:
            with torch.no_grad():
                fn(x)

        return forward

    xg = x.detach().clone().requires_grad_()

    def forward_backward() -> None:
        fn(xg).backward(grad)  # gradients accumulate; their size does not change the work

    return forward_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per variant")
    parser.add_argument("--steps", type=int, default=None, help="steps per window (default 50 on cuda, 3 on cpu)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--n", type=int, default=40, help="GEMMs per forward")
    parser.add_argument("--dim", type=int, default=256, help="each GEMM is dim × dim × dim")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; run with --device cpu for a smoke test")
    steps = args.steps or (50 if device.type == "cuda" else 3)
    warmup = args.warmup if device.type == "cuda" else min(args.warmup, 2)
    if device.type == "cpu":  # smoke results stay out of git
        out = Path(tempfile.gettempdir()) / "speedkit-bench" / f"{datetime.date.today().isoformat()}_cpu.jsonl"
        res = Results("batched_ops", out=out)
        res.device = "cpu"
    else:
        res = Results("batched_ops")
    shape = f"{args.n}x{args.dim}x{args.dim}"

    variants = _variants(args.n, args.dim, device)
    x = torch.randn(args.n, args.dim, args.dim, device=device)
    grad = torch.randn_like(x)
    previous = torch.get_float32_matmul_precision()
    try:
        for precision, setting in PRECISIONS.items():
            torch.set_float32_matmul_precision(setting)
            if setting == "highest":
                _check_same(variants, x)
            for mode, backward in (("forward", False), ("forward+backward", True)):
                times = {}
                for name, fn in variants.items():
                    windows = MeasureSession(device).window_times(
                        _step(fn, x, grad, backward), warmup=warmup, steps=steps, repeats=args.repeats
                    )
                    ms, noise = summarize(windows)
                    times[name] = ms
                    res.add(f"{mode}/{precision}/{name}", "ms", ms, "ms", noise=noise, shape=shape)
                for name in ("batched", "bmm"):
                    speedup = times["loop"] / times[name]
                    res.add(
                        f"{mode}/{precision}/{name}",
                        "speedup_vs_loop",
                        speedup,
                        "x",
                        shape=shape,
                        **({"target": TARGET_SPEEDUP} if name == "batched" else {}),
                    )
                print(
                    f"{mode:17s} {precision}: loop {times['loop']:8.3f} ms  batched {times['batched']:8.3f} ms "
                    f"({times['loop'] / times['batched']:5.1f}x)  bmm {times['bmm']:8.3f} ms "
                    f"({times['loop'] / times['bmm']:5.1f}x)",
                    flush=True,
                )
    finally:
        torch.set_float32_matmul_precision(previous)
    fwd = res.value("forward/fp32/batched", "speedup_vs_loop")
    print(f"batched rung over the loop, fp32 forward: {fwd:.1f}x (target >= {TARGET_SPEEDUP:.0f}x)")
    print(f"results appended to {res.path}")


if __name__ == "__main__":
    main()
