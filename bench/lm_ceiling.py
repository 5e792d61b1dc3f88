"""Language models beyond the user's switches, against the peers, side by side (issue 72): per model, in
one process and in this order,

  switches  the user's own switches: Trainer(precision="bf16-mixed"), TF32 matmuls, ``torch.compile`` of
            the library model and its SDPA attention (bench/zoo_runs.py's "switches")
  speedkit  ``SpeedLadder()`` with its defaults and the cache off, in the fp32 Trainer
  liger     the switches with Liger-Kernel applied by hand first, as its README shows: Llama through
            ``apply_liger_kernel_to_llama(model=…)`` (RoPE, RMSNorm, SwiGLU and the fused linear
            cross-entropy); GPT-2, which Liger has no patch for, through ``LigerFusedLinearCrossEntropyLoss``
            over the backbone's hidden states (its forward rebound on the instance; the loss kept out of
            the compiled graph, where Dynamo failed on it). Liger patches
            transformers' classes for the rest of the process, so it runs last.

Models: ``gpt2`` (transformers' GPT-2 small, 16 × 1024 tokens: the zoo's hf-gpt2) and ``llama-1b``
(transformers' Llama at TinyLlama-1.1B's shape, 4 × 2048 tokens); ``--tiny`` makes both tiny on the CPU
(a smoke test: liger is skipped there, its kernels need CUDA).

Each variant is timed on the fit's own steady optimizer steps by wall clock (bench/zoo_runs.py's
``WallClockWindow``: ``--steps`` steps after ``--warmup``, once speedkit's trials and report are done);
the peak memory is the allocator's over that window. Rows (bench "lm_ceiling"): ``model``, ``variant``,
metric "throughput" (tokens/s), ``value``, ``unit``, ``peak_GB``, ``kept`` (speedkit), ``trials_s``,
``commit``, ``date``, ``device``, the window's fields; a variant that fails: metric "status".

Usage: PYTHONPATH=. python bench/lm_ceiling.py --commit C [--models gpt2,llama-1b] [--out $OUT]
       PYTHONPATH=. python bench/lm_ceiling.py --tiny        # CPU smoke test, rows to a temporary file
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import Results, commit  # noqa: E402
from bench.fsdp import SHAPES as LLAMA_SHAPES  # noqa: E402
from bench.zoo import compile_as_a_user_would, first_line, release, tf32_matmuls  # noqa: E402
from bench.zoo_runs import TINY_MEASURE, WallClockWindow, tiny_ladder  # noqa: E402
from speedkit.demos.zoo import ZOO, _HFCausalLM, token_loader  # noqa: E402
from speedkit.lightning import SpeedLadder  # noqa: E402

BENCH = "lm_ceiling"
VARIANTS = ("switches", "speedkit", "liger")


class PeakWindow(WallClockWindow):
    """The wall-clock window, with the allocator's peak over it (``peak_gb``)."""

    peak_gb: float | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        opened, closed = self.start is not None, self.elapsed is not None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if pl_module.device.type != "cuda":
            return
        if not opened and self.start is not None:
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        if not closed and self.elapsed is not None:
            self.peak_gb = torch.cuda.max_memory_allocated(pl_module.device) / 1e9


class TinyLlamaShape(_HFCausalLM):
    """transformers' ``LlamaForCausalLM`` at TinyLlama-1.1B's shape (bench/across_gpus.py's ``SHAPES``)."""

    def __init__(self, shape: str, attn_implementation: str | None = None) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        dims = LLAMA_SHAPES[shape]
        super().__init__(dims["vocab_size"], lr=3e-4)
        self.model = LlamaForCausalLM(LlamaConfig(**dims, attn_implementation=attn_implementation))


def build(name: str, tiny: bool, switches: bool) -> tuple[pl.LightningModule, Any]:
    """The model and its loader (the library's SDPA switch on for the switches and liger variants)."""
    if name == "gpt2":
        entry = ZOO["hf-gpt2"]
        return entry.build("tiny" if tiny else "full", **(entry.switches if switches else {}))
    module = TinyLlamaShape("tiny" if tiny else "1b", attn_implementation="sdpa" if switches else None)
    batch, seq = (2, 32) if tiny else (4, 2048)
    return module, token_loader(batch, seq, module.vocab_size)


def _liger_gpt2(lm: torch.nn.Module) -> None:
    """GPT-2's loss through Liger's fused linear cross-entropy, by hand (Liger has no GPT-2 patch)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    # outside the compiled graph, as a user does once compile fails on it: traced by Dynamo, Liger 0.8.5's loss
    # raised "unsupported operand type(s) for *: 'torch.dtype' and 'FakeTensor'" (H200, torch 2.11, d03f0c7)
    loss_fn = torch.compiler.disable(LigerFusedLinearCrossEntropyLoss())
    original = lm.forward

    def forward(self: Any, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if labels is None or not self.training:
            return original(input_ids=input_ids, labels=labels, **kwargs)
        hidden = self.transformer(input_ids, **kwargs)[0]
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        h = hidden.reshape(-1, hidden.shape[-1])
        loss = loss_fn(self.lm_head.weight, h.to(torch.bfloat16), shift.reshape(-1))
        return CausalLMOutputWithCrossAttentions(loss=loss)

    lm.forward = types.MethodType(forward, lm)


def apply_liger(name: str, module: pl.LightningModule) -> None:
    if name == "gpt2":
        _liger_gpt2(module.model)
    else:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=module.model)


def fit(name: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant's fit; its row's fields."""
    ladder = None
    if variant == "speedkit":
        if args.tiny:
            ladder = SpeedLadder(tiny_ladder(), trials=True, measure=TINY_MEASURE, cache=False)
        else:
            ladder = SpeedLadder(cache=False)
    module, loader = build(name, args.tiny, switches=variant != "speedkit")
    if variant == "liger":
        apply_liger(name, module)
    timer = PeakWindow(args.steps, args.warmup, "tokens", ladder)
    trainer = pl.Trainer(
        accelerator="cpu" if args.tiny else "gpu",
        devices=1,
        precision="32-true" if variant == "speedkit" else "bf16-mixed",
        max_steps=100_000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*([ladder] if ladder else []), timer],
    )
    if variant == "speedkit":
        trainer.fit(module, train_dataloaders=loader)
    else:
        with tf32_matmuls():
            trainer.fit(compile_as_a_user_would(module, "eager" if args.tiny else "inductor"), train_dataloaders=loader)
    figures = timer.figures()
    if figures is None:
        raise RuntimeError(f"the window did not end ({trainer.global_step} steps)")
    result = ladder.result if ladder is not None else None
    return {
        **figures,
        "peak_GB": round(timer.peak_gb, 3) if timer.peak_gb is not None else None,
        "kept": [r.name for r in result.kept] if result is not None else None,
        "trials_s": result.run.get("trials_s") if result is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama-1b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps timed (default 30; --tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the window (default 10; --tiny 1)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--results", default=None)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.tiny else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 10)
    variants = [v for v in args.variants.split(",") if not (args.tiny and v == "liger")]
    out = Path(args.results) if args.results else (Path(tempfile.mkdtemp()) / "lm_ceiling.jsonl" if args.tiny else None)
    res = Results(BENCH, out, commit=args.commit or commit())
    table = []
    for name in args.models.split(","):
        for variant in variants:
            try:
                fields = fit(name, variant, args)
                value = fields.pop("value")
                unit = fields.pop("unit")
                res.add(variant, "throughput", value, unit, model=name, **fields)
            except Exception as exc:  # a variant that fails is a row, and the others still run
                res.add(variant, "status", 0, f"failed: {first_line(exc)}", model=name)
            row = res.rows[-1]
            table.append(row)
            print(
                f"{name:10s} {variant:9s} {row['metric']:10s} {row['value']:>12.1f} {row['unit']}  "
                f"peak {row.get('peak_GB')} GB  kept {row.get('kept')}",
                flush=True,
            )
            release()
    for name in args.models.split(","):
        mine = [r for r in table if r["model"] == name and r["metric"] == "throughput"]
        base = next((r["value"] for r in mine if r["variant"] == "switches"), None)
        for r in mine:
            if base:
                print(f"{name:10s} {r['variant']:9s} {r['value'] / base:.3f}x the switches, peak {r.get('peak_GB')} GB")
    results = res.path
    print(f"rows appended to {results}")


if __name__ == "__main__":
    main()
