"""The naive GPT-2 ladder, side by side in one process on one GPU (ANCHORS.md, main benchmark).

Variants:
  hand/*       the ladder of ANCHORS.md applied by hand, step by step, in a plain training loop
  speedkit     `speedkit optimize recipes/gpt2-small-naive.yaml` (the CLI's own code path), per rung
  lightning/*  Lightning's own switches: precision="32-true"; precision="bf16-mixed" + torch.compile + TF32
  speedkit-fit the kept rungs through Lightning (`speedkit fit optimized.yaml`, SpeedLadder callback)

The Lightning rows and speedkit-fit are timed the same way (StepTimer callback on speedkit's
measurement session: CUDA events after each step, one wait per window, median of windows), so they
compare like for like. The ladder itself now runs inside the recipe's Trainer (the user's step, its
per-step logging included) and ends by timing the fit's own steps: those go out as bench "holds".

Usage: python bench/ladder_gpt2.py [--parts hand,speedkit,lightning|fit] [--out runs/bench]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results, gemm_ceiling_tflops  # noqa: E402
from speedkit.data.batch import move_to_device  # noqa: E402
from speedkit.demos import NaiveGPT, SyntheticTokens  # noqa: E402
from speedkit.measure import count_step_flops  # noqa: E402
from speedkit.measure.session import MeasureSession  # noqa: E402
from speedkit.training.step import PlainStep  # noqa: E402

RECIPE = REPO / "recipes" / "gpt2-small-naive.yaml"
BATCH, SEQ, VOCAB = 16, 1024, 50304
WARMUP, STEPS, REPEATS = 3, 10, 5


def _record(
    res: Results, variant: str, step_ms: float, spread: float, flops: int, ceiling: float, peak_bytes: int | None
) -> None:
    tokens = BATCH * SEQ
    res.add(variant, "tokens_per_s", tokens / (step_ms / 1e3), "tokens/s")
    res.add(variant, "step_ms", step_ms, "ms", noise=spread)
    res.add(variant, "mfu", flops / (step_ms / 1e3) / 1e12 / ceiling, "fraction of measured bf16 GEMM ceiling")
    if peak_bytes is not None:
        res.add(variant, "peak_memory_gb", peak_bytes / 1e9, "GB")
    print(
        f"{variant:32s} {tokens / (step_ms / 1e3):>12,.0f} tok/s  {step_ms:8.1f} ms ±{spread:5.1%}  "
        f"MFU {flops / (step_ms / 1e3) / 1e12 / ceiling:6.1%}  peak {peak_bytes / 1e9 if peak_bytes else float('nan'):5.1f} GB",
        flush=True,
    )


def hand_ladder(res: Results, flops: int, ceiling: float) -> None:
    """ANCHORS.md's hand ladder: each step adds one change to the previous, applied by hand."""
    loader = SyntheticTokens(batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB, length=BATCH * 4096).train_dataloader()
    steps = [
        ("hand/eager-fp32", {}),
        ("hand/+tf32", {"tf32": True}),
        ("hand/+bf16-autocast", {"tf32": True, "bf16": True}),
        ("hand/+sdpa", {"tf32": True, "bf16": True, "sdpa": True}),
        ("hand/+fused-adamw", {"tf32": True, "bf16": True, "sdpa": True, "fused": True}),
        ("hand/+compile", {"tf32": True, "bf16": True, "sdpa": True, "fused": True, "compile": True}),
    ]
    for variant, cfg in steps:
        torch.manual_seed(0)
        torch.set_float32_matmul_precision("high" if cfg.get("tf32") else "highest")
        model = NaiveGPT("small", attention="sdpa" if cfg.get("sdpa") else "naive").cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cfg.get("fused", None))
        fwd = torch.compile(model) if cfg.get("compile") else model
        it = iter(loader)

        def step() -> None:
            idx, tgt = move_to_device(next(it), torch.device("cuda"))
            with torch.autocast("cuda", torch.bfloat16) if cfg.get("bf16") else contextlib.nullcontext():
                loss = fwd(idx, tgt)  # noqa: F821 (deleted below, after the closure last runs)
            loss.backward()
            opt.step()  # noqa: F821 (deleted below, after the closure last runs)
            opt.zero_grad(set_to_none=True)  # noqa: F821 (deleted below, after the closure last runs)

        m = MeasureSession(torch.device("cuda")).measure(lambda: step(), warmup=WARMUP, steps=STEPS, repeats=REPEATS)
        _record(res, variant, m.step_ms, m.spread, flops, ceiling, m.peak_memory_bytes)
        del model, opt, fwd
        torch.cuda.empty_cache()
    torch.set_float32_matmul_precision("highest")


def speedkit_ladder(res: Results, flops: int, ceiling: float, out: Path) -> list:
    """`speedkit optimize` on the naive recipe, through the CLI entry point itself: the ladder inside
    the recipe's Lightning Trainer, then the fit's own steps timed with the final configuration."""
    import shutil

    from bench.common import RESULTS, gpu_slug
    from speedkit.frontend.cli import main
    from speedkit.report import load_report

    t0 = time.perf_counter()
    code = main(["optimize", str(RECIPE), "--out", str(out / "gpt2")])
    if code != 0:
        raise SystemExit(f"speedkit optimize failed with exit code {code}")
    report = load_report(out / "gpt2" / "report.json")
    shutil.copyfile(out / "gpt2" / "report.json", RESULTS / f"{res.date}_{gpu_slug()}_gpt2-small-naive_report.json")
    res.add("speedkit", "ladder_wall_s", time.perf_counter() - t0, "s")
    for rung in report["rungs"]:
        m = rung["measurement"]
        if m is None:
            res.add(f"speedkit/{rung['name']}", "status", None, rung["status"], reason=rung["reason"])
            continue
        c = rung.get("comparison") or {}
        _record(
            res, f"speedkit/{rung['name']}[{rung['status']}]", m["step_ms"], m["spread"], flops, ceiling, m["peak_memory_bytes"]
        )
        if c:
            res.add(
                f"speedkit/{rung['name']}[{rung['status']}]",
                "paired_speedup",
                c["speedup"],
                "x",
                ci=[c["low"], c["high"]],
                blocks=c["blocks"],
                verdict=c["verdict"],
            )
    kept = [{"name": r["name"], "options": r["options"]} for r in report["rungs"] if r["status"] == "kept"]
    final = (report.get("final_check") or {}).get("b") or next(
        r["measurement"] for r in reversed(report["rungs"]) if r["status"] in ("closing", "kept", "baseline")
    )
    _record(res, "speedkit", final["step_ms"], final["spread"], flops, ceiling, final["peak_memory_bytes"])
    holds = report.get("holds") or {}
    if holds.get("fit") and holds.get("ladder"):
        for variant in ("ladder", "fit"):
            m = holds[variant]
            res.add(
                variant,
                "step_ms",
                m["step_ms"],
                "ms",
                bench="holds",
                model="naive-gpt2",
                noise=m["spread"],
                data_wait_ms=m["data_wait_ms"],
                host_ms=m["host_ms"],
            )
        res.add(
            "fit",
            "gap",
            holds["gap"],
            "fraction",
            bench="holds",
            model="naive-gpt2",
            flagged=holds["flagged"],
            cause=holds["cause"],
        )
        print(
            f"holds: ladder {holds['ladder']['step_ms']:.2f} ms, fit {holds['fit']['step_ms']:.2f} ms ({holds['gap']:+.1%})",
            flush=True,
        )
    return kept


def lightning_runs(res: Results, flops: int, ceiling: float, kept: list, only_fit: bool = False) -> None:
    """Lightning's switches and speedkit's kept rungs, through the same Trainer loop and timer."""
    import lightning.pytorch as pl

    from speedkit.lightning import SpeedLadder, StepTimer

    def run(variant: str, precision: str, *, compile_model: bool = False, tf32: bool = False, callbacks=()) -> None:
        torch.manual_seed(0)
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        model = NaiveGPT("small")
        timer = StepTimer(warmup=WARMUP + 2, window=STEPS)
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            precision=precision,
            max_steps=WARMUP + 2 + STEPS * REPEATS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer, *callbacks],
        )
        torch.cuda.reset_peak_memory_stats()
        trainer.fit(
            torch.compile(model) if compile_model else model,
            datamodule=SyntheticTokens(batch_size=BATCH, seq_len=SEQ, vocab_size=VOCAB, length=BATCH * 4096),
        )
        _record(res, variant, timer.step_ms, timer.spread, flops, ceiling, timer.measurement.peak_memory_bytes)
        torch.set_float32_matmul_precision("highest")
        torch.cuda.empty_cache()

    variants = (
        []
        if only_fit
        else [
            ("lightning/32-true", "32-true", {}),
            ("lightning/bf16-mixed+compile+tf32", "bf16-mixed", {"compile_model": True, "tf32": True}),
        ]
    )
    if kept:
        variants.append(("speedkit-fit", "32-true", {"callbacks": [SpeedLadder(rungs=kept)]}))
        # what triton_layers adds on top of compile, through the same Trainer loop and timer
        without = [k for k in kept if (k if isinstance(k, str) else k["name"]) != "triton_layers"]
        if len(without) < len(kept):
            variants.append(("speedkit-fit/without-triton_layers", "32-true", {"callbacks": [SpeedLadder(rungs=without)]}))
    for variant, precision, kwargs in variants:
        try:
            run(variant, precision, **kwargs)
        except Exception as exc:  # a variant that breaks is a result too; the others still run
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
            res.add(variant, "status", None, "failed", reason=reason)
            print(f"{variant:32s} FAILED: {reason}", flush=True)
            torch.set_float32_matmul_precision("highest")
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="speedkit,lightning,hand")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--kept", default=None, help="comma-separated rungs for speedkit-fit when the speedkit part is skipped")
    parser.add_argument("--report", default=None, help="a report.json whose kept rungs (with options) speedkit-fit applies")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/ladder_gpt2.py needs a CUDA GPU")
    warnings.filterwarnings("ignore", message=r".*self\.trainer.*not registered.*")
    parts = args.parts.split(",")
    res = Results("ladder_gpt2", model="naive-gpt2")
    ceiling = gemm_ceiling_tflops()
    res.add("machine", "bf16_gemm_8192_tflops", ceiling, "TFLOP/s")
    torch.manual_seed(0)
    probe = NaiveGPT("small").cuda()
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    flops = count_step_flops(PlainStep(probe, None, "cuda"), (idx, idx))
    res.add("model", "flops_per_step", flops, "FLOP")
    del probe
    torch.cuda.empty_cache()
    print(f"{res.device}: bf16 GEMM ceiling {ceiling:.0f} TFLOP/s, {flops / 1e12:.2f} TFLOP per step", flush=True)

    kept: list = args.kept.split(",") if args.kept else []
    if args.report:
        from speedkit.report import load_report

        kept = [{"name": r["name"], "options": r["options"]} for r in load_report(args.report)["rungs"] if r["status"] == "kept"]
    if "speedkit" in parts:
        kept = speedkit_ladder(res, flops, ceiling, Path(args.out))
    if "lightning" in parts or "fit" in parts:  # "fit": only speedkit's kept rungs through Lightning
        lightning_runs(res, flops, ceiling, kept, only_fit="lightning" not in parts)
    if "hand" in parts:
        hand_ladder(res, flops, ceiling)

    print("\nsummary (tokens/s):")
    for variant in (
        "lightning/32-true",
        "lightning/bf16-mixed+compile+tf32",
        "speedkit",
        "speedkit-fit",
        "speedkit-fit/without-triton_layers",
        "hand/eager-fp32",
        "hand/+compile",
    ):
        v = res.value(variant, "tokens_per_s")
        if v:
            print(f"  {variant:36s} {v:>12,.0f}")
    anchor = res.value("lightning/bf16-mixed+compile+tf32", "tokens_per_s")
    for ours in ("speedkit", "speedkit-fit"):
        v = res.value(ours, "tokens_per_s")
        if v and anchor:
            res.add(ours, "ratio_vs_lightning_switches", v / anchor, "x")
            print(f"  {ours} / lightning switches = {v / anchor:.3f}x")
    print(f"results appended to {res.path}")


if __name__ == "__main__":
    main()
