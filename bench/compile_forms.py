"""Where a zoo model's gap between the user's switches and speedkit comes from, in a plain loop.

The zoo measures whole Lightning fits. This takes one zoo model's library module (``self.model``)
and its batches into a plain training loop under the same switches (bf16 autocast, TF32 matmuls)
and varies one thing at a time, side by side in one process:

  module/foreach     ``torch.compile(model)`` (what the zoo's switches do), AdamW's default implementation
  module/fused       the same, AdamW(fused=True) (speedkit's fused_optimizer)
  forward/fused      ``model.forward = torch.compile(model.forward)`` (speedkit's compile rung), fused AdamW
  eager/fused        no compile, fused AdamW

Each variant: a fresh model with the same seed, its graph breaks and compiled frames counted
(dynamo's counters), then CUDA-event windows after warm-up, median step time. Rows: bench
"compile_forms", ``model``, metric "step_ms" and "graph_breaks".

Usage: PYTHONPATH=. python bench/compile_forms.py [--model hf-gpt2] [--steps 10] [--windows 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from speedkit.demos.zoo import ZOO  # noqa: E402
from speedkit.measure.session import MeasureSession  # noqa: E402

VARIANTS = ("module/foreach", "module/fused", "forward/fused", "eager/fused")


def run(name: str, variant: str, steps: int, windows: int, warmup: int) -> tuple[float, int, int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    entry = ZOO[name]
    torch.manual_seed(0)
    module, loader = entry.build("full", **entry.switches)
    model = module.model.cuda().train()
    form, optimizer_kind = variant.split("/")
    forward = model
    if form == "module":
        forward = torch.compile(model)
    elif form == "forward":
        model.forward = torch.compile(model.forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=optimizer_kind == "fused")
    batches = [
        tuple(t.cuda() for t in b) if isinstance(b, (tuple, list)) else {k: v.cuda() for k, v in b.items()}
        for b, _ in zip(loader, range(4))
    ]

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if isinstance(batch, dict):
                loss = forward(**batch).loss
            else:
                loss = forward(input_ids=batch[0], labels=batch[0]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    calls = iter(range(1 << 62))
    times = MeasureSession(torch.device("cuda")).window_times(
        lambda: step(next(calls)), warmup=warmup, steps=steps, repeats=windows
    )
    breaks = sum(counters["graph_break"].values())
    frames = counters["stats"]["unique_graphs"]
    torch.cuda.empty_cache()
    return statistics.median(times), breaks, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="hf-gpt2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/compile_forms.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    res = Results("compile_forms", Path(args.results) if args.results else None)
    for variant in VARIANTS:
        ms, breaks, frames = run(args.model, variant, args.steps, args.windows, args.warmup)
        res.add(variant, "step_ms", ms, "ms", model=args.model)
        res.add(variant, "graph_breaks", breaks, "count", model=args.model, compiled_frames=frames)
        print(f"{args.model} {variant:16s} {ms:8.2f} ms  graph breaks {breaks}  compiled frames {frames}", flush=True)


if __name__ == "__main__":
    main()
