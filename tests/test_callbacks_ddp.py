"""SpeedLadder (given rungs), SpeedProfiler and OOMFallback together in a 2-process Lightning DDP fit
on the CPU (gloo). Two ranks run, in the same processes, a fit without speedkit, the fit with the
three callbacks in every order of the Trainer's callbacks list (rank 1 alone runs out of memory),
and a fit stopped at a checkpoint then resumed from it. They must: train to the parameters of the
fit without speedkit (fp32, rel 1e-5), equal on both ranks; take the same split on both ranks with
no hang; write one report each, from rank 0, holding both ranks' figures; resume at the split the
checkpoint holds without a new out-of-memory attempt, the profile counting the resumed fit's steps."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from ranks import spawn_ranks
from test_oom_fallback import Injector, LitNet, _close, loader

from speedkit.lightning import OOMFallback, SpeedLadder, SpeedProfiler

STEPS, RESUME_AT = 16, 8  # 8 optimizer steps an epoch per rank (256 samples, batches of 16, accumulation 2)
RUNGS = ["gc_freeze", {"name": "micro_batch", "options": {"factor": 2}}]  # both apply on the CPU; exact numerics
ORDERS = list(itertools.permutations(("ladder", "profiler", "fallback")))


class RankNet(LitNet):
    """LitNet whose parameters after each optimizer step are kept (the per-step check)."""


def _callbacks(order: tuple[str, ...], report_dir: Path) -> list[pl.Callback]:
    made = {
        "ladder": SpeedLadder(rungs=RUNGS),
        "profiler": SpeedProfiler(report_dir=report_dir, nvml=False),
        "fallback": OOMFallback(report_dir=report_dir),
    }
    return [made[name] for name in order]


def _fit(rank: int, callbacks: list, steps: int, injector: Injector | None, ckpt_path: str | None = None) -> RankNet:
    torch.manual_seed(0)
    module = RankNet(injector if rank == 1 else None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, train_dataloaders=loader(), ckpt_path=ckpt_path)
    assert trainer.global_step == steps
    return module


def _record(module: RankNet, callbacks: list) -> dict:
    fallback = next(c for c in callbacks if isinstance(c, OOMFallback))
    profiler = next(c for c in callbacks if isinstance(c, SpeedProfiler))
    ladder = next(c for c in callbacks if isinstance(c, SpeedLadder))
    return {
        "params_after": module.params_after,
        "params": [p.detach().clone() for p in module.parameters()],
        "parts": fallback.fallback.parts,
        "events": [(e.step, e.old_micro_batch, e.new_micro_batch, e.kind) for e in fallback.events],
        "raised": dict(module.net.injector.raised) if module.net.injector is not None else None,  # rank 1's
        "summary": profiler.summary,
        "applied": sorted(ladder.applied_changes),
        "wrapped_left": sorted(k for k in ("training_step", "backward", "optimizer_step") if k in module.__dict__),
    }


def ddp_worker(rank: int, port: int, out: str) -> None:
    """One rank: every fit of the file, in this process (the process group made once, by the first fit)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank))
    import speedkit.lightning.oom_fallback as oom_module
    import speedkit.lightning.speed_profiler as profiler_module

    writes: list[str] = []  # every report file this rank writes
    for module in (oom_module, profiler_module):
        write = module.write_text_atomic

        def counted(path, text, write=write):
            writes.append(Path(path).name)
            return write(path, text)

        module.write_text_atomic = counted
    root = Path(out)
    results: dict = {"reference": {"params_after": _fit(rank, [], STEPS, None).params_after}}
    for order in ORDERS:
        injector = Injector(budget=4, random_errors=2, horizon=150, seed=5)
        callbacks = _callbacks(order, root / "-".join(order))
        module = _fit(rank, callbacks, STEPS, injector)
        results["-".join(order)] = _record(module, callbacks)
    # a fit stopped at a checkpoint, then resumed from it by new callbacks in another order
    ckpt_dir = root / "ckpt"
    first = [*_callbacks(ORDERS[0], root / "first"), pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)]
    injector = Injector(budget=4)
    results["first"] = _record(_fit(rank, first, RESUME_AT, injector), first)
    resumed = _callbacks(ORDERS[-1], root / "resumed")
    injector = Injector(budget=4)
    results["resumed"] = _record(_fit(rank, resumed, STEPS, injector, str(ckpt_dir / "last.ckpt")), resumed)
    results["writes"] = writes
    torch.save(results, root / f"rank{rank}.pt")


def test_three_callbacks_in_every_order_under_ddp_train_like_plain_ddp_and_resume_their_decisions(tmp_path):
    spawn_ranks(ddp_worker, str(tmp_path), timeout_s=170)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    reference = ranks[0]["reference"]["params_after"]
    assert len(reference) == STEPS
    for order in ORDERS:
        name = "-".join(order)
        runs = [r[name] for r in ranks]
        # (a) every optimizer step's parameters are those of plain DDP, and equal on both ranks
        assert len(runs[0]["params_after"]) == STEPS, name
        for step, (got, want) in enumerate(zip(runs[0]["params_after"], reference, strict=True)):
            assert _close(got, want), (name, step)
        assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"], strict=True)), name
        assert runs[0]["applied"] == runs[1]["applied"] == ["gc_freeze", "micro_batch"], name
        assert runs[0]["wrapped_left"] == runs[1]["wrapped_left"] == [], name  # every wrapper undone
        # (b) rank 1 alone ran out of memory; both ranks took the same splits in the same steps
        assert runs[0]["raised"] is None and runs[1]["raised"]["budget"] > 0, name
        assert runs[0]["events"] == runs[1]["events"], name
        assert runs[0]["events"][:3] == [(0, 32, 16, "out of memory"), (0, 16, 8, "out of memory"), (0, 8, 4, "out of memory")]
        assert runs[0]["parts"] == runs[1]["parts"] == 8, name  # merged micro-batches of 32, 4 samples at a time
        # (d) one report each, written by rank 0, with both ranks' figures
        profile = json.loads((tmp_path / name / "speed_profile.json").read_text())
        assert [r["rank"] for r in profile["ranks"]] == [0, 1], name
        for figures in profile["ranks"]:
            assert figures["steps"] == STEPS and figures["step_ms_median"] > 0 and figures["data_wait_ms"] is not None
            assert figures["host_peak_rss_bytes"] > 0
        assert profile["slowest_rank"] in (0, 1) and profile["ranks"] == runs[0]["summary"]["ranks"]
        fallback = json.loads((tmp_path / name / "oom_fallback.json").read_text())
        assert fallback["micro_batches"] == 8 and len(fallback["events"]) == len(runs[0]["events"])
    assert ranks[1]["writes"] == []
    assert sorted(ranks[0]["writes"]) == sorted(["speed_profile.json", "oom_fallback.json"] * (len(ORDERS) + 2))

    # (c) resumed from the checkpoint at step RESUME_AT: the split it held, no new attempt, the same training
    first, resumed = ranks[0]["first"], [r["resumed"] for r in ranks]
    assert first["parts"] == 8 and ranks[1]["first"]["raised"]["budget"] == 3
    for run in resumed:
        assert run["parts"] == 8 and run["events"] == first["events"]  # restored, none added
    assert resumed[1]["raised"] == {"budget": 0, "forward": 0, "backward": 0}  # no out-of-memory attempt
    assert len(resumed[0]["params_after"]) == STEPS - RESUME_AT
    for step, (got, want) in enumerate(zip(resumed[0]["params_after"], reference[RESUME_AT:], strict=True)):
        assert _close(got, want), ("resumed", RESUME_AT + step)
    assert all(torch.equal(a, b) for a, b in zip(resumed[0]["params"], resumed[1]["params"], strict=True))
    summary = resumed[0]["summary"]
    assert (summary["global_step_start"], summary["global_step_end"], summary["steps"]) == (RESUME_AT, STEPS, STEPS - RESUME_AT)
    assert [r["steps"] for r in summary["ranks"]] == [STEPS - RESUME_AT] * 2
    assert summary["flops_per_step"] == first["summary"]["flops_per_step"] > 0  # carried, not counted again
    written = json.loads((tmp_path / "resumed" / "speed_profile.json").read_text())
    assert written["global_step_start"] == RESUME_AT and len(written["ranks"]) == 2
