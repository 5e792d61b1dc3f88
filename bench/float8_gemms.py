"""float8 against bf16 per Linear shape, inside torch.compile as the float8 rung runs them (issue 72,
deliver 3): the measured table behind the rung's ``min_features`` prior.

Per shape (M tokens, K in-features, N out-features): one ``nn.Linear(K, N)`` forward and backward on
(M, K) bf16-autocast inputs, compiled, against the same Linear converted by torchao's
``Float8Linear.from_float`` (rowwise scales on compute capability 9.0+, tensorwise below; ``--recipe``),
compiled; medians of CUDA-event windows after warm-up (:func:`speedkit.kernels.choice.cuda_timer`).
Shapes: GPT-2 small's and TinyLlama's Linears at their zoo batch, a Llama-3-8B MLP, and the two points
of torchao's own table (M, K, N = 1024, 2048, 1024: 0.80x; 4096, 8192, 16384: 1.39x), and a coarse grid
around the edge between them.

Rows (bench "float8_gemms"): ``variant`` ("bf16", "float8"), metric "ms", ``M``, ``K``, ``N``, ``shape``
(whose Linear), ``recipe``, ``speedup`` (bf16 ms / float8 ms, on the float8 row), ``commit``, ``date``,
``device``. Needs torchao (carry its wheel to the device) and a GPU of compute capability 8.9+.

``--table speedkit/configs/float8_gemms.yaml --from-rows FILE`` (no GPU needed) writes the rung's table
from the float8 rows of a results file: one entry per GPU, compute capability and recipe, the newest
commit's rows; the file's other entries are kept.

Usage: PYTHONPATH=.:/tmp/site python bench/float8_gemms.py [--recipe auto|rowwise|tensorwise] [--results FILE]
       python bench/float8_gemms.py --table speedkit/configs/float8_gemms.yaml --from-rows bench/results/<file>.jsonl
"""

from __future__ import annotations

import argparse
import json
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
    # a coarse grid around the edge, for the rung's prior between the models' own shapes
    ("grid", 2048, 2048, 2048),
    ("grid", 8192, 1024, 1024),
    ("grid", 8192, 4096, 4096),
    ("grid", 8192, 8192, 8192),
    ("grid", 32768, 2048, 2048),
    ("grid", 32768, 4096, 4096),
]


def _pass(linear: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def call() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = linear(x)
        y.backward(dy)
        x.grad = None

    return call


def write_table(rows_file: Path, table: Path) -> None:
    """The rung's table from the float8 rows in ``rows_file`` (see the module doc)."""
    import yaml

    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("bench") == "float8_gemms" and r.get("variant") == "float8" and r.get("metric") == "ms"]
    if not rows:
        raise SystemExit(f"--from-rows: no float8_gemms float8 rows in {rows_file}")
    text = table.read_text() if table.exists() else ""
    header = [line for line in text.splitlines() if line.startswith("#")]
    entries = (yaml.safe_load(text) or {}).get("measured") or []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["device"], str(r["capability"]), r["recipe"]), []).append(r)
    for (device, capability, recipe), group in groups.items():
        newest = max(group, key=lambda r: r["date"])
        group = [r for r in group if r["commit"] == newest["commit"] and r["date"] == newest["date"]]
        shapes = sorted({(r["M"], r["K"], r["N"]): r["speedup"] for r in group}.items())
        entries = [e for e in entries if (e["device"], str(e["capability"]), e["recipe"]) != (device, capability, recipe)]
        entries.append(
            {
                "device": device,
                "capability": capability,
                "recipe": recipe,
                "commit": newest["commit"],
                "date": newest["date"],
                "shapes": [[m, k, n, x] for (m, k, n), x in shapes],
            }
        )
    body = yaml.safe_dump({"measured": entries}, sort_keys=False, default_flow_style=None, width=120)
    table.write_text("\n".join(header) + "\n" + body)
    print(f"{table}: {sum(len(e['shapes']) for e in entries)} shapes in {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="auto", choices=("auto", "rowwise", "tensorwise"))
    parser.add_argument("--results", default=None)
    parser.add_argument("--table", default=None, help="write the float8 rung's table (with --from-rows)")
    parser.add_argument("--from-rows", default=None, help="the results file the table is written from")
    args = parser.parse_args()
    if args.table or args.from_rows:
        if not (args.table and args.from_rows):
            raise SystemExit("--table and --from-rows go together: the table is written from a results file's rows")
        write_table(Path(args.from_rows), Path(args.table))
        return
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
        capability = "{}.{}".format(*torch.cuda.get_device_capability(device))
        common = dict(M=M, K=K, N=N, shape=shape, recipe=recipe, capability=capability)
        res.add("bf16", "ms", bf16_ms, "ms", **common)
        res.add("float8", "ms", f8_ms, "ms", speedup=round(bf16_ms / f8_ms, 3), **common)
        print(
            f"{shape:24s} M={M:6d} K={K:6d} N={N:6d}  bf16 {bf16_ms:7.3f} ms  float8 {f8_ms:7.3f} ms  {bf16_ms / f8_ms:5.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
