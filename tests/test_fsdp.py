"""SpeedLadder under Lightning's ModelParallelStrategy (FSDP2: ``fully_shard`` in ``configure_model``,
each rank holding its shard of every parameter and of the optimizer state) on 2 CPU processes (gloo),
issue 58. Lightning's FSDPStrategy (FSDP1) refuses a CPU accelerator ("requires a GPU accelerator"):
it is tried on GPUs only.

The two ranks run, in the same processes: a fit without speedkit; a fit with trials whose decisions are
forced to keep (real rungs on, real restores); the same fit given the kept rungs by hand; and a fit whose
trials meet a rung that fails on rank 1 alone. They must: end the trials with both ranks' shards and
optimizer state as before them (the fit with trials trains exactly as the fit given its kept rungs, and
as the plain fit within fp32 rounding), take one decision on both ranks, revert a one-rank failure on
both, and never hang (the spawn is timeout-guarded). SpeedProfiler times both ranks' fits and writes one
report holding both; OOMFallback says why it stays out (a rank running out of memory inside FSDP's
collectives would strand the others)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import QUIET_TRAINER
from ranks import spawn_ranks
from test_lightning import QUICK as LIGHTNING_QUICK
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedkit import distributed
from speedkit.handle import Handle
from speedkit.lightning import OOMFallback, SpeedLadder, SpeedProfiler
from speedkit.rungs.base import Rung

STEPS = 6
#: the workers' accelerator: test_fsdp_gpu.py runs them on GPUs (NCCL)
ACCELERATOR = "cpu"
#: test_lightning's quick settings; no floor of the user's switches (compile would be its only one), no
#: minimum gain: the forced decisions need every rung timed, and on a GPU the plan found some rungs'
#: targets a sliver of the step in one run and not in another
QUICK = {**LIGHTNING_QUICK, "switches_floor": False, "min_gain": 0.0}


class Sharded(pl.LightningModule):
    """An MLP sharded as FSDP2's users shard a model: each block, then the root (``configure_model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
        self.params_after: list[list[torch.Tensor]] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]  # the whole 2-D mesh would replicate over it (HSDP)
        for layer in self.model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.params_after.append([distributed.local_shard(p).detach().clone() for p in self.parameters()])

    def on_train_end(self) -> None:
        """This rank's shard of every optimizer state tensor (AdamW's moments, its step counts)."""
        opt = self.trainer.optimizers[0]
        self.opt_state = [
            distributed.local_shard(v).detach().clone()
            for p in self.parameters()
            for _, v in sorted(opt.state[p].items())
            if isinstance(v, torch.Tensor)
        ]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class FailsOnRankOne(Rung):
    """A rung whose apply raises on rank 1 only."""

    name = "fails_on_rank_one"

    def apply(self, state):
        if distributed.rank() == 1:
            raise RuntimeError("broke on rank 1")
        return Handle(self.name)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    return DataLoader(data, batch_size=16, shuffle=True)


def _fit(callbacks: list, make: type[Sharded] | None = None, strategy: Any = None) -> Sharded:
    """The 2-rank fit of ``make()`` (default :class:`Sharded`) under ``strategy`` (default FSDP2's
    ``ModelParallelStrategy`` over the two ranks), ``STEPS`` steps."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    module = (make or Sharded)()
    trainer = pl.Trainer(
        accelerator=ACCELERATOR,
        devices=2,
        strategy=strategy or ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS,
        **QUIET_TRAINER,
        callbacks=callbacks,
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(module, train_dataloaders=_loader())
    assert trainer.global_step == STEPS
    return module


@contextlib.contextmanager
def forced(verdict: str) -> Iterator[None]:
    """Every decision of the trials forced to ``verdict`` ("kept": the real rungs stay on): the ladder's
    own and the leave-one-out of a group kept together, which would otherwise time each member out of
    it (on a CPU compile by aot_eager was timed slower than without it in one run of three)."""
    from speedkit.engine import comparison, second_look

    decide, leave_one_out = comparison.decide, second_look.leave_one_out
    comparison.decide = lambda cfg, paired, *rest: (verdict, "forced by the test")
    second_look.leave_one_out = lambda ladder, names: []
    try:
        yield
    finally:
        comparison.decide, second_look.leave_one_out = decide, leave_one_out


def fsdp_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank))
    plain = _fit([])
    results: dict = {"plain": plain.params_after}
    results["shards"] = [(type(p).__name__, tuple(distributed.local_shard(p).shape), tuple(p.shape)) for p in plain.parameters()]
    with forced("kept"):  # real rungs stay on
        # profiled: the final configuration's profile, each rank's collectives in it
        tried = SpeedLadder(
            rungs=["gc_freeze", "fused_optimizer"], trials="always", measure={**QUICK, "profile": True}, cache=False
        )
        tried_module = _fit([tried])
        results["tried"], results["tried_opt"] = tried_module.params_after, tried_module.opt_state
    result = tried.result
    results["kept"] = [r.name for r in result.kept]
    results["strategy"] = result.run["strategy"]
    results["scaling"] = result.run.get("scaling")
    results["communication"] = result.run.get("ranks_communication")
    results["communication_final"] = result.run.get("ranks_communication_final")
    by_hand = SpeedLadder(rungs=[{"name": r.name, "options": r.options} for r in result.kept])
    by_hand_module = _fit([by_hand])
    results["by_hand"], results["by_hand_opt"] = by_hand_module.params_after, by_hand_module.opt_state
    results["by_hand_applied"] = sorted(by_hand.applied_changes)

    failing = SpeedLadder(rungs=[FailsOnRankOne(), "gc_freeze"], trials="always", measure=QUICK, cache=False)
    results["failing"] = _fit([failing]).params_after
    entry = next(r for r in failing.result.rungs if r.name == "fails_on_rank_one")
    results["failing_entry"] = (entry.status, entry.reason)
    profiler, fallback = SpeedProfiler(report_dir=Path(out) / "profile", nvml=False), OOMFallback()
    results["profiled"] = _fit([profiler, fallback]).params_after
    results["fallback_not_applied"] = fallback.not_applied
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _close(a: list[torch.Tensor], b: list[torch.Tensor], rel: float) -> bool:
    return all(float((x - y).abs().max()) <= rel * max(float(y.abs().max()), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.filterwarnings("ignore")
def test_trials_under_fsdp2_restore_every_ranks_shards_and_decide_alike(tmp_path):
    spawn_ranks(fsdp_worker, str(tmp_path), timeout_s=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, got in enumerate(ranks):
        assert got["strategy"] == "ModelParallelStrategy"
        # in the plan's order: a host-bound step (a GPU's) tries the fused optimizer first
        assert sorted(got["kept"]) == ["fused_optimizer", "gc_freeze"] == got["by_hand_applied"], got["kept"]
        assert len(got["tried"]) == len(got["by_hand"]) == len(got["plain"]) == STEPS
        # the trials put back this rank's shards and its optimizer state: the fit after them is the fit
        # given the kept rungs by hand, exactly, and the plain fit's within the fused update's rounding
        for step, (a, b) in enumerate(zip(got["tried"], got["by_hand"], strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, step)
        assert len(got["tried_opt"]) == 18  # step, exp_avg, exp_avg_sq of 6 parameters
        assert all(torch.equal(x, y) for x, y in zip(got["tried_opt"], got["by_hand_opt"], strict=True)), rank
        for step, (a, b) in enumerate(zip(got["tried"], got["plain"], strict=True)):
            assert _close(a, b, 1e-5), (rank, step)
        # a rung failing on rank 1 alone failed on both, and nothing of it stayed
        status, reason = got["failing_entry"]
        assert status == "failed" and "rank 1" in reason and "broke on rank 1" in reason, reason
        for step, (a, b) in enumerate(zip(got["failing"], got["plain"], strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, step)
        # SpeedProfiler times both ranks' fits and changes nothing; OOMFallback says why it stays out
        for step, (a, b) in enumerate(zip(got["profiled"], got["plain"], strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (rank, step)
        assert "FSDP2 (ModelParallelStrategy) over several processes" in got["fallback_not_applied"]
    profile = json.loads((tmp_path / "profile" / "speed_profile.json").read_text())
    assert [r["rank"] for r in profile["ranks"]] == [0, 1]
    assert all(r["steps"] == STEPS and r["step_ms_median"] > 0 for r in profile["ranks"])
    assert ranks[0]["kept"] == ranks[1]["kept"]
    # the report's communication share of each rank's profiled step, and the scaling bound it gives
    from speedkit.report.ranks import communication_lines, scaling_line

    scaling, communication = ranks[0]["scaling"], ranks[0]["communication"]
    assert [r["rank"] for r in communication["ranks"]] == [0, 1]
    assert all(0 < r["share"] < 1 and r["communication_ms"] > 0 for r in communication["ranks"]), communication
    assert scaling["efficiency"] is None and "bench/across_gpus.py" in scaling["note"], scaling
    assert scaling["efficiency_at_least"] == round(1 - min(r["share"] for r in communication["ranks"]), 4)
    report = {"run": {"scaling": scaling, "ranks_communication": communication}}
    assert "at least" in scaling_line(report) and len(communication_lines(report)) == 3
    # and the final configuration's own profile, each rank's
    final = ranks[0]["communication_final"]
    assert final["of"] == "the final configuration's step" and [r["rank"] for r in final["ranks"]] == [0, 1], final
    assert all(0 < r["share"] < 1 for r in final["ranks"]), final
    lines = communication_lines({"run": {"ranks_communication_final": final}}, "ranks_communication_final")
    assert lines[0].startswith("Communication (the final configuration's step") and len(lines) == 3
    # each rank holds its own shard (half of each parameter's rows), and the two ranks' shards differ
    assert all(kind == "DTensor" and local[0] * 2 == full[0] for kind, local, full in ranks[0]["shards"]), ranks[0]["shards"]
    assert not all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(ranks[0]["plain"][-1], ranks[1]["plain"][-1], strict=True))


# -- the sharding rungs (fsdp_mixed_precision, fsdp_reshard, fsdp_prefetch) and regional compile ----------

SHARDING_RUNGS = ["fsdp_mixed_precision", "fsdp_reshard", "fsdp_prefetch"]
#: regional compile on the CPU without Inductor's C++ build (the same graphs, traced and run by AOTAutograd)
COMPILE = {"name": "compile", "options": {"backend": "aot_eager"}}


class Recorded(Sharded):
    """The sharded MLP recording, as its fit ends, the FSDP2 settings in effect then."""

    def on_train_end(self) -> None:
        super().on_train_end()
        from speedkit import compat

        self.settings = {
            "param_dtypes": [str(p.param_dtype) for p in compat.fsdp2_policies(self)],
            "resharded": [compat.fsdp2_resharded_after_forward(m) for m in compat.fsdp2_modules(self)],
            "prefetch": [len(compat.fsdp2_prefetch(m)[0] or []) for m in compat.fsdp2_modules(self)],
        }


def _recorded_fit(callbacks: list) -> Recorded:
    return _fit(callbacks, make=Recorded)  # type: ignore[return-value]


def fsdp_rungs_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank))
    os.environ["SPEEDKIT_CPU_BF16"] = "1"  # fsdp_mixed_precision applies on any CPU (the test times nothing)
    results: dict = {}
    plain = _recorded_fit([])
    results["plain"], results["plain_settings"] = plain.params_after, plain.settings
    for verdict in ("reverted", "kept"):
        with forced(verdict):
            tried = SpeedLadder(rungs=[*SHARDING_RUNGS, COMPILE], trials="always", measure=QUICK, cache=False)
            module = _recorded_fit([tried])
        results[verdict] = (module.params_after, module.opt_state, module.settings)
        results[f"{verdict}_entries"] = {r.name: (r.status, r.reason, list(r.changes)) for r in tried.result.rungs}
        results[f"{verdict}_kept"] = [{"name": r.name, "options": r.options} for r in tried.result.kept]
    by_hand = SpeedLadder(rungs=results["kept_kept"])
    module = _recorded_fit([by_hand])
    results["by_hand"] = (module.params_after, module.opt_state, module.settings)
    # alone, given before FSDP has run a forward (its lazy init not yet done): it applies all the same
    module = _recorded_fit([SpeedLadder(rungs=["fsdp_reshard"])])
    results["reshard_alone"] = module.settings
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.filterwarnings("ignore")
def test_sharding_rungs_keep_and_revert_exactly_on_both_ranks(tmp_path):
    """Under FSDP2 on 2 gloo ranks: the three sharding rungs and compile (block by block) kept by the
    trials give the fit those rungs give by hand, exactly (each rank's shards every step, its optimizer
    state, and FSDP2's settings: bf16 gathers, no resharding after forward, prefetching two ahead); all
    reverted, the fit is the plain fit exactly, FSDP2's settings as the user left them."""
    spawn_ranks(fsdp_rungs_worker, str(tmp_path), timeout_s=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        plain = got["plain_settings"]
        assert plain["param_dtypes"] == ["None"] * 4 and plain["prefetch"] == [0] * 4
        assert plain["resharded"] == [False, True, True, True]  # the root keeps its parameters (FSDP2's default)
        kept = got["kept_entries"]
        assert [e["name"] for e in got["kept_kept"]] == [*SHARDING_RUNGS, "compile"] or sorted(
            e["name"] for e in got["kept_kept"]
        ) == sorted([*SHARDING_RUNGS, "compile"]), kept
        compile_changes = " ".join(kept["compile"][2])
        assert "sharded blocks are compiled one by one" in compile_changes, compile_changes
        assert "model.0-4 (3 FSDPLinear blocks).forward = torch.compile" in compile_changes, compile_changes
        assert "ran model.0-4 (3 FSDPLinear blocks).forward:" in compile_changes, compile_changes
        params, opt, settings = got["kept"]
        by_hand_params, by_hand_opt, by_hand_settings = got["by_hand"]
        assert settings == by_hand_settings, (settings, by_hand_settings)
        assert settings["param_dtypes"] == ["torch.bfloat16"] * 4 and settings["resharded"] == [False] * 4
        assert settings["prefetch"] == [0, 2, 1, 0]  # the root, then three blocks: two ahead
        for step, (a, b) in enumerate(zip(params, by_hand_params, strict=True)):
            assert _equal(a, b), (rank, step)
        assert _equal(opt, by_hand_opt), rank
        assert not _equal(params[-1], got["plain"][-1])  # the bf16 gathers did change the arithmetic
        # reverted: the user's FSDP2 settings back, and the fit the plain fit exactly
        params, _, settings = got["reverted"]
        assert settings == plain, settings
        assert all(got["reverted_entries"][n][0] == "reverted" for n in SHARDING_RUNGS), got["reverted_entries"]
        for step, (a, b) in enumerate(zip(params, got["plain"], strict=True)):
            assert _equal(a, b), (rank, step)
        assert got["reshard_alone"]["resharded"] == [False] * 4, got["reshard_alone"]


def test_sharding_rungs_say_why_not_without_fsdp2():
    from speedkit import rungs
    from speedkit.training.state import TrainState

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    for name in SHARDING_RUNGS:
        assert "not sharded with FSDP2's fully_shard" in rungs.make(name).check(state), name


def test_the_default_ladder_tries_fsdp2s_choices_before_compile():
    """SpeedLadder() climbs them (they say why not where nothing is sharded), beneath compile: it then
    compiles the blocks at the gathered parameters' dtype."""
    from speedkit import config

    ladder = config.default_ladder()
    assert all(ladder.index(name) < ladder.index("compile") for name in [*SHARDING_RUNGS, "activation_checkpointing"])


# -- regional compile of a transformers model's layers: all of them compiled, one graph ----------------

COUNTED: dict[str, int] = {"graphs": 0, "runs": 0}


def _counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """A Dynamo backend that runs the traced graph as is and counts its graphs and their runs."""
    COUNTED["graphs"] += 1

    def run(*args: Any) -> Any:
        COUNTED["runs"] += 1
        return gm.forward(*args)

    return run


def regional_llama_worker(rank: int, port: int, out: str) -> None:
    from torch._dynamo import register_backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from speedkit.rungs.compile import CompileOptions, apply_compile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=1)
    register_backend(_counting_backend, name="speedkit_test_counting")
    dims = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    config = LlamaConfig(**dims, num_hidden_layers=12, max_position_embeddings=32, attn_implementation="sdpa")
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    # the user's own compile of each layer of another model, as users write it: the layers specialize on
    # their index through the KV cache, and Dynamo gives the class's forward up after 8 of them
    other = LlamaForCausalLM(config)
    for layer in other.model.layers:
        layer.compile(backend="eager")
    other(input_ids=tokens, labels=tokens).loss.backward()
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle, guards = apply_compile(model, CompileOptions(backend="speedkit_test_counting"))
    results: dict[str, Any] = {"use_cache_on": model.config.use_cache, "changes": list(handle.changes)}
    for _ in range(2):
        model(input_ids=tokens, labels=tokens).loss.backward()
    results.update(COUNTED, calls=[g.calls for _, g in guards], fallbacks=[g.fallback_reason for _, g in guards])
    handle.undo()
    results["use_cache_after_undo"] = model.config.use_cache
    results["forwards_after_undo"] = ["forward" in layer.__dict__ for layer in model.model.layers]
    torch.save(results, Path(out) / "regional.pt")


@pytest.mark.filterwarnings("ignore")
def test_regional_compile_runs_every_layer_of_a_transformers_model_compiled(tmp_path):
    """A transformers Llama of 12 layers sharded with FSDP2, in a process where the user's own compile
    of another such model's layers used up Dynamo's entries for the layer class's forward: compile
    runs all 12 layers' compiled graph (one graph for all of them: the KV cache, which keyed each
    layer's keys and values by its index, is off for the fit), and undo puts the cache back."""
    pytest.importorskip("transformers")
    spawn_ranks(regional_llama_worker, str(tmp_path), nprocs=1, timeout_s=300)
    got = torch.load(tmp_path / "regional.pt", weights_only=False)
    assert got["use_cache_on"] is False and got["use_cache_after_undo"] is True, got
    assert any("config.use_cache = False (was True)" in c for c in got["changes"]), got["changes"]
    assert got["fallbacks"] == [None] * 12 and got["calls"] == [2] * 12, got
    assert got["graphs"] == 1, got  # one graph for the 12 layers
    assert got["runs"] == 2 * 12, got  # each layer's forward ran the compiled graph, in both steps
    assert got["forwards_after_undo"] == [False] * 12
