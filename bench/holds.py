"""Does the ladder's figure hold in training? ``speedkit optimize`` on models from public libraries.

For each model, ``speedkit optimize`` climbs the default ladder inside the model's own Lightning
Trainer (the engine of ``SpeedLadder()``), then times the fit's next real steps with the final
configuration on the same clock. The two figures should agree within 5%; where they do not, the
report says what the gap likely is (data wait, host time).

Rows: ``bench: "holds"``, ``model``, ``variant`` ``ladder`` / ``fit``, ``metric: "step_ms"``, plus
the gap, the kept rungs and the final throughput. Each model's report.json is kept beside the rows.

Usage: python bench/holds.py [--models naive-gpt2,hf-gpt2,timm-vit,tv-resnet50] [--tiny] [--out runs/holds]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import RESULTS, Results, gpu_slug  # noqa: E402

#: measurement for the bench: the defaults, with a shorter budget per comparison
MEASURE = {
    "warmup": 3,
    "steps": 10,
    "repeats": 5,
    "parity_steps": 3,
    "min_blocks": 3,
    "max_blocks": 8,
    "budget_s": 60.0,
    "holds_windows": 3,
}
TOKENS = {"synthetic": "tokens", "batch_size": 16, "seq_len": 1024, "vocab_size": 50304, "length": 65536}
IMAGES = {"class_path": "speedkit.demos.SyntheticImages", "init_args": {"batch_size": 64, "size": 224, "num_workers": 4}}


def recipes(tiny: bool) -> dict[str, dict[str, Any]]:
    """The models, as recipe mappings (``tiny``: CPU-sized, for a smoke test)."""
    import yaml

    from speedkit import config

    gpt2_ladder = yaml.safe_load((REPO / "recipes" / "gpt2-small-naive.yaml").read_text())["ladder"]
    tokens = {**TOKENS, "batch_size": 2, "seq_len": 64, "vocab_size": 512, "length": 256} if tiny else TOKENS
    images = {**IMAGES, "init_args": {"batch_size": 4, "size": 32, "num_workers": 2, "length": 256}} if tiny else IMAGES
    trainer = {"accelerator": "cpu" if tiny else "gpu", "devices": 1}
    ladder = config.default_ladder()
    size = "tiny" if tiny else "full"
    out = {
        "naive-gpt2": {
            "model": {"class_path": "speedkit.demos.NaiveGPT", "init_args": {"size": "tiny" if tiny else "small"}},
            "data": tokens,
            "ladder": gpt2_ladder,
        },
        "hf-gpt2": {
            "model": {"class_path": "speedkit.demos.zoo.HFGPT2", "init_args": {"size": size, "vocab_size": tokens["vocab_size"]}},
            "data": tokens,
            "ladder": ladder,
        },
        "timm-vit": {
            "model": {"class_path": "speedkit.demos.zoo.TimmViT", "init_args": {"size": size}},
            "data": images,
            "ladder": ladder,
        },
        "tv-resnet50": {
            "model": {"class_path": "speedkit.demos.zoo.TorchvisionResNet50", "init_args": {"size": size}},
            "data": images,
            "ladder": ladder,
        },
    }
    measure = {**MEASURE, "steps": 3, "repeats": 2, "warmup": 1, "max_blocks": 3, "holds_windows": 2} if tiny else MEASURE
    return {name: {**r, "trainer": trainer, "measure": measure, "seed": 0} for name, r in out.items()}


def run_model(name: str, raw: dict[str, Any], out: Path, res: Results) -> None:
    from speedkit.frontend.recipe import load_recipe
    from speedkit.frontend.runner import optimize

    recipe = load_recipe(raw)
    t0 = time.perf_counter()
    result, written = optimize(recipe, out / name, on_event=lambda line: print(f"  [{name}] {line}", flush=True))
    wall = time.perf_counter() - t0
    kept = [r.name for r in result.kept]
    holds = result.holds
    extra = {"model": name, "kept": kept}
    if holds is None or holds.fit is None or holds.ladder is None:
        res.add("fit", "status", None, "not measured", **extra, note=holds.note if holds else "no fit check")
        return
    res.add(
        "ladder",
        "step_ms",
        holds.ladder.step_ms,
        "ms",
        **extra,
        noise=holds.ladder.spread,
        data_wait_ms=holds.ladder.data_wait_ms,
        host_ms=holds.ladder.host_ms,
    )
    res.add(
        "fit",
        "step_ms",
        holds.fit.step_ms,
        "ms",
        **extra,
        noise=holds.fit.spread,
        data_wait_ms=holds.fit.data_wait_ms,
        host_ms=holds.fit.host_ms,
    )
    res.add("fit", "gap", holds.gap, "fraction", **extra, flagged=holds.flagged, cause=holds.cause)
    final = result.final_measurement
    res.add(
        "ladder",
        "throughput",
        final.throughput if final else None,
        final.throughput_unit if final else "",
        **extra,
        speedup_vs_baseline=result.to_dict()["summary"]["speedup"],
        ladder_wall_s=wall,
    )
    report = RESULTS / f"{res.date}_{gpu_slug()}_holds_{name}_report.json"
    shutil.copyfile(written["json"], report)
    print(
        f"{name:12s} ladder {holds.ladder.step_ms:8.2f} ms  fit {holds.fit.step_ms:8.2f} ms  gap {holds.gap:+6.1%}"
        f"{'  FLAGGED: ' + str(holds.cause) if holds.flagged else ''}  kept {', '.join(kept) or 'none'}  ({wall:.0f} s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="naive-gpt2,hf-gpt2,timm-vit,tv-resnet50")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models, for a smoke test (rows go to --results)")
    parser.add_argument("--out", default="runs/holds")
    parser.add_argument("--results", default=None, help="the JSON-lines file (default: bench/results/<date>_<gpu>.jsonl)")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench/holds.py needs a CUDA GPU (or --tiny)")
    warnings.filterwarnings("ignore", message=r".*self\.trainer.*not registered.*")
    res = Results("holds", out=Path(args.results) if args.results else None)
    all_recipes = recipes(args.tiny)
    for name in args.models.split(","):
        if name not in all_recipes:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(all_recipes)}")
        try:
            run_model(name, all_recipes[name], Path(args.out), res)
        except Exception as exc:  # a model that breaks is a result too; the others still run
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
            res.add("fit", "status", None, "failed", model=name, reason=reason)
            print(f"{name:12s} FAILED: {reason}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps([r for r in res.rows if r["metric"] in ("gap", "status")], indent=None)[:2000])
    print(f"results appended to {res.path}")


if __name__ == "__main__":
    main()
