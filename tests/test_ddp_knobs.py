"""DDP's own knobs as rungs (``ddp_bucket_view``, ``ddp_static_graph``, ``ddp_bucket_size``,
``ddp_bf16_compress``): on one process each says why not; in a 2-process Lightning DDP fit on the CPU
(gloo), each applied at ``setup`` is in the DistributedDataParallel Lightning builds and trains as the
fit without it (exactly, or within bf16's rounding for compression); applied after Lightning wrapped
the model, a new wrapper trains, and the undo puts Lightning's own back while the fit goes on."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import mlp_state
from ranks import spawn_ranks
from torch import nn

from speedkit import compat, rungs
from speedkit.errors import ConfigError

KNOBS = ["ddp_bucket_view", "ddp_static_graph", "ddp_bucket_size", "ddp_bf16_compress"]
#: a bucket smaller than the model's 848 bytes of gradients (DDP's default 25 MiB holds them in one)
SMALL_BUCKET = {"name": "ddp_bucket_size", "options": {"bucket_cap_mb": 0.0005}}
STEPS = 6


# -- one process --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", KNOBS)
def test_on_one_process_each_knob_says_why_not_in_one_line(name):
    assert rungs.make(name).check(mlp_state()) == "DDP knobs need several processes: world size 1"


def test_on_a_one_device_lightning_fit_each_knob_says_why_not():
    from speedkit.lightning.step import LightningStep
    from speedkit.training.state import TrainState

    module = LitNet()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    step = LightningStep(trainer, module)
    assert step.ddp_options() is None
    state = TrainState(model=module, optimizer=None, device=step.device, step=step)
    assert {n: rungs.make(n).check(state) for n in KNOBS} == dict.fromkeys(
        KNOBS, "DDP knobs need several processes: world size 1"
    )


def test_what_each_knob_would_change_nothing_in():
    state = mlp_state()
    size = rungs.make("ddp_bucket_size")
    assert size.options.bucket_cap_mb == 100.0
    assert size.why_not({}, state).startswith(
        "the model's gradients (0.0"
    ) and "fit in one bucket at DDP's default 25 MiB" in size.why_not({}, state)
    assert (
        rungs.make({"name": "ddp_bucket_size", "options": {"bucket_cap_mb": 25}}).why_not({}, state)
        == "bucket_cap_mb=25 is DDP's default"
    )
    assert size.why_not({"bucket_cap_mb_list": [1, 25]}, state) == "the strategy already sets bucket_cap_mb_list=[1, 25]"
    compress = rungs.make("ddp_bf16_compress")
    assert compress.why_not({"backend": "gloo"}, state) is None
    assert (
        compress.why_not({"backend": "mpi"}, state)
        == "the mpi backend is not known to all-reduce bf16 tensors (nccl and gloo do)"
    )
    assert compress.precision == "bf16" and compress.acts_through_numerics
    assert all(rungs.get(n).precision is None for n in KNOBS[:3])
    static = rungs.make("ddp_static_graph")
    assert static.why_not({"find_unused_parameters": True}, state).startswith("the strategy sets find_unused_parameters=True")
    assert static.why_not({}, state) is None
    state.step._accumulate = 2  # gradient accumulation: DDP's no_sync, which a static graph breaks
    assert static.why_not({}, state).startswith("the step accumulates gradients over 2 micro-batches (DDP's no_sync)")
    for bad in (0, -1, "big", True):
        with pytest.raises(ConfigError, match="bucket_cap_mb"):
            rungs.make({"name": "ddp_bucket_size", "options": {"bucket_cap_mb": bad}})


def test_compat_reads_and_sets_what_ddp_strategy_wraps_with():
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    strategy = DDPStrategy(gradient_as_bucket_view=True, ddp_comm_hook=default_hooks.allreduce_hook)
    assert compat.lightning_ddp_kwargs(strategy) == {"gradient_as_bucket_view": True}
    assert compat.lightning_ddp_comm_hook(strategy) is default_hooks.allreduce_hook
    compat.lightning_set_ddp_kwargs(strategy, {"static_graph": True})
    compat.lightning_set_ddp_comm_hook(strategy, None)
    assert compat.lightning_ddp_kwargs(strategy) == {"static_graph": True} and compat.lightning_ddp_comm_hook(strategy) is None
    assert compat.ddp_comm_hooks(nn.Linear(1, 1)) == []


# -- two processes ------------------------------------------------------------------------------------


class LitNet(pl.LightningModule):
    """A small regression net that records its losses."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.lin2(torch.tanh(self.lin1(x))), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _describe(ddp) -> dict:
    """What a DistributedDataParallel wrapper does, as the test reads it."""
    return {
        "type": type(ddp).__name__,
        "gradient_as_bucket_view": getattr(ddp, "gradient_as_bucket_view", None),
        "static_graph": getattr(ddp, "static_graph", None),
        "bucket_bytes_cap": getattr(ddp, "bucket_bytes_cap", None),
        "hooks": [getattr(h, "__qualname__", repr(h)) for h, _ in compat.ddp_comm_hooks(ddp)],
    }


def _callbacks():
    from lightning.pytorch.callbacks import Callback

    from speedkit.lightning.step import LightningStep
    from speedkit.training.state import TrainState

    class Record(Callback):
        """The wrapper the fit trains through, read once the strategy wrapped the model."""

        def on_train_start(self, trainer, pl_module):
            self.wrapped = _describe(trainer.strategy.model)

    class AfterWrap(Callback):
        """Applies ``specs`` on the LightningStep once Lightning wrapped the model (as trials do); after
        optimizer step ``toggle_at`` suspends and resumes them, after ``undo_at`` undoes them."""

        def __init__(self, specs, toggle_at, undo_at, guarded=0):
            self.specs, self.toggle_at, self.undo_at, self.guarded = specs, toggle_at, undo_at, guarded
            self.events: list = []

        def on_train_start(self, trainer, pl_module):
            self.original = trainer.strategy.model
            step = LightningStep(trainer, pl_module)
            state = TrainState(model=pl_module, optimizer=step.optimizer, device=step.device, step=step)
            self.handles = []
            for spec in self.specs:
                rung = rungs.make(spec)
                assert rung.check(state) is None, rung.check(state)
                self.handles.append(rung.apply(state))
            self.wrapped = _describe(trainer.strategy.model)
            self.events.append(("applied", trainer.strategy.model is not self.original, state.precision))
            g = torch.Generator().manual_seed(100 + trainer.global_rank)  # each rank its own batches
            with step.guarded():  # as the trials' parity steps run, before the fit's first step
                for i in range(self.guarded):
                    batch = (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
                    step([tuple(t.to(pl_module.device) for t in batch)], i)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps = trainer.global_step
            if steps == self.toggle_at:
                new = trainer.strategy.model
                for h in reversed(self.handles):
                    h.suspend()
                self.events.append(("suspended", trainer.strategy.model is self.original))
                for h in self.handles:
                    h.resume()
                self.events.append(("resumed", trainer.strategy.model is new))
            if steps == self.undo_at:
                for h in reversed(self.handles):
                    h.undo()
                from speedkit.lightning.ddp import _WRAPPINGS

                kept = list(_WRAPPINGS[trainer.strategy].wrappers.values())
                self.events.append(("undone", trainer.strategy.model is self.original, steps, kept == [self.original]))

        def on_train_end(self, trainer, pl_module):
            self.events.append(("end", trainer.global_step, trainer.strategy.model is self.original))

    return Record, AfterWrap


def _fit(
    accelerator: str, *, specs=(), after=None, strategy=None, max_steps: int = STEPS, accumulate: int = 1, guarded: int = 0
) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    from speedkit.lightning import SpeedLadder

    Record, AfterWrap = _callbacks()
    torch.manual_seed(0)
    module = LitNet()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    record = Record()
    callbacks: list = [record]
    ladder = SpeedLadder(rungs=list(specs), trials=False) if specs else None
    if ladder is not None:
        callbacks.append(ladder)
    after_wrap = AfterWrap(after, toggle_at=1, undo_at=3 if not guarded else -1, guarded=guarded) if after else None
    if after_wrap is not None:
        callbacks.append(after_wrap)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=2,
        strategy=strategy or "ddp",
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    return {
        "losses": module.losses,
        "params": [p.detach().cpu().clone() for p in module.parameters()],
        "wrapped": record.wrapped,
        "skipped": dict(ladder.skipped) if ladder is not None else {},
        "changes": dict(ladder.applied_changes) if ladder is not None else {},
        "after": (after_wrap.wrapped, after_wrap.events) if after_wrap is not None else None,
    }


def knob_fits(rank: int, port: int, accelerator: str, out: str) -> None:
    """One rank: the fits the test compares, one Lightning "ddp" fit after another in this process
    (the environment names the rank, so Lightning launches nothing)."""
    import warnings

    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from speedkit.training.state import TrainState

    warnings.filterwarnings("ignore")
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    results: dict = {"base": _fit(accelerator)}
    for spec in ["ddp_bucket_view", "ddp_static_graph", SMALL_BUCKET, "ddp_bf16_compress"]:
        results[spec if isinstance(spec, str) else spec["name"]] = _fit(accelerator, specs=[spec])
    results["after_exact"] = _fit(accelerator, after=["ddp_bucket_view", "ddp_static_graph", SMALL_BUCKET])
    results["after_bf16"] = _fit(accelerator, after=["ddp_bf16_compress"])
    # a static-graph wrapper made after Lightning's, then guarded steps (trials' parity steps) before its first
    results["static_after_guarded"] = _fit(accelerator, after=["ddp_static_graph"], guarded=2)
    # with gradient accumulation (DDP's no_sync on the first micro-batch of each step)
    results["base_accumulating"] = _fit(accelerator, accumulate=2)
    results["accumulating"] = _fit(accelerator, specs=["ddp_bucket_view", SMALL_BUCKET], accumulate=2)
    user = DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=10, ddp_comm_hook=default_hooks.allreduce_hook)
    results["user_set"] = _fit(accelerator, specs=KNOBS, strategy=user, max_steps=1, accumulate=2)
    # a step that does not train under DDP, in a process group of two (the fits left it up)
    plain = mlp_state()
    results["plain_checks"] = {
        n: rungs.make(n).check(TrainState(model=plain.model, optimizer=plain.optimizer, device="cpu")) for n in KNOBS
    }
    results["world"] = dist.get_world_size()
    torch.save(results, f"{out}/rank{rank}.pt")


def _run(accelerator: str, out: Path, timeout_s: float) -> list[dict]:
    spawn_ranks(knob_fits, accelerator, str(out), timeout_s=timeout_s)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_knobs(ranks: list[dict], exact) -> None:
    r0 = ranks[0]
    base = r0["base"]
    assert len(base["losses"]) == STEPS and base["wrapped"]["type"] == "DistributedDataParallel"
    assert base["wrapped"]["gradient_as_bucket_view"] is False and base["wrapped"]["static_graph"] is False
    assert base["wrapped"]["bucket_bytes_cap"] == 25 * 2**20 and base["wrapped"]["hooks"] == []
    # each knob at setup: in the wrapper Lightning built, nothing skipped, the same training
    assert r0["ddp_bucket_view"]["wrapped"]["gradient_as_bucket_view"] is True
    assert r0["ddp_static_graph"]["wrapped"]["static_graph"] is True
    assert r0["ddp_bucket_size"]["wrapped"]["bucket_bytes_cap"] == int(0.0005 * 2**20)
    assert r0["ddp_bf16_compress"]["wrapped"]["hooks"] == ["bf16_compress_hook"]
    for name in KNOBS:
        fit = r0[name]
        assert fit["skipped"] == {} and fit["changes"][name], (name, fit["skipped"])
        others = {
            k: v
            for k, v in fit["wrapped"].items()
            if k
            != {
                "ddp_bucket_view": "gradient_as_bucket_view",
                "ddp_static_graph": "static_graph",
                "ddp_bucket_size": "bucket_bytes_cap",
                "ddp_bf16_compress": "hooks",
            }[name]
        }
        assert others == {k: v for k, v in base["wrapped"].items() if k in others}, name  # only its own knob changed
        if name == "ddp_bf16_compress":
            _assert_bf16_close(fit, base)
        else:
            exact(fit, base, name)
    assert r0["ddp_bf16_compress"]["losses"] != base["losses"]  # the compression did round
    # after wrapping: a new wrapper with every knob, suspended and resumed, undone; the fit goes on
    wrapped, events = r0["after_exact"]["after"]
    assert (wrapped["gradient_as_bucket_view"], wrapped["static_graph"], wrapped["bucket_bytes_cap"]) == (True, True, 524)
    assert events == [
        ("applied", True, "fp32"),
        ("suspended", True),
        ("resumed", True),
        ("undone", True, 3, True),
        ("end", STEPS, True),
    ]
    exact(r0["after_exact"], base, "after_exact")
    wrapped, events = r0["after_bf16"]["after"]
    assert (
        wrapped["hooks"] == ["bf16_compress_hook"]
        and events[0] == ("applied", True, "bf16")
        and events[-1] == ("end", STEPS, True)
    )
    _assert_bf16_close(r0["after_bf16"], base)
    assert r0["after_bf16"]["losses"][2] != base["losses"][2]  # the new wrapper trained: its hook rounded
    accumulating = r0["accumulating"]
    assert accumulating["skipped"] == {} and accumulating["wrapped"]["gradient_as_bucket_view"] is True
    assert len(accumulating["losses"]) == 2 * STEPS
    exact(accumulating, r0["base_accumulating"], "accumulating")
    # the user's own settings are left alone, each with its one line
    assert r0["user_set"]["skipped"] == {
        "ddp_bucket_view": "the strategy already sets gradient_as_bucket_view=True",
        "ddp_static_graph": (
            "the step accumulates gradients over 2 micro-batches (DDP's no_sync), which static_graph=True "
            "breaks: DDP fails on the first step or stops all-reducing (pytorch/pytorch#143580, #187732)"
        ),
        "ddp_bucket_size": "the strategy already sets bucket_cap_mb=10",
        "ddp_bf16_compress": "the strategy already registers the communication hook allreduce_hook",
    }
    assert r0["world"] == 2 and r0["plain_checks"] == dict.fromkeys(
        KNOBS, "the run's strategy does not wrap the model in DistributedDataParallel (DDP knobs need strategy='ddp')"
    )
    # the ranks trained the same model
    # a static-graph wrapper whose first iteration came after guarded steps all-reduces in every step after it
    assert r0["static_after_guarded"]["after"][0]["static_graph"] is True
    for name in ["base", *KNOBS, "after_exact", "after_bf16", "static_after_guarded"]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][name]["params"], ranks[1][name]["params"])), name


def _assert_bf16_close(fit: dict, base: dict) -> None:
    """Within bf16's rounding of the all-reduced gradients (8 bits of mantissa) over a few SGD steps."""
    assert torch.allclose(torch.tensor(fit["losses"]), torch.tensor(base["losses"]), rtol=2e-2, atol=1e-3)
    for a, b in zip(fit["params"], base["params"]):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-3)


def _exactly(fit: dict, base: dict, name: str) -> None:
    assert fit["losses"] == base["losses"], name
    assert all(torch.equal(a, b) for a, b in zip(fit["params"], base["params"])), name


def test_each_knob_takes_effect_in_lightnings_ddp_and_trains_as_without_it(tmp_path):
    _assert_knobs(_run("cpu", tmp_path, timeout_s=150), _exactly)


@pytest.mark.gpu
def test_each_knob_under_nccl_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")

    def close(fit: dict, base: dict, name: str) -> None:  # cuBLAS may pick other kernels between fits
        assert torch.allclose(torch.tensor(fit["losses"]), torch.tensor(base["losses"]), rtol=1e-5, atol=1e-7), name
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(fit["params"], base["params"])), name

    _assert_knobs(_run("gpu", tmp_path, timeout_s=300), close)
