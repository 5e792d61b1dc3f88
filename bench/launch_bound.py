"""The launch-bound MLP (ANCHORS.md), side by side in one process on one GPU.

8 × (Linear 256→256, ReLU) + Linear 256→10, batch 64, AdamW, fed from batches already on the GPU
(the bound is the launches, not the data). Variants, all timed the same way (speedkit's
measurement session: CUDA events, one wait per window, median of warmed-up windows) in one loop:

  eager       the plain PyTorch step
  hand_graph  the anchor: forward, backward and a capturable AdamW captured by hand in one CUDA graph
  speedkit    the default ladder (trials, keep what pays) on the same step, then its final step

Rows: bench "launch_bound", model "launch-bound-mlp", metric "throughput" (samples/s), plus step_ms and the kept rungs.
Usage: python bench/launch_bound.py [--tiny]   (--tiny: a CPU smoke run of the code path)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from speedkit import config  # noqa: E402
from speedkit import rungs as rung_registry  # noqa: E402
from speedkit.data.source import BatchSource  # noqa: E402
from speedkit.demos import LaunchBoundMLP  # noqa: E402
from speedkit.engine.ladder import Ladder  # noqa: E402
from speedkit.measure.session import MeasureSession  # noqa: E402
from speedkit.training.state import TrainState  # noqa: E402
from speedkit.training.step import PlainStep  # noqa: E402

BATCH, FEATURES, HIDDEN, DEPTH, CLASSES = 64, 256, 256, 8, 10
WARMUP, STEPS, REPEATS = 20, 200, 7


def _batches(device: torch.device, n: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(BATCH, FEATURES, generator=g).to(device), torch.randint(0, CLASSES, (BATCH,), generator=g).to(device))
        for _ in range(n)
    ]


def _model(device: torch.device) -> LaunchBoundMLP:
    torch.manual_seed(0)
    return LaunchBoundMLP(FEATURES, HIDDEN, DEPTH, CLASSES).to(device)


def _cycle(batches: list):
    while True:
        yield from batches


def _time(res: Results, variant: str, step, device: torch.device, batches: list, **extra) -> float:
    session = MeasureSession(device, items_per_step=BATCH, unit="samples/s")
    it = _cycle(batches)
    m = session.measure(lambda: step(next(it)), warmup=WARMUP, steps=STEPS, repeats=REPEATS)
    res.add(variant, "throughput", m.throughput, "samples/s", step_ms=m.step_ms, noise=m.spread, **extra)
    res.add(variant, "step_ms", m.step_ms, "ms", noise=m.spread)
    print(f"{variant:12s} {m.step_ms * 1e3:8.1f} us/step  {m.throughput:12,.0f} samples/s  ±{m.spread:.1%}", flush=True)
    return m.step_ms


def eager(res: Results, device: torch.device, batches: list) -> float:
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch) -> None:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _time(res, "eager", step, device, batches)


def hand_graph(res: Results, device: torch.device, batches: list) -> float:
    """The anchor: torch's documented whole-network capture, written by hand."""
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    static_x, static_y = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        F.cross_entropy(model(static_x), static_y).backward()
        opt.step()

    def step(batch) -> None:
        static_x.copy_(batch[0])
        static_y.copy_(batch[1])
        graph.replay()

    return _time(res, "hand_graph", step, device, batches)


def speedkit(res: Results, device: torch.device, batches: list, tiny: bool) -> float:
    """The default ladder with trials on the plain step, then its final configuration timed like the others."""
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(m, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(m(x), y)

    step = PlainStep(model, opt, device, loss_fn=loss_fn)
    state = TrainState(model=model, optimizer=opt, device=device, step=step, data=BatchSource(batches, device))
    measure = {"warmup": 10, "steps": 50, "repeats": 5} if not tiny else {"warmup": 1, "steps": 2, "repeats": 2, "max_blocks": 3}
    ladder = Ladder(
        state, rung_registry.make_all(config.default_ladder()), measure, on_event=lambda line: print("  " + line, flush=True)
    )
    result = ladder.run()
    kept = [r.name for r in result.kept]
    for r in result.rungs[1:]:
        print(f"  {r.name:16s} {r.status:15s} {r.reason or ''}", flush=True)
        for line in r.changes:
            if "CUDA graph" in line or "graph stopped" in line:
                print(f"      {line}", flush=True)
    ms = _time(res, "speedkit", lambda b: state.step([b], 0), device, batches, kept=kept)
    ladder.revert()
    return ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run of the code path (few steps, no figures)")
    parser.add_argument("--out", type=Path, default=None, help="results file (default: bench/results/<date>_<gpu>.jsonl)")
    args = parser.parse_args(argv)
    global WARMUP, STEPS, REPEATS
    if args.tiny:
        WARMUP, STEPS, REPEATS = 1, 3, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    res = Results("launch_bound", args.out, model="launch-bound-mlp")
    batches = _batches(device)
    base = eager(res, device, batches)
    if device.type == "cuda":
        hand = hand_graph(res, device, batches)
        res.add("hand_graph", "speedup_vs_eager", base / hand, "x")
    fast = speedkit(res, device, batches, args.tiny)
    res.add("speedkit", "speedup_vs_eager", base / fast, "x", target=6.0)
    print(f"speedkit / eager: {base / fast:.2f}x (target >= 6x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
