"""Where the time of speedkit's kernels goes. A diagnostic, not a benchmark of record: it writes no
results file (``bench/kernels.py`` is the record).

Per norm op × shape and variant (eager, speedkit), forward+backward through autograd as
``bench/kernels.py`` times it:
  step    median ms per step on the step clock (CUDA events, one wait per window)
  gpu     the kernels' own time per step, summed from a torch.profiler trace (no gaps)
  host    wall time the host spends issuing one step (perf_counter over many steps, before the sync)
  kernels each kernel's mean time per call
and, for speedkit, the launchers timed without autograd (``norm_forward`` + ``norm_backward``).

``--ce``: cross-entropy forward variants (cache hints, persistent grid, chunk sizes) built here
from speedkit's kernel, timed on the step clock, to choose what the kernel should do.

Usage: python bench/profile_kernels.py [--ops ln,rms] [--shapes 16384x4096] [--ce]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speedkit.kernels as sk
from speedkit.kernels import norm_kernels, norms
from speedkit.measure import summarize
from speedkit.measure.session import MeasureSession

SHAPES = [(16384, 768), (16384, 4096), (8192, 8192)]
CE_CONFIGS = [(32768, 32), (16384, 16), (65536, 32)]
CE_GRIDS = ["rows", "1/sm", "2/sm", "4/sm"]
CE_HINTS = [(0, 0, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1), (1, 0, 1)]
DEV = torch.device("cuda")


def step_ms(fn, steps: int = 20, repeats: int = 5) -> float:
    return summarize(MeasureSession(DEV).window_times(fn, warmup=5, steps=steps, repeats=repeats))[0]


def host_us(fn, n: int = 30) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def kernel_profile(fn, n: int = 10) -> tuple[float, dict[str, tuple[int, float]]]:
    """(kernel µs per step, {kernel name: (calls per step, mean µs)})."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    total = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            t = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
            per[evt.name][0] += 1
            per[evt.name][1] += t
            total += t
    return total / n, {k: (c // n, t / c) for k, (c, t) in per.items()}


def norm_case(op: str, M: int, N: int) -> None:
    rms = op == "rms"
    xs = [torch.randn(M, N, device=DEV, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    dys = [torch.randn(M, N, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    w = (1 + 0.1 * torch.randn(N, device=DEV)).bfloat16().requires_grad_()
    b = None if rms else (0.1 * torch.randn(N, device=DEV)).bfloat16().requires_grad_()
    params = [w] + ([b] if b is not None else [])
    fns = {
        "eager": (lambda x: F.rms_norm(x, (N,), w, 1e-6)) if rms else (lambda x: F.layer_norm(x, (N,), w, b, 1e-5)),
        "speedkit": (lambda x: sk.rms_norm(x, w, 1e-6)) if rms else (lambda x: sk.layer_norm(x, w, b, 1e-5)),
    }
    nbytes = 5 * M * N * 2
    print(f"== {op} {M}x{N}: bwd config {norms._bwd_config(N, M, DEV, rms)} fwd config {norms._fwd_config(N)}", flush=True)
    for name, fn in fns.items():
        counter = itertools.count()

        def fwd_bwd(fn=fn) -> None:
            i = next(counter) % 3
            x = xs[i]
            x.grad = None
            for p in params:
                p.grad = None
            fn(x).backward(dys[i])

        ms = step_ms(fwd_bwd)
        h = host_us(fwd_bwd)
        gpu, kernels = kernel_profile(fwd_bwd)
        print(
            f"  {name:9s} step {ms * 1e3:7.1f} us ({nbytes / ms / 1e9:.2f} TB/s) | gpu {gpu:7.1f} us "
            f"({nbytes / gpu / 1e6:.2f} TB/s) | host {h:6.1f} us",
            flush=True,
        )
        for k, (calls, us) in sorted(kernels.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            print(f"      {calls} x {us:7.1f} us  {k[:110]}")
    # the launchers alone
    saved = [norms.norm_forward(x.detach(), w.detach(), None if b is None else b.detach(), 1e-5, rms) for x in xs]
    counter = itertools.count()

    def launch_fwd() -> None:
        i = next(counter) % 3
        norms.norm_forward(xs[i].detach(), w.detach(), None if b is None else b.detach(), 1e-5, rms)

    def launch_bwd() -> None:
        i = next(counter) % 3
        norms.norm_backward(dys[i], xs[i].detach(), w.detach(), saved[i][1], saved[i][2], rms, b is not None)

    f_ms, b_ms = step_ms(launch_fwd), step_ms(launch_bwd)
    gpu_b, kernels_b = kernel_profile(launch_bwd)
    print(
        f"  launchers fwd {f_ms * 1e3:6.1f} us + bwd {b_ms * 1e3:6.1f} us = {nbytes / (f_ms + b_ms) / 1e9:.2f} TB/s | "
        f"bwd gpu {gpu_b:.1f} us host fwd {host_us(launch_fwd):.1f} us bwd {host_us(launch_bwd):.1f} us",
        flush=True,
    )


# -- cross-entropy forward variants ------------------------------------------------------------------------


@triton.jit
def _ce_variant(
    LOGITS,
    TARGET,
    GRAD,
    LOSS,
    stride_l,
    stride_g,
    M,
    V,
    scale,
    EV1: tl.constexpr,
    EV2: tl.constexpr,
    CS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK)
    for r in range(pid, M, nprog):
        row = tl.cast(r, tl.int64)
        target = tl.load(TARGET + row).to(tl.int64)
        x_row = LOGITS + row * stride_l
        g_row = GRAD + row * stride_g
        m = float("-inf")
        s = 0.0
        for start in range(0, V, BLOCK):
            cols = start + cols0
            ok = cols < V
            if EV1:
                x = tl.load(x_row + cols, mask=ok, other=float("-inf"), eviction_policy="evict_last").to(tl.float32)
            else:
                x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        x_t = tl.load(x_row + target).to(tl.float32)
        tl.store(LOSS + row, lse - x_t)
        n_chunks = tl.cdiv(V, BLOCK)
        for i in range(n_chunks):
            cols = (n_chunks - 1 - i) * BLOCK + cols0
            ok = cols < V
            if EV2:
                x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(cols == target, g - 1.0, g) * scale
            if CS:
                tl.store(g_row + cols, g.to(GRAD.dtype.element_ty), mask=ok, cache_modifier=".cs")
            else:
                tl.store(g_row + cols, g.to(GRAD.dtype.element_ty), mask=ok)


def ce_variants() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M, V in ((16384, 50304), (8192, 128256)):
        logits = [torch.randn(M, V, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
        targets = [torch.randint(0, V, (M,), device=DEV) for _ in range(3)]
        grad = torch.empty_like(logits[0])
        loss = torch.empty(M, device=DEV)
        floor = 2 * M * V * 2
        counter = itertools.count()

        def cur():
            return sk.cross_entropy(logits[next(counter) % 3], targets[0])  # noqa: F821 (deleted below, after its last call)

        with torch.no_grad():
            print(f"== ce {M}x{V}: speedkit forward now {step_ms(cur):.3f} ms", flush=True)
        ref = F.cross_entropy(logits[0].float(), targets[0], reduction="none")
        results = []
        for block, warps in CE_CONFIGS:
            grids = {"rows": M, "1/sm": sms, "2/sm": 2 * sms, "4/sm": 4 * sms}
            for grid_name, grid in ((g, grids[g]) for g in CE_GRIDS):
                for ev1, ev2, cs in CE_HINTS:
                    if grid_name == "4/sm" and warps * 4 > 64:
                        continue

                    def run(block=block, warps=warps, grid=grid, ev1=ev1, ev2=ev2, cs=cs) -> None:
                        i = next(counter) % 3
                        _ce_variant[(grid,)](
                            logits[i],  # noqa: F821 (deleted below, after its last call)
                            targets[i],
                            grad,  # noqa: F821
                            loss,
                            V,
                            V,
                            M,
                            V,
                            1.0 / M,  # noqa: F821 (deleted below, after the closure last runs)
                            EV1=bool(ev1),
                            EV2=bool(ev2),
                            CS=bool(cs),
                            BLOCK=block,
                            num_warps=warps,
                        )

                    try:
                        _ce_variant[(grid,)](
                            logits[0],
                            targets[0],
                            grad,
                            loss,
                            V,
                            V,
                            M,
                            V,
                            1.0 / M,
                            EV1=bool(ev1),
                            EV2=bool(ev2),
                            CS=bool(cs),
                            BLOCK=block,
                            num_warps=warps,
                        )
                        err = (loss - ref).abs().max().item()
                        ms = step_ms(run, steps=10, repeats=5)
                    except Exception as exc:  # noqa: BLE001
                        print(
                            f"  block {block} warps {warps} {grid_name} ev {ev1}{ev2} cs {cs}: {type(exc).__name__} {str(exc)[:100]}"
                        )
                        continue
                    results.append((ms, block, warps, grid_name, ev1, ev2, cs, err))
                    print(
                        f"  {ms:.3f} ms ({floor / ms / 1e9:.2f} TB/s of floor) block {block} warps {warps} grid {grid_name} "
                        f"evict {ev1}{ev2} cs {cs} | max loss err {err:.1e}",
                        flush=True,
                    )
        results.sort()
        print("  best:", results[:5], flush=True)
        del logits, grad
        torch.cuda.empty_cache()


def sweep_bwd() -> None:
    """GPU time (profiler) of the norm backward launcher under candidate configurations."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [("ln", 16384, 4096), ("ln", 8192, 8192), ("rms", 16384, 4096), ("ln", 16384, 768)]
    for op, M, N in cases:
        rms = op == "rms"
        xs = [torch.randn(M, N, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
        dys = [torch.randn(M, N, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
        w = torch.randn(N, device=DEV, dtype=torch.bfloat16)
        b = None if rms else torch.randn(N, device=DEV, dtype=torch.bfloat16)
        saved = [norms.norm_forward(x, w, b, 1e-5, rms) for x in xs]
        bn = norms.next_power_of_2(N)
        default_cfg, default_pb = norms._bwd_config, norms._partials_block
        rows = []
        try:
            for bm, warps, per_sm in (
                (1, 4, 4),
                (1, 8, 2),
                (2, 4, 2),
                (2, 8, 2),
                (2, 8, 1),
                (4, 8, 2),
                (4, 16, 1),
                (1, 16, 2),
                (2, 16, 1),
            ):
                if bm * bn > 16384 or warps * per_sm > 64 or (N <= 1024 and bm == 1 and warps > 8):
                    continue
                for pb in (16, 32, 64):
                    norms._bwd_config = lambda n, m, d, r=False, bm=bm, wp=warps, p=per_sm: (
                        bm,
                        bn,
                        wp,
                        min(-(-m // bm), sms * p),
                    )
                    norms._partials_block = lambda n, d, pb=pb: pb
                    counter = itertools.count()

                    def run() -> None:
                        i = next(counter) % 3
                        norms.norm_backward(dys[i], xs[i], w, saved[i][1], saved[i][2], rms, b is not None)

                    try:
                        gpu, kernels = kernel_profile(run)
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {op} {M}x{N} bm {bm} warps {warps} per_sm {per_sm}: {type(exc).__name__}")
                        break
                    part = sum(us * c for k, (c, us) in kernels.items() if "partials" in k)
                    rows.append((gpu, bm, warps, per_sm, pb, part))
        finally:
            norms._bwd_config, norms._partials_block = default_cfg, default_pb
        rows.sort()
        cur = norms._bwd_config(N, M, DEV, rms)
        print(
            f"== {op} {M}x{N} bwd gpu us (default {cur[0]}, {cur[2]} warps, {cur[3]} programs, partials block "
            f"{norms._partials_block(N, DEV)}):",
            flush=True,
        )
        for r in rows[:8]:
            print(f"  {r[0]:7.1f} us  bm {r[1]} warps {r[2]} per_sm {r[3]} partials block {r[4]} (partials {r[5]:.1f} us)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="ln,rms")
    parser.add_argument("--shapes", default=None)
    parser.add_argument("--ce", action="store_true")
    parser.add_argument("--host", action="store_true", help="only the host-overhead breakdown")
    parser.add_argument("--sweep", action="store_true", help="only a sweep of the norm backward's launch configuration")
    parser.add_argument("--ce-configs", default=None, help="BLOCKxWARPS,... e.g. 16384x16,8192x8")
    parser.add_argument("--ce-grids", default=None, help="subset of rows,1/sm,2/sm,4/sm")
    parser.add_argument("--ce-hints", default=None, help="evict-last,evict-first,streaming-store triples, e.g. 111,000")
    args = parser.parse_args()
    global CE_CONFIGS, CE_GRIDS, CE_HINTS
    if args.ce_configs:
        CE_CONFIGS = [tuple(int(v) for v in c.split("x")) for c in args.ce_configs.split(",")]
    if args.ce_grids:
        CE_GRIDS = args.ce_grids.split(",")
    if args.ce_hints:
        CE_HINTS = [tuple(int(c) for c in h) for h in args.ce_hints.split(",")]
    if args.host:
        host_breakdown()
        return
    if args.sweep:
        sweep_bwd()
        return
    wanted = {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")} if args.shapes else None
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    for op in [o for o in args.ops.split(",") if o]:
        for M, N in SHAPES:
            if wanted is None or (M, N) in wanted:
                norm_case(op, M, N)
    if args.ce:
        ce_variants()


# -- host overhead, piece by piece ----------------------------------------------------------------------


def host_breakdown() -> None:
    """µs the host spends on each piece of speedkit's LayerNorm forward+backward (16384×4096 bf16)."""
    import inspect

    M, N = 16384, 4096
    x = torch.randn(M, N, device=DEV, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    w = torch.ones(N, device=DEV, dtype=torch.bfloat16).requires_grad_()
    b = torch.zeros(N, device=DEV, dtype=torch.bfloat16).requires_grad_()
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    y, mean, rstd = norms.norm_forward(xd, wd, bd, 1e-5, False)
    bm, bn, warps = norms._fwd_config(N)
    grid = (triton.cdiv(M, bm),)

    def launch():
        return norm_kernels._norm_fwd_kernel[grid](
            xd,
            wd,
            bd,
            y,
            mean,
            rstd,
            N,
            N,
            M,
            N,
            1e-5,
            IS_RMS=False,
            HAS_W=True,
            HAS_B=True,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=warps,
        )

    compiled = launch()
    kc, kkc, target, backend, binder = norm_kernels._norm_fwd_kernel.device_caches[torch.cuda.current_device()]
    args = (xd, wd, bd, y, mean, rstd, N, N, M, N, 1e-5)
    consts = {"IS_RMS": False, "HAS_W": True, "HAS_B": True, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps}
    all_args = args + (False, True, True, bm, bn)
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *all_args)

    pieces = {
        "torch.empty_like(x)": lambda: torch.empty_like(xd),
        "torch.empty((2, M)) fp32": lambda: torch.empty((2, M), dtype=torch.float32, device=DEV),
        "triton fwd launch fn[grid](...)": launch,
        "  its binder(*args, **constexprs)": lambda: binder(*args, **consts),
        "  compiled.run(...) direct": direct,
        "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
        "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "norm_forward (launcher)": lambda: norms.norm_forward(xd, wd, bd, 1e-5, False),
        "norm_backward (launcher)": lambda: norms.norm_backward(dy, xd, wd, mean, rstd, False, True),
        "sk.layer_norm no_grad": lambda: sk.layer_norm(xd, wd, bd),
        "sk.layer_norm with grad (fwd only)": lambda: sk.layer_norm(x, w, b),
        "F.layer_norm with grad (fwd only)": lambda: F.layer_norm(x, (N,), w, b),
    }
    for name, fn in pieces.items():
        fn()
        print(f"  host {host_us(fn, 200):7.1f} us  {name}", flush=True)
    for name, f in (("sk", lambda: sk.layer_norm(x, w, b)), ("eager", lambda: F.layer_norm(x, (N,), w, b))):
        ys = [f() for _ in range(30)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for yy in ys:
            yy.backward(dy)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"  host {(t1 - t0) / 30 * 1e6:7.1f} us  {name} y.backward(dy) alone", flush=True)
        x.grad = w.grad = b.grad = None
    print("  knobs launch hooks:", triton.knobs.runtime.launch_enter_hook if hasattr(triton, "knobs") else "n/a")
    from triton.compiler import compiler as tc

    print(inspect.getsource(tc.CompiledKernel.__getitem__))
    src = inspect.getsource(type(norm_kernels._norm_fwd_kernel).run)
    print(src[:4000])


if __name__ == "__main__":
    main()
