"""Linear layers whose output width is not a multiple of 64 (a vocabulary of 50,257): cuBLAS on
the true width versus the same layer computed on a zero-padded weight, side by side in one process.

For each shape (tokens M, in-features K, out-features N) it times, under bf16 autocast like the
ladder's steps, a language-model head and its loss, ``cross_entropy(F.linear(x, W).float(), t)``,
forward and backward, eager and under torch.compile, with

  exact    N as it is (the logits' rows are N elements apart)
  padded   W padded with zero rows to a multiple of ``--multiple``, the output sliced back to N
           (what the ``aligned_linear`` rung does): the same values, an aligned leading dimension

CUDA events around a window of repeats, median of windows after warm-up. Rows: bench
"gemm_align", metric "step_ms" (fwd+bwd per call) per variant (exact / padded, eager or
compile) and shape, and "speedup" of padded over exact.

Usage: PYTHONPATH=. python bench/gemm_align.py [--shapes 16384x768x50257,8192x768x30522]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from speedkit.kernels.layers import padded_linear  # noqa: E402
from speedkit.measure.session import MeasureSession  # noqa: E402


def time_call(fn, *, warmup: int = 5, repeats: int = 10, windows: int = 7) -> float:
    """Median milliseconds per call over ``windows`` windows of ``repeats`` calls (CUDA events)."""
    return statistics.median(MeasureSession(torch.device("cuda")).window_times(fn, warmup=warmup, steps=repeats, repeats=windows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x768x50257,8192x768x30522,16384x1024x50257")
    parser.add_argument("--multiple", type=int, default=64)
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gemm_align.py needs a CUDA GPU")
    results = Results("gemm_align", Path(args.results) if args.results else None)
    for shape in args.shapes.split(","):
        M, K, N = (int(v) for v in shape.split("x"))
        x = torch.randn(M, K, device="cuda", requires_grad=True)
        w = (torch.randn(N, K, device="cuda") * K**-0.5).requires_grad_()
        target = torch.randint(0, N, (M,), device="cuda")

        def exact(x, w, target):
            return F.cross_entropy(F.linear(x, w).float(), target)

        def padded(x, w, target):
            return F.cross_entropy(padded_linear(x, w, None, args.multiple).float(), target)

        for mode in ("eager", "compile"):
            figures = {}
            for name, head in (("exact", exact), ("padded", padded)):
                fn = torch.compile(head) if mode == "compile" else head

                def fwd_bwd(fn=fn):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = fn(x, w, target)
                    loss.backward()
                    x.grad = w.grad = None

                figures[name] = time_call(fwd_bwd)
                results.add(
                    f"{name}/{mode}", "step_ms", figures[name], "ms (head + loss, fwd+bwd)", shape=shape, multiple=args.multiple
                )
            results.add(
                f"padded/{mode}", "speedup", figures["exact"] / figures["padded"], "x", shape=shape, multiple=args.multiple
            )
            print(
                f"{shape} {mode}: exact {figures['exact']:.3f} ms, padded {figures['padded']:.3f} ms, "
                f"{figures['exact'] / figures['padded']:.3f}x"
            )


if __name__ == "__main__":
    main()
