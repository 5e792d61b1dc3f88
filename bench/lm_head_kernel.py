"""The LM head and its loss alone, forward and backward, as the fused op computes them and as the
model's own code does (issue 72): where does ``speedkit::linear_cross_entropy`` spend its time?

Variants, each on the same bf16-autocast inputs (GPT-2 small's head by default: 16 × 1024 tokens,
width 768, vocabulary 50257, the weight an fp32 parameter):

  reference           ``F.cross_entropy(F.linear(h, w).float(), t)`` eager, as transformers computes it
  reference_compiled  the same under ``torch.compile`` (what the switches' compiled step runs)
  fused               :func:`speedkit.kernels.linear_cross_entropy.linear_cross_entropy`, eager
  fused_compiled      the same under ``torch.compile`` (one opaque op in the graph)
  fused_chunk<N>      the fused op at another chunk size (``--chunks``)
  fused_out_dtype     the fused op with dW's chunks from ``torch.mm(…, out_dtype=torch.float32)``

Timed on CUDA events: median of ``--repeats`` windows of ``--steps`` forward+backward passes after
``--warmup`` passes; the peak memory over one pass. ``--profile`` adds the fused op's top CUDA kernels
(torch.profiler) to the output. Rows (bench "lm_head_kernel"): ``variant``, metric "ms" (one forward
and backward), ``peak_GB``, ``tokens``, ``hidden``, ``vocab``, ``commit``, ``date``, ``device``.

Usage: PYTHONPATH=. python bench/lm_head_kernel.py [--tokens 16384 --hidden 768 --vocab 50257] [--profile]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from speedkit.kernels.choice import cuda_median_ms  # noqa: E402
from speedkit.kernels.linear_cross_entropy import linear_cross_entropy  # noqa: E402


def reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--chunks", default="1024,4096", help="other chunk sizes of the fused op to time")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/lm_head_kernel.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=gen)
    res = Results("lm_head_kernel", Path(args.results) if args.results else None)
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "reference": reference,
        "reference_compiled": torch.compile(reference),
        "fused": linear_cross_entropy,
        "fused_compiled": torch.compile(linear_cross_entropy),
    }

    def with_out_dtype(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The fused op with dW's chunks from ``torch.mm(out_dtype=float32)`` (its accumulation before
        d03f0c7's successor): is that path what cost the 0.663x?"""
        from speedkit.kernels import linear_cross_entropy as lce

        original = lce._accumulate

        def accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
            acc.add_(torch.mm(a, b, out_dtype=torch.float32))

        lce._accumulate = accumulate
        try:
            return linear_cross_entropy(h, w, t)
        finally:
            lce._accumulate = original

    variants["fused_out_dtype"] = with_out_dtype
    for chunk in filter(None, args.chunks.split(",")):
        variants[f"fused_chunk{chunk}"] = lambda h, w, t, c=int(chunk): linear_cross_entropy(h, w, t, chunk=c)
    for name, fn in variants.items():

        def step(fn: Callable[..., torch.Tensor] = fn) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(h, w, t)
            loss.backward()
            h.grad = w.grad = None

        try:
            ms = cuda_median_ms(step, args.warmup, args.steps, args.repeats)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 1e9
        except Exception as exc:  # a variant that fails is a row, and the others still run
            res.add(name, "status", 0, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            print(f"{name:20s} failed: {exc}", flush=True)
            continue
        res.add(name, "ms", ms, "ms", peak_GB=round(peak, 3), tokens=args.tokens, hidden=args.hidden, vocab=args.vocab)
        print(f"{name:20s} {ms:8.3f} ms  peak +{peak:6.2f} GB", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = linear_cross_entropy(h, w, t)
                loss.backward()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))


if __name__ == "__main__":
    main()
