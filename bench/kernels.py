"""speedkit's Triton kernels side by side with eager PyTorch, torch.compile and Liger Kernel, in one process.

Ops and shapes (bf16 inputs, the tables of ANCHORS.md):
  ln    LayerNorm (weight and bias)  16384×768, 16384×4096, 8192×8192
  rms   RMSNorm (weight)             16384×768, 16384×4096, 8192×8192
  ce    cross-entropy, mean          16384×50304, 8192×128256 (tokens × vocab, bf16 logits)

Variants:
  eager          F.layer_norm / F.rms_norm / F.cross_entropy on the bf16 tensors
  eager_float    (ce only) F.cross_entropy(logits.float(), target), the naive model's loss
  compile        torch.compile of the eager function (default mode, static shapes), compiled per shape
                 before timing; compile_float likewise for eager_float
  liger          Liger Kernel's autograd Functions (LigerLayerNormFunction, LigerRMSNormFunction with its
                 defaults: casting_mode "llama", in_place=True, LigerCrossEntropyFunction); skipped, with
                 the reason recorded, when liger_kernel does not import
  speedkit       speedkit.kernels.layer_norm / rms_norm / cross_entropy
  sk_compiled    the same inside torch.compile(fullgraph=True): speedkit's custom ops, as a compiled model
                 runs them (for ce: the lse-only forward and the gradient-from-lse backward)

Per variant and shape: one correctness check against eager fp32 on fresh random inputs (relative error
norm of the output and of every gradient < 2e-2), then median ms of the forward (no_grad) and of
forward+backward (a fresh graph per step: ``y.backward(dy)`` / ``loss.backward()``, the leaves' .grad
set to None first), and the peak memory beyond what was allocated before one forward+backward
(gradients included). Effective bandwidth counts the fewest bytes each op must move:
  norms  forward 2·M·N·2 B (read x, write y); forward+backward 5·M·N·2 B (x, y; x, dy, dx)
  ce     forward+backward 2·M·V·2 B (read the logits once, write their gradient once)
and ``floor`` is those bytes over the device-to-device copy bandwidth measured at start (1 GiB,
bytes read + written); ``of_floor`` = floor time / measured time.

Timing (METHOD.md): the speedkit step clock (CUDA events, one host wait per window) through
``MeasureSession.window_times``; warm-up first, then the median of several windows; every step takes the next of
``--sets`` (>= 3) pre-generated random input sets, so repeated steps do not run out of L2.
Liger's cross-entropy writes the gradient into its logits (and syncs with the host): it gets its own
logits sets, redrawn before each window (untimed), and each window uses each set once. Liger's
RMSNorm writes dx into dy: it gets its own dy copies.

Launch configurations are not swept: speedkit's launchers choose their own and take no config args.

Usage:
  python bench/kernels.py [--ops ln,rms,ce] [--shapes 16384x768,8192x128256] [--variants eager,speedkit]
                          [--quick] [--sets 3] [--out results.jsonl]
  TRITON_INTERPRET=1 python bench/kernels.py --device cpu --quick   # smoke test on tiny shapes
On the GPU machine, with the Liger wheel carried in .whl/:
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:. python3 bench/kernels.py --out $OUT/kernels.jsonl
Results go to bench/results/<date>_<gpu>.jsonl (``--device cpu``: a temporary directory) through
``bench.common.Results("kernels")``, with op and shape as extra fields. Exit status 1 when a speedkit
kernel fails its correctness check.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results  # noqa: E402
from speedkit.measure import summarize  # noqa: E402
from speedkit.measure.session import MeasureSession  # noqa: E402

SHAPES = {
    "ln": [(16384, 768), (16384, 4096), (8192, 8192)],
    "rms": [(16384, 768), (16384, 4096), (8192, 8192)],
    "ce": [(16384, 50304), (8192, 128256)],
}
# --device cpu: small enough for Triton's interpreter; the 5000-wide rows take the fused path with a
# wide block, the CE vocab of 5000 spans two 4096 chunks
CPU_SHAPES = {"ln": [(64, 96), (8, 5000)], "rms": [(64, 96), (8, 5000)], "ce": [(32, 1000), (8, 5000)]}
# ANCHORS.md targets: norms fwd+bwd effective TB/s (higher is better), CE fwd+bwd ms (lower is better)
TARGETS = {
    ("ln", (16384, 768)): 2.0,
    ("ln", (16384, 4096)): 3.0,
    ("ln", (8192, 8192)): 3.0,
    ("rms", (16384, 768)): 2.0,
    ("rms", (16384, 4096)): 3.0,
    ("rms", (8192, 8192)): 3.0,
    ("ce", (16384, 50304)): 1.3,
    ("ce", (8192, 128256)): 1.3,
}
VARIANTS = {
    "ln": ["eager", "compile", "liger", "speedkit", "sk_compiled"],
    "rms": ["eager", "compile", "liger", "speedkit", "sk_compiled"],
    "ce": ["eager", "eager_float", "compile", "compile_float", "liger", "speedkit", "sk_compiled"],
}
LN_EPS, RMS_EPS = 1e-5, 1e-6
TOL = 2e-2  # relative error norm for bf16 against eager fp32
DTYPE = torch.bfloat16


# -- helpers ---------------------------------------------------------------------------------------


def rel_err(actual: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """‖actual − ref‖ / ‖ref‖ in float64, in chunks (the CE gradients hold 10⁹ elements); inf for NaN/inf."""
    if actual is None or ref is None:
        return math.inf if (actual is None) != (ref is None) else 0.0
    a, r = actual.detach().reshape(-1), ref.detach().reshape(-1)
    if a.shape != r.shape:
        return math.inf
    num = den = 0.0
    chunk = 1 << 26
    for i in range(0, a.numel(), chunk):
        rc = r[i : i + chunk].double()
        num += (a[i : i + chunk].double() - rc).square().sum().item()
        den += rc.square().sum().item()
    if not math.isfinite(num):
        return math.inf
    return math.sqrt(num) / (math.sqrt(den) if den > 0 else 1.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read + written (median of ``repeats``)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = sorted(MeasureSession(device).window_times(lambda: dst.copy_(src), warmup=0, steps=1, repeats=repeats))  # noqa: F821 (deleted below, after the closure last runs)
    del src, dst
    free_memory()
    return 2 * nbytes / (times[len(times) // 2] / 1e3)


def measure(
    step: Callable[[], object],
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    repeats: int,
    refresh: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """(median ms per step, noise) over ``repeats`` windows of ``steps``; ``refresh`` runs untimed before each window."""
    if refresh is None:
        return summarize(MeasureSession(device).window_times(step, warmup=warmup, steps=steps, repeats=repeats))
    refresh()
    for _ in range(warmup):
        step()
    windows = []
    for _ in range(repeats):
        refresh()
        windows += MeasureSession(device).window_times(step, warmup=0, steps=steps, repeats=1)  # synchronizes before timing
    return summarize(windows)


def measure_graphed(
    step: Callable[[], object], device: torch.device, sets: int, *, warmup: int, steps: int, repeats: int
) -> tuple[float, float]:
    """(median ms per step, noise) with the host out of the way: ``sets`` steps (one per input set)
    captured in one CUDA graph, the graph replayed on the step clock, its time divided by ``sets``.

    The steps are warmed up on a side stream first (autograd, compiled code, allocator). Raises
    what capture raises for a step that cannot be captured (a host sync, say)."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(sets):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(sets):
            step()
    try:
        ms, noise = measure(graph.replay, device, warmup=warmup, steps=max(1, steps // sets), repeats=repeats)
    finally:
        del graph
        free_memory()
    return ms / sets, noise


def graph_note(exc: BaseException) -> str:
    return f"not capturable in a CUDA graph: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"


def peak_extra_bytes(step: Callable[[], object], clear: Callable[[], None], device: torch.device) -> int | None:
    """Peak allocated during one ``step`` beyond what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    clear()
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def load_liger() -> tuple[dict | None, str]:
    """Liger's autograd Functions, and its version or the reason it is unavailable."""
    try:
        from importlib.metadata import version

        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip, and say why
        return None, f"liger_kernel does not import: {type(exc).__name__}: {exc}"
    return {"ln": LigerLayerNormFunction, "rms": LigerRMSNormFunction, "ce": LigerCrossEntropyFunction}, version("liger-kernel")


# -- variants ----------------------------------------------------------------------------------------


def eager_fn(op: str, float_logits: bool = False) -> Callable:
    if op == "ln":
        return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS)
    if op == "rms":
        return lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, RMS_EPS)
    if float_logits:
        return lambda logits, target: F.cross_entropy(logits.float(), target)
    return lambda logits, target: F.cross_entropy(logits, target)


def make_variants(op: str, names: list[str], liger: dict | None, liger_note: str) -> dict[str, Callable | str]:
    """name -> function, or -> the reason the variant is skipped. Fresh compiled wrappers every call."""
    import speedkit.kernels as sk

    out: dict[str, Callable | str] = {}
    for name in names:
        if name == "eager":
            out[name] = eager_fn(op)
        elif name == "eager_float":
            out[name] = eager_fn(op, float_logits=True)
        elif name == "compile":
            out[name] = torch.compile(eager_fn(op), dynamic=False)
        elif name == "compile_float":
            out[name] = torch.compile(eager_fn(op, float_logits=True), dynamic=False)
        elif name == "liger":
            if liger is None:
                out[name] = liger_note
            elif op == "ln":
                out[name] = lambda x, w, b, f=liger["ln"]: f.apply(x, w, b, LN_EPS)
            elif op == "rms":
                out[name] = lambda x, w, b, f=liger["rms"]: f.apply(x, w, RMS_EPS)  # offset 0, "llama", in_place
            else:
                # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction) -> (loss, ...)
                out[name] = lambda logits, target, f=liger["ce"]: f.apply(logits, target, None, -100, 0.0, 0.0, "mean")[0]
        elif name == "sk_compiled":  # speedkit's custom ops inside a torch.compile'd function (what a compiled model runs)
            sk_fn = {
                "ln": lambda x, w, b: sk.layer_norm(x, w, b, LN_EPS),
                "rms": lambda x, w, b: sk.rms_norm(x, w, RMS_EPS),
                "ce": lambda logits, target: sk.cross_entropy(logits, target),
            }[op]
            out[name] = torch.compile(sk_fn, dynamic=False, fullgraph=True)
        elif name == "speedkit":
            if op == "ln":
                out[name] = lambda x, w, b: sk.layer_norm(x, w, b, LN_EPS)
            elif op == "rms":
                out[name] = lambda x, w, b: sk.rms_norm(x, w, RMS_EPS)
            else:
                out[name] = lambda logits, target: sk.cross_entropy(logits, target)
    return out


# -- one op × shape ------------------------------------------------------------------------------------


class Bench:
    def __init__(
        self, args: argparse.Namespace, device: torch.device, res: Results, copy_bps: float, liger: dict | None, liger_note: str
    ) -> None:
        self.args, self.device, self.res, self.copy_bps = args, device, res, copy_bps
        self.liger, self.liger_note = liger, liger_note
        self.summary: list[dict] = []  # one per op × shape: {"op", "shape", "variants": {name: {...}}}
        self.started = time.perf_counter()
        self.speedkit_failures: list[str] = []
        self.other_failures: list[str] = []
        quick = args.quick or device.type == "cpu"
        self.warmup = 2 if quick else 5
        self.steps = (2 if device.type == "cpu" else 6) if quick else 20
        self.repeats = 3 if quick else 7

    def add(self, variant: str, metric: str, value, unit: str, op: str, shape: str, **extra) -> None:
        self.res.add(variant, metric, value, unit, op=op, shape=shape, dtype="bf16", **extra)

    def randn(self, *shape: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device, dtype=torch.float32 if len(shape) == 1 else DTYPE)
        if scale != 1.0 or offset:
            t = t * scale + offset
        return t.to(DTYPE)

    def check(self, name: str, op: str, shape: str, errs: dict[str, float] | str) -> bool:
        """Record the correctness errors; True when every one is under TOL."""
        if isinstance(errs, str):
            ok, text = False, errs
            self.add(name, "correct", 0.0, "bool", op, shape, error=errs)
        else:
            ok = all(e < TOL for e in errs.values())
            text = " ".join(f"{k} {v:.1e}" for k, v in errs.items())
            self.add(
                name,
                "correct",
                1.0 if ok else 0.0,
                "bool",
                op,
                shape,
                tol=TOL,
                **{f"rel_err_{k}": (v if math.isfinite(v) else None) for k, v in errs.items()},
            )
        if not ok:
            line = f"CORRECTNESS FAIL {op} {shape} {name}: {text}"
            print(line, flush=True)
            (self.speedkit_failures if name in ("speedkit", "sk_compiled") else self.other_failures).append(line)
        return ok

    def graphed(self, step: Callable[[], object], clear: Callable[[], None]) -> tuple[float | None, float | None, str]:
        """(ms, noise, "") of ``step`` replayed from a CUDA graph, or (None, None, why not)."""
        if self.device.type != "cuda":
            return None, None, "CUDA graphs need a CUDA device"
        try:
            ms, noise = measure_graphed(
                step, self.device, self.args.sets, warmup=self.warmup, steps=self.steps * 3, repeats=self.repeats
            )
            return ms, noise, ""
        except Exception as exc:  # noqa: BLE001 - the variant cannot be captured: say why, go on
            torch.cuda.synchronize(self.device)
            return None, None, graph_note(exc)
        finally:
            clear()
            free_memory()

    # norms -------------------------------------------------------------------------------------------

    def run_norm(self, op: str, M: int, N: int) -> None:
        shape, dev = f"{M}x{N}", self.device
        torch.compiler.reset()  # compile once per shape: no recompiles or dynamic shapes carried across shapes
        variants = make_variants(op, self.variant_names(op), self.liger, self.liger_note)
        sets = self.args.sets
        xs = [self.randn(M, N).requires_grad_() for _ in range(sets)]
        dys = [self.randn(M, N) for _ in range(sets)]
        w = self.randn(N, scale=0.1, offset=1.0).requires_grad_()
        b = self.randn(N, scale=0.1).requires_grad_() if op == "ln" else None
        params = [w] + ([b] if b is not None else [])
        bytes_f, bytes_fb = 2 * M * N * 2, 5 * M * N * 2
        floor_fb_ms = bytes_fb / self.copy_bps * 1e3
        floor_f_ms = bytes_f / self.copy_bps * 1e3
        self.add("floor", "fwd_floor_ms", floor_f_ms, "ms", op, shape, bytes=bytes_f)
        self.add("floor", "fwdbwd_floor_ms", floor_fb_ms, "ms", op, shape, bytes=bytes_fb)
        ref = self.norm_reference(op, M, N, w, b)
        row = {"op": op, "shape": shape, "target": TARGETS.get((op, (M, N))), "floor_ms": floor_fb_ms, "variants": {}}
        self.summary.append(row)

        for name, fn in variants.items():
            if isinstance(fn, str):
                print(f"{op} {shape} {name}: skipped ({fn})", flush=True)
                self.add(name, "skipped", None, "", op, shape, reason=fn)
                continue
            try:
                errs = self.norm_errors(fn, ref, w, b)
            except Exception as exc:  # noqa: BLE001 - record and move on; speedkit's failure sets the exit code
                traceback.print_exc()
                errs = f"{type(exc).__name__}: {exc}"
            ok = self.check(name, op, shape, errs)
            if isinstance(errs, str):
                continue
            # Liger's RMSNorm writes dx into dy: its own copies keep the others' inputs intact
            my_dys = [d.clone() for d in dys] if name == "liger" else dys
            counter = itertools.count()

            def fwd(fn=fn) -> None:
                i = next(counter) % sets
                with torch.no_grad():
                    fn(xs[i].detach(), w.detach(), b.detach() if b is not None else None)  # noqa: F821 (deleted below, after the closure last runs)

            def clear() -> None:
                for t in xs + params:  # noqa: F821 (deleted below, after the closure last runs)
                    t.grad = None

            def fwd_bwd(fn=fn, my_dys=my_dys) -> None:
                i = next(counter) % sets
                x = xs[i]  # noqa: F821 (deleted below, after the closure last runs)
                x.grad = None
                for p in params:
                    p.grad = None
                fn(x, w, b).backward(my_dys[i])

            try:
                f_ms, f_noise = measure(fwd, dev, warmup=self.warmup, steps=self.steps, repeats=self.repeats)
                fb_ms, fb_noise = measure(fwd_bwd, dev, warmup=self.warmup, steps=self.steps, repeats=self.repeats)
                mem = peak_extra_bytes(fwd_bwd, clear, dev)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                self.check(name, op, shape, f"timing raised {type(exc).__name__}: {exc}")
                continue
            finally:
                clear()
            g_ms, g_noise, g_note = self.graphed(fwd_bwd, clear)
            f_tbs, fb_tbs = bytes_f / f_ms / 1e9, bytes_fb / fb_ms / 1e9
            g_tbs = bytes_fb / g_ms / 1e9 if g_ms else None
            if g_ms:
                self.add(name, "fwdbwd_graphed_ms", g_ms, "ms", op, shape, noise=g_noise)
                self.add(
                    name,
                    "fwdbwd_graphed_tbs",
                    g_tbs,
                    "TB/s",
                    op,
                    shape,
                    bytes=bytes_fb,
                    **({"target": row["target"]} if name == "speedkit" and row["target"] else {}),
                )
            else:
                self.add(name, "fwdbwd_graphed_ms", None, "ms", op, shape, reason=g_note)
            self.add(name, "fwd_ms", f_ms, "ms", op, shape, noise=f_noise)
            self.add(name, "fwd_tbs", f_tbs, "TB/s", op, shape, bytes=bytes_f)
            self.add(name, "fwdbwd_ms", fb_ms, "ms", op, shape, noise=fb_noise)
            self.add(
                name,
                "fwdbwd_tbs",
                fb_tbs,
                "TB/s",
                op,
                shape,
                bytes=bytes_fb,
                **({"target": row["target"]} if name == "speedkit" and row["target"] else {}),
            )
            self.add(name, "fwdbwd_of_floor", floor_fb_ms / fb_ms, "fraction", op, shape)
            self.add(name, "fwd_of_floor", floor_f_ms / f_ms, "fraction", op, shape)
            if mem is not None:
                self.add(name, "fwdbwd_peak_extra_gb", mem / 1e9, "GB", op, shape)
            row["variants"][name] = {
                "ok": ok,
                "fwd_ms": f_ms,
                "fb_ms": fb_ms,
                "fwd_tbs": f_tbs,
                "fb_tbs": fb_tbs,
                "mem": mem,
                "g_ms": g_ms,
                "g_tbs": g_tbs,
            }
            mem_text = f" +{mem / 1e9:.2f} GB" if mem is not None else ""
            g_text = f"{g_ms:8.4f} ms {g_tbs:5.2f} TB/s" if g_ms else "n/a"
            print(
                f"{op} {shape} {name:9s} fwd {f_ms:8.4f} ms {f_tbs:5.2f} TB/s | fwd+bwd {fb_ms:8.4f} ms "
                f"{fb_tbs:5.2f} TB/s ({floor_fb_ms / fb_ms:4.0%} of floor) | graphed {g_text}{mem_text}"
                f"{'' if ok else '  [WRONG]'}",
                flush=True,
            )
            del fwd, fwd_bwd, clear, my_dys
        del xs, dys, ref
        free_memory()

    def norm_reference(self, op: str, M: int, N: int, w: torch.Tensor, b: torch.Tensor | None) -> dict:
        """A fresh input, and the eager fp32 output and gradients for it."""
        x0, dy0 = self.randn(M, N), self.randn(M, N)
        xf = x0.float().requires_grad_()
        wf = w.detach().float().requires_grad_()
        bf = b.detach().float().requires_grad_() if b is not None else None
        fn = eager_fn(op)
        y = fn(xf, wf, bf)
        y.backward(dy0.float())
        return {"x": x0, "dy": dy0, "y": y.detach(), "dx": xf.grad, "dw": wf.grad, "db": bf.grad if bf is not None else None}

    def norm_errors(self, fn: Callable, ref: dict, w: torch.Tensor, b: torch.Tensor | None) -> dict[str, float]:
        with torch.no_grad():
            y_ng = fn(ref["x"], w.detach(), b.detach() if b is not None else None)
        x = ref["x"].clone().requires_grad_()
        wc = w.detach().clone().requires_grad_()
        bc = b.detach().clone().requires_grad_() if b is not None else None
        y = fn(x, wc, bc)
        y.backward(ref["dy"].clone())  # a copy: Liger writes into it
        errs = {
            "y_nograd": rel_err(y_ng, ref["y"]),
            "y": rel_err(y, ref["y"]),
            "dx": rel_err(x.grad, ref["dx"]),
            "dw": rel_err(wc.grad, ref["dw"]),
        }
        if b is not None:
            errs["db"] = rel_err(bc.grad, ref["db"])
        return errs

    # cross-entropy -------------------------------------------------------------------------------------

    def run_ce(self, M: int, V: int) -> None:
        op, shape, dev = "ce", f"{M}x{V}", self.device
        torch.compiler.reset()
        variants = make_variants(op, self.variant_names(op), self.liger, self.liger_note)
        sets = self.args.sets
        logits = [self.randn(M, V).requires_grad_() for _ in range(sets)]
        targets = [torch.randint(0, V, (M,), device=dev) for _ in range(sets)]
        bytes_fb = 2 * M * V * 2
        floor_ms = bytes_fb / self.copy_bps * 1e3
        grad_gb = M * V * 2 / 1e9
        self.add(
            "floor",
            "fwdbwd_floor_ms",
            floor_ms,
            "ms",
            op,
            shape,
            bytes=bytes_fb,
            note="read the logits once, write the gradient once",
        )
        ref = self.ce_reference(M, V)
        row = {
            "op": op,
            "shape": shape,
            "target": TARGETS.get((op, (M, V))),
            "floor_ms": floor_ms,
            "variants": {},
            "grad_gb": grad_gb,
        }
        self.summary.append(row)

        for name, fn in variants.items():
            if isinstance(fn, str):
                print(f"{op} {shape} {name}: skipped ({fn})", flush=True)
                self.add(name, "skipped", None, "", op, shape, reason=fn)
                continue
            try:
                errs = self.ce_errors(fn, ref)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                errs = f"{type(exc).__name__}: {exc}"
            ok = self.check(name, op, shape, errs)
            if isinstance(errs, str):
                continue
            in_place = name == "liger"  # writes the gradient into its logits: its own sets, redrawn per window
            my_logits = [torch.empty_like(t).requires_grad_() for t in logits] if in_place else logits
            counter = itertools.count()

            def refresh(my_logits=my_logits) -> None:
                with torch.no_grad():
                    for t in my_logits:
                        t.normal_()

            def fwd(fn=fn, my_logits=my_logits) -> None:
                i = next(counter) % sets
                with torch.no_grad():
                    fn(my_logits[i].detach(), targets[i])  # detached: Liger writes no gradient  # noqa: F821 (deleted below, after the closure last runs)

            def clear(my_logits=my_logits) -> None:
                for t in my_logits:
                    t.grad = None

            def fwd_bwd(fn=fn, my_logits=my_logits) -> None:
                i = next(counter) % sets
                t = my_logits[i]
                t.grad = None
                fn(t, targets[i]).backward()  # noqa: F821 (deleted below, after the closure last runs)

            try:
                if in_place:
                    refresh()
                f_ms, f_noise = measure(fwd, dev, warmup=self.warmup, steps=self.steps, repeats=self.repeats)
                if in_place:
                    fb_ms, fb_noise = measure(
                        fwd_bwd,
                        dev,
                        warmup=self.warmup,
                        steps=sets,
                        repeats=max(self.repeats, self.steps * self.repeats // sets),
                        refresh=refresh,
                    )
                else:
                    fb_ms, fb_noise = measure(fwd_bwd, dev, warmup=self.warmup, steps=self.steps, repeats=self.repeats)
                mem = peak_extra_bytes(fwd_bwd, clear, dev)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                self.check(name, op, shape, f"timing raised {type(exc).__name__}: {exc}")
                continue
            finally:
                clear()
            g_ms, g_noise, g_note = (
                self.graphed(fwd_bwd, clear)
                if not in_place
                else (None, None, "writes its gradient into the logits and syncs with the host (.item())")
            )
            if g_ms:
                self.add(
                    name,
                    "fwdbwd_graphed_ms",
                    g_ms,
                    "ms",
                    op,
                    shape,
                    noise=g_noise,
                    **({"target": row["target"]} if name == "speedkit" and row["target"] else {}),
                )
            else:
                self.add(name, "fwdbwd_graphed_ms", None, "ms", op, shape, reason=g_note)
            fb_tbs = bytes_fb / fb_ms / 1e9
            self.add(name, "fwd_ms", f_ms, "ms", op, shape, noise=f_noise)
            self.add(
                name,
                "fwdbwd_ms",
                fb_ms,
                "ms",
                op,
                shape,
                noise=fb_noise,
                **({"target": row["target"]} if name == "speedkit" and row["target"] else {}),
            )
            self.add(name, "fwdbwd_tbs", fb_tbs, "TB/s", op, shape, bytes=bytes_fb)
            self.add(name, "fwdbwd_of_floor", floor_ms / fb_ms, "fraction", op, shape)
            if mem is not None:
                self.add(name, "fwdbwd_peak_extra_gb", mem / 1e9, "GB", op, shape, gradient_gb=grad_gb)
            row["variants"][name] = {"ok": ok, "fwd_ms": f_ms, "fb_ms": fb_ms, "fb_tbs": fb_tbs, "mem": mem, "g_ms": g_ms}
            mem_text = f" +{mem / 1e9:.2f} GB" if mem is not None else ""
            g_text = f"{g_ms:8.3f} ms" if g_ms else "n/a"
            print(
                f"{op} {shape} {name:13s} fwd {f_ms:8.3f} ms | fwd+bwd {fb_ms:8.3f} ms {fb_tbs:5.2f} TB/s "
                f"({floor_ms / fb_ms:4.0%} of floor) | graphed {g_text}{mem_text}{'' if ok else '  [WRONG]'}",
                flush=True,
            )
            del fwd, fwd_bwd, refresh, clear, my_logits  # the closures hold Liger's own logits sets
            free_memory()
        del logits, targets, ref
        free_memory()

    def ce_reference(self, M: int, V: int) -> dict:
        logits0 = self.randn(M, V)
        target0 = torch.randint(0, V, (M,), device=self.device)
        lf = logits0.float().requires_grad_()
        loss = F.cross_entropy(lf, target0)
        loss.backward()
        ref = {"logits": logits0, "target": target0, "loss": loss.detach(), "grad": lf.grad}
        del lf
        free_memory()
        return ref

    def ce_errors(self, fn: Callable, ref: dict) -> dict[str, float]:
        with torch.no_grad():
            loss_ng = fn(ref["logits"], ref["target"])
        err_ng = rel_err(loss_ng.float(), ref["loss"])
        del loss_ng
        x = ref["logits"].clone().requires_grad_()
        loss = fn(x, ref["target"])
        loss.backward()
        errs = {"loss_nograd": err_ng, "loss": rel_err(loss.float(), ref["loss"]), "grad": rel_err(x.grad, ref["grad"])}
        del x, loss
        free_memory()
        return errs

    # ---------------------------------------------------------------------------------------------------

    def variant_names(self, op: str) -> list[str]:
        wanted = self.args.variants.split(",") if self.args.variants else None
        return [v for v in VARIANTS[op] if wanted is None or v in wanted]

    def run(self, op: str, M: int, N: int) -> None:
        print(f"== {op} {M}x{N} (t = {time.perf_counter() - self.started:.0f} s)", flush=True)
        if op == "ce":
            self.run_ce(M, N)
        else:
            self.run_norm(op, M, N)

    def table(self) -> None:
        names_all = ["eager", "eager_float", "compile", "compile_float", "liger", "speedkit", "sk_compiled"]
        sections = (
            ("forward+backward, a Python loop of steps (host overhead included)", "fb_tbs", "fb_ms", True),
            ("forward+backward replayed from a CUDA graph (kernel time, host out of the way)", "g_tbs", "g_ms", True),
            ("forward (no_grad)", "fwd_tbs", "fwd_ms", False),
        )
        for title, norm_key, time_key, has_target in sections:
            print(
                f"\n== {title}: norms effective TB/s (higher is better), ce ms (lower is better); "
                f"sk/best = best other variant's time / speedkit's =="
            )
            print(
                f"{'op':4s} {'shape':12s} "
                + " ".join(f"{n:>13s}" for n in names_all)
                + f" {'sk/best':>8s} {'target':>8s} {'floor':>9s}"
            )
            for row in self.summary:
                is_ce = row["op"] == "ce"
                key = time_key if is_ce else norm_key
                cells = []
                for n in names_all:
                    v = row["variants"].get(n)
                    if v is None or v.get(key) is None:
                        cells.append(f"{'-':>13s}")
                        continue
                    text = f"{v[key]:.3f}ms" if is_ce else f"{v[key]:.3g}"
                    if is_ce and time_key == "fb_ms" and v["mem"] is not None:
                        text += f"+{v['mem'] / 1e9:.1f}G"
                    cells.append(f"{text + ('' if v['ok'] else '!'):>13s}")
                sk = row["variants"].get("speedkit")
                others = [
                    v[time_key]
                    for n, v in row["variants"].items()
                    if n not in ("speedkit", "sk_compiled") and v["ok"] and v.get(time_key)
                ]
                ratio = f"{min(others) / sk[time_key]:.2f}x" if sk and sk.get(time_key) and others else "-"
                target, floor = "-", "-"
                if has_target:
                    if row["target"]:
                        target = f"<={row['target']}ms" if is_ce else f">={row['target']}"
                        if sk and sk.get(key):
                            met = sk[key] <= row["target"] if is_ce else sk[key] >= row["target"]
                            target += " ok" if met else " no"
                    floor = f"{row['floor_ms']:.3f}ms"
                print(f"{row['op']:4s} {row['shape']:12s} " + " ".join(cells) + f" {ratio:>8s} {target:>8s} {floor:>9s}")
        print(
            "('!' = failed the correctness check; '-' = not run or not capturable; ce cells of the first table: "
            "ms + peak extra GB, gradient included)"
        )


def parse_shapes(text: str | None) -> set[tuple[int, int]] | None:
    if not text:
        return None
    return {tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--ops", default="ln,rms,ce", help="comma-separated subset of ln,rms,ce")
    parser.add_argument("--shapes", default=None, help="comma-separated MxN subset, e.g. 16384x768,8192x128256")
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of eager,eager_float,compile,compile_float,liger,speedkit,sk_compiled",
    )
    parser.add_argument("--quick", action="store_true", help="fewer warm-up steps, steps and windows")
    parser.add_argument("--sets", type=int, default=3, help="random input sets rotated through (>= 3)")
    parser.add_argument("--out", type=Path, default=None, help="results file (default bench/results/<date>_<gpu>.jsonl)")
    args = parser.parse_args()
    if args.sets < 3:
        parser.error("--sets must be >= 3 (rotating fewer input sets measures the cache)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here; run with --device cpu --quick for a smoke test")
    if device.type == "cpu":
        # the kernels choose Triton's interpreter when they are defined: before speedkit.kernels is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1")
        out = args.out or Path(tempfile.gettempdir()) / "speedkit-bench" / f"{datetime.date.today().isoformat()}_cpu.jsonl"
        res = Results("kernels", out=out)
        res.device = "cpu"
    else:
        res = Results("kernels", out=args.out)
    ops = [o for o in args.ops.split(",") if o]
    for o in ops:
        if o not in SHAPES:
            parser.error(f"unknown op {o!r}; choose from ln, rms, ce")
    wanted = parse_shapes(args.shapes)
    table = SHAPES if device.type == "cuda" else CPU_SHAPES
    cases = [(o, s) for o in ops for s in table[o] if wanted is None or s in wanted]
    if not cases:
        parser.error("no op × shape left after --ops/--shapes")

    import triton

    import speedkit.kernels as sk

    reason = sk.kernels_available(device)
    if reason:
        raise SystemExit(f"speedkit's kernels cannot run here: {reason}")
    liger, liger_note = load_liger()
    torch.manual_seed(0)
    copy_bps = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    env = {"torch": torch.__version__, "triton": triton.__version__, "liger": liger_note if liger else None, "gpu": res.device}
    print(
        f"device {res.device} | torch {torch.__version__} | triton {triton.__version__} | "
        f"liger {liger_note} | d2d copy {copy_bps / 1e9:.0f} GB/s (read+written)",
        flush=True,
    )
    res.add("copy", "d2d_copy_gbs", copy_bps / 1e9, "GB/s", op="copy", shape="1GiB" if device.type == "cuda" else "16MiB", **env)
    if liger is None:
        print(f"liger skipped: {liger_note}", flush=True)

    bench = Bench(args, device, res, copy_bps, liger, liger_note)
    for op, (M, N) in cases:
        bench.run(op, M, N)
    bench.table()
    print(f"results appended to {res.path}")
    for line in bench.other_failures:
        print(line)
    if bench.speedkit_failures:
        print("SPEEDKIT FAILED CORRECTNESS:\n  " + "\n  ".join(bench.speedkit_failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
