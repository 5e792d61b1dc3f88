"""Every entry of speedkit.compat works against the installed torch and Lightning (2.13 / 2.6 here,
2.11 / 2.6 on the GPU machines): a private name that moved shows up here, not in a user's run."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedkit import compat


def test_dynamo_entries():
    assert compat.dynamo_supported() is True
    before = compat.graph_count()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    fn(torch.ones(3))
    assert compat.graph_count() == before + 1  # the counter the compile rung reads is live
    assert compat.is_compiled_callable(fn)
    assert compat.is_compiled_module(torch.compile(nn.Linear(2, 2), backend="eager"))
    assert not compat.is_compiled_module(nn.Linear(2, 2))
    assert any(e.__name__ == "BackendCompilerFailed" for e in compat.compile_errors())
    assert compat.inductor_cpu_compiler() is not None  # g++ is on every machine of this project


def test_user_compiled_reads_lightnings_compile_context():
    from lightning.pytorch.utilities.compile import from_compiled

    from speedkit.demos import NaiveGPT

    assert compat.user_compiled(from_compiled(torch.compile(NaiveGPT("tiny"), backend="eager")))
    assert not compat.user_compiled(NaiveGPT("tiny"))


def test_optimizer_entries():
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(2))], fused=True)  # fused AdamW runs on the CPU since torch 2.4
    assert getattr(opt, compat.AMP_SCALING_FLAG) is True  # what the fused constructor sets, as the rung does


def test_step_counters_live_on_the_device_only_for_fused_or_capturable_groups():
    param = torch.empty(3, device="meta")  # a device other than the CPU, without a GPU
    assert compat.step_counter_device({"fused": True, "capturable": False}, param) == torch.device("meta")
    assert compat.step_counter_device({"fused": None, "capturable": True}, param) == torch.device("meta")
    for plain in ({"fused": None, "foreach": True, "capturable": False}, {"lr": 0.1}):
        assert compat.step_counter_device(plain, param) == torch.device("cpu")


def test_hooks_and_pytree():
    lin = nn.Linear(2, 2)
    assert not compat.has_hooks(lin)
    handle = lin.register_forward_hook(lambda *a: None)
    assert compat.has_hooks(lin)
    handle.remove()
    assert compat.tree_map(lambda t: t * 2, {"a": [torch.ones(1)]})["a"][0].item() == 2
    assert isinstance(compat.cpu_has_bf16(), bool)


def test_cpu_bf16_override_forces_the_answer_either_way(monkeypatch):
    from speedkit.errors import ConfigError

    try:
        for value, expected in (("1", True), ("0", False)):
            monkeypatch.setenv(compat.CPU_BF16_OVERRIDE, value)
            compat.cpu_has_bf16.cache_clear()
            assert compat.cpu_has_bf16() is expected
        monkeypatch.setenv(compat.CPU_BF16_OVERRIDE, "yes")
        compat.cpu_has_bf16.cache_clear()
        with pytest.raises(ConfigError, match=r"SPEEDKIT_CPU_BF16: expected 1 .* or 0 .*, found 'yes'"):
            compat.cpu_has_bf16()
        monkeypatch.delenv(compat.CPU_BF16_OVERRIDE)
        compat.cpu_has_bf16.cache_clear()
        assert compat.cpu_has_bf16() is compat.cpu_bf16_instructions()  # unset: what oneDNN says
    finally:
        monkeypatch.undo()  # the answer cached next is the suite's own (forced either way, or the CPU's)
        compat.cpu_has_bf16.cache_clear()


def test_trial_loader_leaves_the_users_live_iterator_alone():
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=1, persistent_workers=True)
    live = iter(loader)
    copy = compat.trial_loader(loader)
    assert copy is not loader and copy.dataset is loader.dataset and copy.sampler is loader.sampler
    assert [b[0].tolist() for b in copy] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert loader._iterator is live and copy._iterator is not live
    compat.shutdown_workers(copy)
    assert copy._iterator is None and loader._iterator is live
    assert next(live)[0].tolist() == [0.0, 1.0]  # the user's iterator never moved
    compat.shutdown_workers(loader)


class _LoggingModel(pl.LightningModule):
    """One Linear trained on ``samples`` random pairs in batches of 4, logging its loss to the progress bar."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.samples = samples

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(self.samples, 2)), batch_size=4)


def test_lightning_entries_inside_a_fit():
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            batch = compat.lightning_before_batch_transfer(trainer, module, (torch.ones(4, 2),))
            seen["batch"] = batch[0].shape
            results = trainer.fit_loop.epoch_loop._results
            with compat.lightning_trial_logging(trainer, module) as log:
                assert log is not None and trainer.fit_loop.epoch_loop._results is not results
                log.batch((torch.ones(4, 2),))
                module.training_step((torch.ones(4, 2),), 0)
                log.step_done()
                seen["scratch"] = set(log.results.keys())
            seen["restored"] = trainer.fit_loop.epoch_loop._results is results

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe()],
    )
    trainer.fit(_LoggingModel(8))
    assert seen["batch"] == (4, 2)
    assert seen["scratch"] == {"training_step.loss"} and seen["restored"]
    assert "loss" in trainer.callback_metrics  # the real step logged as usual


def test_runs_compiled_code_sees_each_way_a_module_is_compiled():
    from speedkit.rungs.compile import CompileOptions, apply_compile

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert not compat.runs_compiled_code(net)
    net[0].compile(backend="eager")  # nn.Module.compile()
    assert compat.runs_compiled_code(net)
    assert compat.runs_compiled_code(nn.Sequential(torch.compile(nn.Linear(4, 4), backend="eager")))
    plain = nn.Sequential(nn.Linear(4, 4))
    handle, _ = apply_compile(plain, CompileOptions(backend="eager"))
    assert compat.runs_compiled_code(plain)
    handle.undo()
    assert not compat.runs_compiled_code(plain)


def test_lightning_profiler_action_names_are_labelled():
    """The names Lightning passes to ``trainer.profiler``: the fit check names the fetch of the next
    batch and the hooks of callbacks and of the module from them."""
    from lightning.pytorch.profilers import SimpleProfiler

    class Hooked(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            pass

    profiler = SimpleProfiler()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Hooked()],
        profiler=profiler,
    )
    trainer.fit(_LoggingModel(8))
    labels = {compat.lightning_action_label(a) for a in profiler.recorded_durations}
    assert ("fetch", "fetching the next batch") in labels
    assert ("callback", "Hooked.on_train_batch_end") in labels
    assert ("module", "_LoggingModel.on_train_batch_end") in labels
    assert compat.lightning_action_label("[Callback]ModelCheckpoint{'monitor': 'val/loss', 'x': 0.5}.on_train_batch_end") == (
        "callback",
        "ModelCheckpoint.on_train_batch_end",
    )
    assert compat.lightning_action_label("run_training_batch") == ("other", "run_training_batch")
    assert compat.lightning_action_label("[Strategy]SingleDeviceStrategy.batch_to_device")[0] == "transfer"
    assert compat.lightning_action_label("[Callback]ModelCheckpoint{}.on_validation_end")[0] == "validation"
    assert compat.lightning_action_label("[_EvaluationLoop].val_next")[0] == "validation"


def test_lightning_entries_a_replayed_step_uses():
    """What a CUDA graph of the step needs from Lightning's loop: the automatic optimization's
    ``run``, its progress counters (``global_step``), ``self.log`` recorded and made outside the step."""
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx != 1:
                return
            assert callable(compat.lightning_automatic_optimization(trainer).run)
            before = trainer.global_step
            progress = compat.lightning_optimizer_progress(trainer)
            saved = progress.state_dict()
            compat.lightning_count_optimizer_step(trainer)
            seen["counted"] = trainer.global_step - before
            progress.load_state_dict(saved)
            seen["restored"] = trainer.global_step == before
            logs: list = []
            with compat.recording_logs(module, logs):
                module.training_step(batch, batch_idx)
            seen["recorded"] = [(args[0], kwargs) for args, kwargs, where in logs]
            seen["where"] = logs[0][2]
            with compat.lightning_logging_as(module, "training_step"):
                module.log("replayed", torch.tensor(3.0))
            seen["log_is_back"] = "log" not in module.__dict__

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe()],
    )
    trainer.fit(_LoggingModel(16))
    assert seen["counted"] == 1 and seen["restored"]
    assert seen["recorded"] == [("loss", {"prog_bar": True})] and "test_compat.py" in seen["where"]
    assert seen["log_is_back"] and float(trainer.callback_metrics["replayed"]) == 3.0
    assert trainer.global_step == 3
    with pytest.raises(RuntimeError, match="automatic_optimization"):
        compat.lightning_automatic_optimization(object())


def test_a_metrics_update_count_is_put_back():
    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.MeanMetric()
    for value in (1.0, 2.0, 3.0):
        metric.update(torch.tensor(value))
    metric.reset()
    compat.set_metric_update_count(metric, 3)
    assert metric.update_count == 3


def test_compile_seconds_and_cache_counts_read_dynamos_own_figures():
    """A compiled function's first call: Dynamo's timings grow and Inductor's and AOTAutograd's cache
    counters say whether the graph came from their caches (hit) or was compiled (miss or bypass);
    ``since`` gives what one stretch of the run did. The same function again compiles nothing."""
    import torch._dynamo

    torch._dynamo.reset()
    before_s, before = compat.compile_seconds(), compat.compile_cache_counts()
    assert set(before) == {
        "fxgraph_cache_hit",
        "fxgraph_cache_miss",
        "fxgraph_cache_bypass",
        "autograd_cache_hit",
        "autograd_cache_miss",
        "autograd_cache_bypass",
    }
    fn = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager")
    x = torch.randn(5, requires_grad=True)
    fn(x).backward()
    assert compat.compile_seconds() > before_s
    stretch = compat.compile_cache_counts(since=before)
    assert all(v >= 0 for v in stretch.values())
    again = compat.compile_cache_counts()
    fn(x).backward()
    assert compat.compile_cache_counts(since=again) == dict.fromkeys(again, 0)


def test_the_profilers_own_stderr_lines_are_dropped_and_the_rest_pass(capfd):
    """kineto prints "USDT:... profiler_start" (and a CUDA probe's ERROR on a CPU) at each profile
    window's start and stop, straight to file descriptor 2, into the user's console."""
    import os

    from speedkit import compat

    with compat.kineto_lines_dropped():
        os.write(2, b"USDT:2026-11-29 08:07:21 15956:15956 SyncActivityProfilerHandler.cpp:39] profiler_start\n")
        os.write(2, b"ERROR:2026-11-29 08:07:21 15956:15956 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n")
        os.write(2, b"the user's own line\n")
        os.write(2, b"ERROR: a line of the user's that only looks alike\n")
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "gpuGetDeviceCount" not in err
    assert err == "the user's own line\nERROR: a line of the user's that only looks alike\nafter\n", err


def test_cupti_is_detached_after_a_window_and_the_environment_restored(monkeypatch):
    """kineto reads TEARDOWN_CUPTI when a CUDA profile stops: set for the window only, the user's own
    value (or torch's, for its CUDA graphs) left alone, and never on a CUDA where detaching is unsafe."""
    monkeypatch.delenv(compat.CUPTI_TEARDOWN_VARIABLE, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with compat.cupti_detached_after() as left_attached:
        assert left_attached is None
        assert os.environ[compat.CUPTI_TEARDOWN_VARIABLE] == "1"
    assert compat.CUPTI_TEARDOWN_VARIABLE not in os.environ

    monkeypatch.setenv(compat.CUPTI_TEARDOWN_VARIABLE, "0")
    with compat.cupti_detached_after() as left_attached:
        assert os.environ[compat.CUPTI_TEARDOWN_VARIABLE] == "0"
        assert left_attached == "TEARDOWN_CUPTI=0 in the environment"
    assert os.environ[compat.CUPTI_TEARDOWN_VARIABLE] == "0"

    monkeypatch.delenv(compat.CUPTI_TEARDOWN_VARIABLE)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with compat.cupti_detached_after() as left_attached:
        assert compat.CUPTI_TEARDOWN_VARIABLE not in os.environ
        assert "12.4" in left_attached
    monkeypatch.setattr(torch.version, "cuda", None)
    assert compat.cupti_teardown_safe()
