"""The norms' kernel against Inductor's code, per shape, as ``triton_layers`` decides it under compile
(issue 72, deliver 2): :func:`speedkit.kernels.choice.measure` on CUDA events, forward and
backward of the layer alone, for the zoo's language models' norm shapes under bf16 autocast; and the
SwiGLU product's kernel (``speedkit::swiglu``, which ``triton_layers`` leaves out of compiled code)
against the compiled ``silu(gate) * up`` at the Llamas' MLP shapes, to tell whether a per-shape choice
for it could ever pick the kernel.

Rows (bench "kernel_choice"): ``variant`` ("kernel", "compiled"), metric "ms" (one forward and backward),
``case`` (the layer, shape, dtype, autocast), ``choice`` (what :func:`choose` decides at the 3% margin),
``commit``, ``date``, ``device``; the SwiGLU rows carry ``case`` "swiglu <shape> bfloat16".

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
from speedkit.kernels.choice import MARGIN, LayerCase, cuda_timer, measure  # noqa: E402

#: the Llamas' MLP products: gate and up of (batch, tokens, intermediate)
SWIGLU = {"llama-400m (B8 x 1024)": (8, 1024, 4096), "tinyllama-1.1b (B4 x 2048)": (4, 2048, 5632)}


def swiglu_ms(shape: tuple[int, ...], device: torch.device) -> tuple[float, float]:
    """(kernel, compiled) ms of one forward and backward of ``silu(gate) * up`` in bf16."""
    from speedkit import kernels

    gate = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(shape, device=device, dtype=torch.bfloat16)
    compiled = torch.compile(lambda g, u: torch.nn.functional.silu(g) * u)

    def run(fn):
        def call() -> None:
            fn(gate, up).backward(dy)
            gate.grad = up.grad = None

        return call

    return cuda_timer("kernel", run(kernels.swiglu)), cuda_timer("compiled", run(compiled))


CASES = {
    "gpt2-small (B16 x 1024)": LayerCase("layer_norm", (16, 1024, 768), "bfloat16", "bfloat16"),
    "llama-400m (B8 x 1024)": LayerCase("rms_norm", (8, 1024, 1536), "bfloat16", "bfloat16", bias=False, eps=1e-5),
    "tinyllama-1.1b (B4 x 2048)": LayerCase("rms_norm", (4, 2048, 2048), "bfloat16", "bfloat16", bias=False, eps=1e-5),
    "vit-b (B128 x 197)": LayerCase("layer_norm", (128, 197, 768), "bfloat16", "bfloat16"),
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
        kernel_ms, compiled_ms = measure(case, device, cuda_timer)
        choice = "kernel" if kernel_ms <= (1 - MARGIN) * compiled_ms else "compiled"
        for variant, ms in (("kernel", kernel_ms), ("compiled", compiled_ms)):
            res.add(variant, "ms", ms, "ms", model=model, case=case.describe(), choice=choice)
        print(
            f"{model:28s} {case.describe():45s} kernel {kernel_ms:7.3f} ms  compiled {compiled_ms:7.3f} ms  -> {choice}",
            flush=True,
        )
    for model, shape in SWIGLU.items():
        kernel_ms, compiled_ms = swiglu_ms(shape, device)
        choice = "kernel" if kernel_ms <= (1 - MARGIN) * compiled_ms else "compiled"
        case = f"swiglu {shape} bfloat16"
        for variant, ms in (("kernel", kernel_ms), ("compiled", compiled_ms)):
            res.add(variant, "ms", ms, "ms", model=model, case=case, choice=choice)
        print(f"{model:28s} {case:45s} kernel {kernel_ms:7.3f} ms  compiled {compiled_ms:7.3f} ms  -> {choice}", flush=True)


if __name__ == "__main__":
    main()
