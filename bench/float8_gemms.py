"""float8 against bf16 per Linear shape, inside torch.compile as the float8 rung runs them (issue 72,
deliver 3): the measured table behind the rung's ``min_features`` prior.

Per shape (M tokens, K in-features, N out-features): one ``nn.Linear(K, N)`` forward and backward on
(M, K) bf16-autocast inputs, compiled, against the same Linear converted by torchao's
``Float8Linear.from_float`` (rowwise scales on compute capability 9.0+, tensorwise below; ``--recipe``),
compiled; medians of CUDA-event windows after warm-up (:func:`speedkit.kernels.choice.cuda_timer`).
Shapes: GPT-2 small's and TinyLlama's Linears at their zoo batch, a Llama-3-8B MLP, and the two points
of torchao's own table (M, K, N = 1024, 2048, 1024: 0.80x; 4096, 8192, 16384: 1.39x).

Rows (bench "float8_gemms"): ``variant`` ("bf16", "float8"), metric "ms", ``M``, ``K``, ``N``, ``shape``
(whose Linear), ``recipe``, ``speedup`` (bf16 ms / float8 ms, on the float8 row), ``commit``, ``date``,
``device``. Needs torchao (carry its wheel to the device) and a GPU of compute capability 8.9+.

Usage: PYTHONPATH=.:/tmp/site python bench/float8_gemms.py [--recipe auto|rowwise|tensorwise] [--results FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from speedkit.kernels.choice import cuda_timer  # noqa: E402
from speedkit.rungs.float8 import ROWWISE_CAPABILITY, hardware_reason, torchao_missing  # noqa: E402

SHAPES = [
    ("gpt2-small attn qkv", 16384, 768, 2304),
    ("gpt2-small mlp up", 16384, 768, 3072),
    ("gpt2-small mlp down", 16384, 3072, 768),
    ("tinyllama q/o", 8192, 2048, 2048),
    ("tinyllama gate/up", 8192, 2048, 5632),
    ("tinyllama down", 8192, 5632, 2048),
    ("llama3-8b gate/up", 8192, 4096, 14336),
    ("llama3-8b down", 8192, 14336, 4096),
    ("torchao table (loses)", 1024, 2048, 1024),
    ("torchao table (wins)", 4096, 8192, 16384),
]


def _pass(linear: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def call() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = linear(x)
        y.backward(dy)
        x.grad = None

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="auto", choices=("auto", "rowwise", "tensorwise"))
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    reason = (hardware_reason(device) if torch.cuda.is_available() else "no CUDA GPU") or torchao_missing()
    if reason:
        raise SystemExit(f"bench/float8_gemms.py: {reason}")
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    recipe = args.recipe
    if recipe == "auto":
        recipe = "rowwise" if torch.cuda.get_device_capability(device) >= ROWWISE_CAPABILITY else "tensorwise"
    config = Float8LinearConfig.from_recipe_name(recipe)
    res = Results("float8_gemms", Path(args.results) if args.results else None)
    for shape, M, K, N in SHAPES:
        torch._dynamo.reset()
        linear = nn.Linear(K, N, bias=False, device=device)
        x = torch.randn(M, K, device=device).requires_grad_()
        dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        bf16_ms = cuda_timer("bf16", _pass(torch.compile(linear), x, dy))
        try:
            f8 = Float8Linear.from_float(nn.Linear(K, N, bias=False, device=device), config=config)
            f8_ms = cuda_timer("float8", _pass(torch.compile(f8), x, dy))
        except Exception as exc:  # a shape float8 cannot take is a row, and the others still run
            res.add("float8", "status", 0, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", shape=shape)
            print(f"{shape:24s} float8 failed: {exc}", flush=True)
            continue
        common = dict(M=M, K=K, N=N, shape=shape, recipe=recipe)
        res.add("bf16", "ms", bf16_ms, "ms", **common)
        res.add("float8", "ms", f8_ms, "ms", speedup=round(bf16_ms / f8_ms, 3), **common)
        print(
            f"{shape:24s} M={M:6d} K={K:6d} N={N:6d}  bf16 {bf16_ms:7.3f} ms  float8 {f8_ms:7.3f} ms  {bf16_ms / f8_ms:5.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
