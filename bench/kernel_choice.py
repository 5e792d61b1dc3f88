"""The norms' and the gated products' kernels against Inductor's code, per shape, as ``triton_layers``
decides it under compile (issue 72, deliver 2): each case through :func:`speedkit.kernels.choice.choose`
(a fresh in-memory store, so it is measured) on CUDA events, forward and backward of the layer alone: the
zoo's language models' norm shapes under bf16 autocast, ``speedkit::swiglu`` against the compiled
``silu(gate) * up`` at the Llamas' MLP shapes, and ``speedkit::geglu`` (tanh) at Gemma-2B's.

Rows (bench "kernel_choice"): ``variant`` ("kernel", "compiled"), metric "ms" (one forward and backward),
``case`` (the layer, shape, dtype, autocast), ``choice`` (what :func:`choose` decides at the 3% margin),
``commit``, ``date``, ``device``; a case the micro-benchmark could not run: metric "status", its reason.

Usage: PYTHONPATH=. python bench/kernel_choice.py [--results FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from speedkit.kernels.choice import ChoiceStore, LayerCase, choose, cuda_timer  # noqa: E402

CASES = {
    "gpt2-small (B16 x 1024)": LayerCase("layer_norm", (16, 1024, 768), "bfloat16", "bfloat16"),
    "llama-400m (B8 x 1024)": LayerCase("rms_norm", (8, 1024, 1536), "bfloat16", "bfloat16", bias=False, eps=1e-5),
    "tinyllama-1.1b (B4 x 2048)": LayerCase("rms_norm", (4, 2048, 2048), "bfloat16", "bfloat16", bias=False, eps=1e-5),
    "vit-b (B128 x 197)": LayerCase("layer_norm", (128, 197, 768), "bfloat16", "bfloat16"),
    # the Llamas' MLP products, gate and up of (batch, tokens, intermediate), as kernel_choice.case_of makes them
    "llama-400m MLP (B8 x 1024)": LayerCase("swiglu", (8, 1024, 4096), "bfloat16", None, affine=False, bias=False, eps=None),
    "tinyllama-1.1b MLP (B4 x 2048)": LayerCase("swiglu", (4, 2048, 5632), "bfloat16", None, affine=False, bias=False, eps=None),
    # Gemma-2B's GeGLU MLP (tanh-GELU gate, intermediate 16384)
    "gemma-2b MLP (B2 x 2048)": LayerCase("geglu_tanh", (2, 2048, 16384), "bfloat16", None, affine=False, bias=False, eps=None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_choice.py needs a CUDA GPU")
    res = Results("kernel_choice", Path(args.results) if args.results else None)
    device = torch.device("cuda")
    for model, case in CASES.items():
        made = choose(case, device, ChoiceStore(), cuda_timer)  # in memory: measured now, as a run's first trial does
        if made.kernel_ms is None:
            res.add("kernel", "status", None, made.why, model=model, case=case.describe())
            print(f"{model:28s} {case.describe():45s} {made.why}", flush=True)
            continue
        choice = "kernel" if made.use_kernel else "compiled"
        for variant, ms in (("kernel", made.kernel_ms), ("compiled", made.compiled_ms)):
            res.add(variant, "ms", ms, "ms", model=model, case=case.describe(), choice=choice)
        print(
            f"{model:28s} {case.describe():45s} kernel {made.kernel_ms:7.3f} ms  compiled {made.compiled_ms:7.3f} ms  -> {choice}",
            flush=True,
        )


if __name__ == "__main__":
    main()
