"""Sweep launch configurations of speedkit's norm and cross-entropy kernels on the GPU at hand.

Prints, per op and shape, the time and effective bandwidth of each configuration and the best one,
so the heuristics in ``speedkit/kernels/norms.py`` and ``cross_entropy.py`` can be set from
measurements. Not a benchmark of record: ``bench/kernels.py`` is (this writes no result file).

Usage: python bench/tune_kernels.py [--ops ln,rms,ce]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import importlib  # noqa: E402

ce_mod = importlib.import_module("speedkit.kernels.cross_entropy")
norms = importlib.import_module("speedkit.kernels.norms")
from speedkit.measure import summarize  # noqa: E402
from speedkit.measure.session import MeasureSession  # noqa: E402

SHAPES = [(16384, 768), (16384, 4096), (8192, 8192)]


def _time(fn, inputs) -> float:
    it = itertools.cycle(inputs)
    windows = MeasureSession(torch.device("cuda")).window_times(lambda: fn(*next(it)), warmup=5, steps=20, repeats=5)
    return summarize(windows)[0]


def tune_norm(rms: bool) -> None:
    name = "rms" if rms else "ln"
    for M, N in SHAPES:
        xs = [torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        dys = [torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = None if rms else torch.randn(N, device="cuda", dtype=torch.bfloat16)
        block_n = norms.next_power_of_2(N)
        fwd_results, bwd_results = [], []
        original_fwd, original_bwd = norms._fwd_config, norms._bwd_config
        try:
            for block_m in sorted({1, 2, 4, 8, 16} & {m for m in (1, 2, 4, 8, 16) if m * block_n <= 16384}):
                for warps in (4, 8, 16, 32):
                    if warps * 32 > block_m * block_n // 2 and warps > 4:
                        continue
                    norms._fwd_config = lambda n, bm=block_m, wp=warps: (bm, block_n, wp)
                    try:
                        ms = _time(lambda x: norms.norm_forward(x, w, b, 1e-5, rms), [(x,) for x in xs])
                    except Exception as exc:  # a config the compiler rejects (registers, shared memory)
                        print(f"  fwd bm={block_m} warps={warps}: {type(exc).__name__}")
                        continue
                    fwd_results.append((ms, block_m, warps))
            norms._fwd_config = original_fwd
            saved = [norms.norm_forward(x, w, b, 1e-5, rms) for x in xs]
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            for block_m in (1, 2, 4, 8):
                if block_m * block_n > 16384:
                    continue
                for warps in (4, 8, 16, 32):
                    for per_sm in (1, 2, 4, 8):
                        if warps * 32 * per_sm > 2048:
                            continue
                        programs = min(-(-M // block_m), sms * per_sm)
                        norms._bwd_config = lambda n, m, d, bm=block_m, wp=warps, p=programs: (bm, block_n, wp, p)
                        try:
                            ms = _time(
                                lambda dy, x, mean, rstd: norms.norm_backward(dy, x, w, mean, rstd, rms, b is not None),
                                [(dy, x, s[1], s[2]) for dy, x, s in zip(dys, xs, saved)],
                            )
                        except Exception as exc:
                            print(f"  bwd bm={block_m} warps={warps} per_sm={per_sm}: {type(exc).__name__}")
                            continue
                        bwd_results.append((ms, block_m, warps, per_sm))
        finally:
            norms._fwd_config, norms._bwd_config = original_fwd, original_bwd
        fwd_results.sort()
        bwd_results.sort()
        default_f = _time(lambda x: norms.norm_forward(x, w, b, 1e-5, rms), [(x,) for x in xs])
        saved = [norms.norm_forward(x, w, b, 1e-5, rms) for x in xs]
        default_b = _time(
            lambda dy, x, mean, rstd: norms.norm_backward(dy, x, w, mean, rstd, rms, b is not None),
            [(dy, x, s[1], s[2]) for dy, x, s in zip(dys, xs, saved)],
        )
        f, bw = fwd_results[0], bwd_results[0]
        tb = lambda bytes_, ms: bytes_ / (ms / 1e3) / 1e12  # noqa: E731
        print(
            f"{name} {M}x{N}: fwd best {f[0] * 1e3:.1f} us (bm={f[1]} warps={f[2]}) {tb(2 * M * N * 2, f[0]):.2f} TB/s, "
            f"default {default_f * 1e3:.1f} us | bwd best {bw[0] * 1e3:.1f} us (bm={bw[1]} warps={bw[2]} per_sm={bw[3]}) "
            f"{tb(3 * M * N * 2, bw[0]):.2f} TB/s, default {default_b * 1e3:.1f} us | fwd+bwd best {tb(5 * M * N * 2, f[0] + bw[0]):.2f} TB/s, "
            f"default {tb(5 * M * N * 2, default_f + default_b):.2f} TB/s",
            flush=True,
        )
        print("   fwd top:", [(round(r[0] * 1e3, 1),) + r[1:] for r in fwd_results[:4]])
        print("   bwd top:", [(round(r[0] * 1e3, 1),) + r[1:] for r in bwd_results[:4]])


def tune_ce() -> None:
    for M, V in ((16384, 50304), (8192, 128256)):
        logits = [torch.randn(M, V, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        target = torch.randint(0, V, (M,), device="cuda")
        results = []
        original = ce_mod._block
        try:
            for block in (4096, 8192, 16384, 32768):
                for warps in (8, 16, 32):
                    ce_mod._block = lambda v, bl=block, wp=warps: (bl, wp)
                    try:
                        ms = _time(lambda x: ce_mod.cross_entropy_forward(x, target, "mean", -100, 0.0), [(x,) for x in logits])
                    except Exception as exc:
                        print(f"  ce block={block} warps={warps}: {type(exc).__name__}")
                        continue
                    results.append((ms, block, warps))
        finally:
            ce_mod._block = original
        results.sort()
        default = _time(lambda x: ce_mod.cross_entropy_forward(x, target, "mean", -100, 0.0), [(x,) for x in logits])
        floor = 2 * M * V * 2
        print(
            f"ce {M}x{V}: best {results[0][0]:.3f} ms (block={results[0][1]} warps={results[0][2]}) "
            f"{floor / (results[0][0] / 1e3) / 1e12:.2f} TB/s of the read-once-write-once floor; default {default:.3f} ms",
            flush=True,
        )
        print("   top:", [(round(r[0], 3),) + r[1:] for r in results[:5]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="ln,rms,ce")
    ops = parser.parse_args().ops.split(",")
    if "ln" in ops:
        tune_norm(rms=False)
    if "rms" in ops:
        tune_norm(rms=True)
    if "ce" in ops:
        tune_ce()


if __name__ == "__main__":
    main()
