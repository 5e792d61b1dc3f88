"""Where the naive GPT-2 step's GPU time goes, per configuration. A diagnostic, not a benchmark of
record: it prints, and writes no results file (``bench/ladder_gpt2.py`` is the record).

For each configuration (rungs applied through ``speedkit.apply`` to the naive GPT-2 of
``recipes/gpt2-small-naive.yaml``, batch 16 x 1024):
  step      median ms per step on the step clock (CUDA events, one wait per window)
  kernels   the kernels' own time per step from a torch.profiler trace, by kind (GEMM, attention,
            Triton/Inductor, optimizer, copies, other), and the busy fraction of the step
Then SDPA's backends alone on the model's attention shape (16 x 12 x 1024 x 64, bf16, causal),
forward + backward.

Usage: python bench/profile_step.py [--configs compile,compile+ce,cudnn] [--no-sdpa] [--gemms]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speedkit
from speedkit.demos import NaiveGPT
from speedkit.measure.session import MeasureSession

DEV = torch.device("cuda")
BATCH, SEQ, VOCAB = 16, 1024, 50304
BASE = ["tf32", "autocast", "fused_optimizer", "sdpa"]
CE_ONLY = {
    "name": "triton_layers",
    "options": {"norms": False, "rms_like": False, "gelu": False, "swiglu": False, "gelu_mlp": False},
}
# the recipe's triton_layers: the fused loss and the MLP's GELU in cuBLASLt's epilogues
CE_MLP = {"name": "triton_layers", "options": {"norms": False, "rms_like": False, "gelu": False, "swiglu": False}}


def cdt(**inductor: object) -> dict:
    """The compile rung with Inductor's coordinate-descent tuning of its kernels, and ``inductor`` settings."""
    return {"name": "compile", "options": {"inductor": {"coordinate_descent_tuning": True, **inductor}}}


CDT = cdt()  # tunes Inductor's kernels
MA = {"name": "compile", "options": {"mode": "max-autotune-no-cudagraphs"}}  # + Triton GEMM templates, autotuned
CONFIGS = {
    "compile": BASE + ["compile"],
    "compile+ce": BASE + [CE_ONLY, "compile"],
    "compile+graph": BASE + ["compile", "cuda_graph"],
    "cudnn": BASE + ["compile"],  # SDPA restricted to cuDNN's attention
    "cudnn+ce+graph": BASE + [CE_ONLY, "compile", "cuda_graph"],
    "compile/cdt": BASE + [CDT],
    "compile+ce/cdt": BASE + [CE_ONLY, CDT],
    "compile/ma": BASE + [MA],
    "compile+ce/ma": BASE + [CE_ONLY, MA],
    "compile+graph/ma": BASE + [MA, "cuda_graph"],
    "compile+ce+graph/ma": BASE + [CE_ONLY, MA, "cuda_graph"],
    "recipe": BASE + [CE_ONLY, CDT, "cuda_graph"],  # the model rungs of recipes/gpt2-small-naive.yaml
    "recipe/cudnn": BASE + [CE_ONLY, CDT, "cuda_graph"],  # the same, SDPA restricted to cuDNN's attention
    "recipe/ma": BASE + [CE_ONLY, MA, "cuda_graph"],  # the recipe with max-autotune instead of coordinate descent
    # Programmatic dependent launch: each Inductor kernel may start while the one before drains
    "recipe/pdl": BASE + [CE_ONLY, cdt(**{"triton.enable_pdl": True}), "cuda_graph"],
    # Horizontal fusion of independent Inductor kernels (fewer launches)
    "recipe/combo": BASE + [CE_ONLY, cdt(combo_kernels=True), "cuda_graph"],
    "recipe/pdl+combo": BASE + [CE_ONLY, cdt(combo_kernels=True, **{"triton.enable_pdl": True}), "cuda_graph"],
    # Inductor's LayerNorm backward without mix-order reduction (its weight/bias sums apart)
    "recipe/nomix": BASE + [CE_ONLY, cdt(**{"triton.mix_order_reduction": False}), "cuda_graph"],
    # The same Inductor settings without coordinate-descent tuning (a compile in seconds, not minutes),
    # to compare them with one another quickly against "graph": the recipe untuned
    "graph": BASE + [CE_ONLY, "compile", "cuda_graph"],
    "graph/nomix": BASE
    + [CE_ONLY, {"name": "compile", "options": {"inductor": {"triton.mix_order_reduction": False}}}, "cuda_graph"],
    "graph/pdl": BASE + [CE_ONLY, {"name": "compile", "options": {"inductor": {"triton.enable_pdl": True}}}, "cuda_graph"],
    "graph/combo": BASE + [CE_ONLY, {"name": "compile", "options": {"inductor": {"combo_kernels": True}}}, "cuda_graph"],
    "graph/mlp": BASE + [CE_MLP, "compile", "cuda_graph"],  # + the MLP on cuBLASLt's epilogues
    "recipe/mlp": BASE + [CE_MLP, CDT, "cuda_graph"],
    # Inductor's mix-order LayerNorm backward with fewer, longer splits: its partial weight/bias sums
    # (one fp32 row per split) are summed by an aten.sum after the kernel, 2 per norm. H200, alternated
    # with graph/mlp (31.54, 31.59 ms): split32 31.69, split64 31.51/31.62, split128 31.48/31.63 ms: no gain
    **{
        f"graph/mlp/split{n}": BASE
        + [CE_MLP, {"name": "compile", "options": {"inductor": {"triton.mix_order_reduction_split_size": n}}}, "cuda_graph"]
        for n in (32, 64, 128)
    },
}
KINDS = [
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "sm90", "cutlass", "cublas")),
    ("optimizer", ("adam",)),
    ("copy", ("memcpy", "memset", "copy")),
    ("triton", ("triton", "speedkit")),
]


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def run_config(name: str, rungs: list, profile_steps: int = 5, top: int = 14, ops: bool = False) -> None:
    """Measure the step of configuration ``name`` and, unless ``profile_steps`` is 0, profile it."""
    torch.manual_seed(0)
    cudnn_only = "cudnn" in name
    torch.backends.cuda.enable_flash_sdp(not cudnn_only)
    torch.backends.cuda.enable_mem_efficient_sdp(not cudnn_only)
    torch.backends.cuda.enable_cudnn_sdp(True)
    model = NaiveGPT("small").to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    applied = speedkit.apply(model, opt, rungs=rungs, device=DEV, loss_fn=lambda m, b, i: m(*b))
    batches = [
        (torch.randint(0, VOCAB, (BATCH, SEQ), device=DEV), torch.randint(0, VOCAB, (BATCH, SEQ), device=DEV)) for _ in range(4)
    ]
    n = [0]

    def step() -> None:
        applied.step(batches[n[0] % 4], n[0])
        n[0] += 1

    t0 = time.perf_counter()
    for _ in range(3):  # compiles (and autotunes), captures: timed apart from the steps
        step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    session = MeasureSession(DEV)
    m = session.measure(step, warmup=5, steps=20, repeats=5)
    if not profile_steps:
        print(
            f"\n== {name}: applied {applied.applied}; skipped {applied.skipped}\n   step {m.step_ms:.2f} ms "
            f"({BATCH * SEQ / m.step_ms * 1e3:,.0f} tok/s), window spread {m.spread:.1%}; first 3 steps {first_s:.0f} s",
            flush=True,
        )
        applied.undo()
        return
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if ops else [])
    with torch.profiler.profile(activities=activities, record_shapes=ops) as prof:
        for _ in range(profile_steps):
            step()
        torch.cuda.synchronize()
    if ops:  # which host ops launch the kernels (a graph replay shows none: profile without cuda_graph)
        print(f"\n== {name}: host ops by their own device time per step (calls per step, input shapes)")
        rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.device_type == torch.autograd.DeviceType.CPU]
        for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:top]:
            print(
                f"     {e.self_device_time_total / profile_steps / 1e3:6.2f} ms {e.count / profile_steps:5.0f}x  "
                f"{e.key[:60]}  {str(e.input_shapes)[:90]}"
            )
    for e in prof.key_averages():
        t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_kind[kind(e.key)] += t / profile_steps / 1e3
        by_name[e.key] += t / profile_steps / 1e3
        calls[e.key] += e.count / profile_steps
    busy = sum(by_kind.values())
    print(f"\n== {name}: applied {applied.applied}; skipped {applied.skipped}", flush=True)
    print(
        f"   step {m.step_ms:.2f} ms ({BATCH * SEQ / m.step_ms * 1e3:,.0f} tok/s), kernels {busy:.2f} ms/step "
        f"({busy / m.step_ms:.0%} busy); first 3 steps (compile, tuning, capture) {first_s:.0f} s"
    )
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"   {k:10s} {v:7.2f} ms")
    for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"     {v:6.2f} ms {calls[k]:5.0f}x  {k[:110]}")
    applied.undo()


def sdpa_backends() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(BATCH, 12, SEQ, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    print("\n== SDPA alone, 16x12x1024x64 bf16 causal, forward + backward")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):

        def fb() -> None:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(g)

        try:
            ms = MeasureSession(DEV).window_times(fb, warmup=5, steps=20, repeats=5)
            print(f"   {backend.name:22s} {sorted(ms)[2]:.3f} ms  (x12 layers: {12 * sorted(ms)[2]:.2f} ms)")
        except Exception as e:  # noqa: BLE001 - a backend this build or GPU lacks
            print(f"   {backend.name:22s} unavailable: {str(e).splitlines()[0][:100]}")


def gemm_floor() -> None:
    """The step's GEMMs alone, bf16 on cuBLAS: forward, input gradient and weight gradient of each
    linear layer (x12 for the blocks), the language-model head, and their sum: the GEMM time no
    fusion elsewhere can take away."""
    tokens, d = BATCH * SEQ, 768
    layers = [("qkv", d, 3 * d, 12), ("proj", d, d, 12), ("fc", d, 4 * d, 12), ("fc2", 4 * d, d, 12), ("head", d, VOCAB, 1)]
    print("\n== GEMMs alone, bf16, tokens 16384: fwd / dgrad / wgrad ms (TFLOP/s)")
    total = 0.0
    for name, k, n, times in layers:
        x = torch.randn(tokens, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        gy = torch.randn(tokens, n, device=DEV, dtype=torch.bfloat16)
        flops = 2 * tokens * k * n
        parts = []
        for what, fn in (("fwd", lambda: x @ w.t()), ("dgrad", lambda: gy @ w), ("wgrad", lambda: gy.t() @ x)):
            ms = sorted(MeasureSession(DEV).window_times(fn, warmup=5, steps=20, repeats=5))[2]
            parts.append(f"{what} {ms:.3f} ({flops / ms / 1e9:.0f})")
            total += ms * times
        print(f"   {name:5s} {k}x{n} x{times}: " + ", ".join(parts))
    print(f"   all GEMMs of a step: {total:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--gemms", action="store_true", help="time the step's GEMM shapes alone (bf16, cuBLAS)")
    ap.add_argument("--ops", action="store_true", help="also list the host ops that launch the kernels")
    ap.add_argument("--top", type=int, default=14, help="kernels listed per configuration")
    ap.add_argument("--profile-steps", type=int, default=5, help="steps profiled per configuration (0: measure only)")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if not args.no_sdpa:
        sdpa_backends()
    if args.gemms:
        gemm_floor()
    for name in filter(None, args.configs.split(",")):
        try:
            run_config(name, CONFIGS[name], profile_steps=args.profile_steps, top=args.top, ops=args.ops)
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            print(f"\n== {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
