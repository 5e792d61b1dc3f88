"""SpeedLadder inside a real (CPU) Lightning Trainer: trials in the user's own fit, given rungs,
nothing left behind after an exception, Ctrl-C or SIGTERM."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedkit.demos import NaiveGPT, SyntheticTokens
from speedkit.errors import ConfigError
from speedkit.lightning import SpeedLadder, StepTimer
from speedkit.rungs.compile import GuardedForward

#: small and quick: the decisions are not what these tests are about
QUICK = {
    "warmup": 1,
    "steps": 2,
    "repeats": 2,
    "parity_steps": 2,
    "min_blocks": 2,
    "max_blocks": 2,
    "budget_s": 60.0,
    "holds_windows": 1,
    "telemetry": False,
    "profile": False,
}


class UserModel(pl.LightningModule):
    """Wrapped the way people write it: ``self.model``, a training step that logs, AdamW with a
    OneCycleLR sized from ``self.trainer.estimated_stepping_batches``, a shuffled loader."""

    def __init__(self, n: int = 192, dim: int = 16, classes: int = 5, batch_size: int = 4, workers: int = 0) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(32), nn.Linear(32, classes))
        g = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g))
        self.batch_size, self.workers = batch_size, workers
        self.calls = 0
        self.raise_at: tuple[int, BaseException] | None = None

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.raise_at is not None and self.calls == self.raise_at[0]:
            if isinstance(self.raise_at[1], int):
                os.kill(os.getpid(), self.raise_at[1])  # a real signal, handled where it lands
            else:
                raise self.raise_at[1]
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        self.opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=1e-2, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(
            self.data, batch_size=self.batch_size, shuffle=True, num_workers=self.workers, persistent_workers=self.workers > 0
        )


class Recorder(pl.Callback):
    """What the real training steps saw: each micro-batch's loss, the data order, the learning rate."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_rows: list[torch.Tensor] = []
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        self.first_rows.append(batch[0][0].clone())
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def _trainer(callbacks, **kwargs):
    defaults = dict(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(**{**defaults, **kwargs}, callbacks=callbacks)


USER_RUN = dict(precision="bf16-mixed", accumulate_grad_batches=4, gradient_clip_val=1.0)


@pytest.fixture(autouse=True)
def _signals_back():
    """Lightning ignores SIGINT after a KeyboardInterrupt; SIGTERM handlers must come back too."""
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGINT, sigint)
    signal.signal(signal.SIGTERM, sigterm)


@pytest.fixture
def no_interpreter(monkeypatch):
    """A user's CPU has no Triton interpreter on; the tests' conftest turns it on for kernel tests."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _fit_user_model(ladder, recorder=None, seed=0, **kwargs):
    pl.seed_everything(seed, verbose=False)
    model = UserModel(workers=kwargs.pop("workers", 0))
    trainer = _trainer([ladder, *([recorder] if recorder else [])], **{**USER_RUN, **kwargs})
    trainer.fit(model)
    return model, trainer


def _explicit(result):
    return [{"name": r.name, "options": r.options} for r in result.kept]


@pytest.mark.parametrize("forced", [True, False], ids=["kept-rungs-forced", "real-decisions"])
def test_trials_in_the_users_trainer_then_training_matches_the_kept_rungs_given_explicitly(forced, monkeypatch, no_interpreter):
    if forced:  # real trials and restores; only the keep decision is fixed, so real rungs stay on
        monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("kept", "forced by the test"))
    with_trials, recorded = SpeedLadder(trials="always", measure=QUICK), Recorder()
    model, trainer = _fit_user_model(with_trials, recorded)
    result = with_trials.result
    assert result is not None and result.interrupted is None
    assert result.run["precision"] == "bf16-mixed" and result.run["accumulate_grad_batches"] == 4
    assert result.run["gradient_clip_val"] == 1.0 and result.run["lr_schedulers"] == ["OneCycleLR"]
    statuses = {r.name: r.status for r in result.rungs[1:]}
    assert statuses["autocast"] == "not_applicable"  # the user chose bf16-mixed
    if forced:
        assert {"fused_optimizer", "compile"} <= {r.name for r in result.kept}, [
            (r.name, r.status, r.reason) for r in result.rungs
        ]
    # trials took no real step; merged micro-batches (micro_batch kept: all 4 of a step in one, on a CPU) are
    # fewer, larger batches to the fit loop
    merged = 4 if "micro_batch" in {r.name for r in result.kept} else 1
    assert trainer.global_step == 6 and len(recorded.losses) == 24 // merged
    explicit, replayed = SpeedLadder(rungs=_explicit(result)), Recorder()
    _fit_user_model(explicit, replayed)
    assert set(explicit.applied_changes) == {r.name for r in result.kept}
    assert recorded.losses == replayed.losses  # exactly: same weights, optimizer, schedule, RNG, data order
    assert recorded.lrs == replayed.lrs
    assert all(torch.equal(a, b) for a, b in zip(recorded.first_rows, replayed.first_rows))
    # everything undone after fit
    assert "forward" not in model.__dict__ and model.opt.param_groups[0]["fused"] is None
    torch.save(model, io.BytesIO())


def test_trials_leave_the_data_order_of_a_persistent_workers_loader(no_interpreter):
    plain, with_trials = Recorder(), Recorder()
    _fit_user_model(SpeedLadder(rungs=[]), plain, workers=1, max_steps=3)
    _fit_user_model(SpeedLadder(rungs=["fused_optimizer"], trials="always", measure=QUICK), with_trials, workers=1, max_steps=3)
    assert all(torch.equal(a, b) for a, b in zip(plain.first_rows, with_trials.first_rows)) and len(plain.first_rows) == 12


class _TwoShuffledLoaders(pl.LightningModule):
    """A dict of two train loaders, each shuffling from a generator of its own (Lightning combines them)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = sum(F.cross_entropy(self.net(x), y) for x, y in batch.values())
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        def loader(n: int, seed: int) -> DataLoader:
            g = torch.Generator().manual_seed(seed)
            data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
            return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(seed + 1))

        return {"a": loader(64, 0), "b": loader(40, 5)}


def test_trials_put_back_the_generators_of_every_combined_loader():
    """Trials iterate copies of each combined loader, which share its generator: each one's state is
    put back, so the fit after them draws what the plain fit draws (the losses are equal)."""

    def fit(callbacks: list) -> list[float]:
        pl.seed_everything(0, verbose=False)
        model = _TwoShuffledLoaders()
        trainer = pl.Trainer(
            max_epochs=2,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        trainer.fit(model)
        return model.losses[-trainer.global_step :]

    plain = fit([])
    with_trials = fit([SpeedLadder(rungs=["fused_optimizer"], trials="always", measure=QUICK)])
    assert len(plain) == 16 and with_trials == plain


class _PaddedSequences(pl.LightningModule):
    """Token sequences of 4 to 16 tokens, each batch padded to its longest (``attention_mask``): the
    way Hugging Face's data collators feed language models."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(1, 32, (int(n),), generator=g) for n in torch.randint(4, 17, (96,), generator=g)]

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        loss = F.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten(), reduction="none")
        return (loss * batch["attention_mask"].flatten()).sum() / batch["attention_mask"].sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        def pad(rows):
            ids = nn.utils.rnn.pad_sequence(rows, batch_first=True)
            return {"input_ids": ids, "attention_mask": (ids != 0).long()}

        return DataLoader(self.rows, batch_size=4, collate_fn=pad)


def test_trials_on_padded_batches_time_both_configurations_on_the_same_batches(no_interpreter, tmp_path):
    from speedkit.lightning import SpeedProfiler
    from speedkit.report import write_report

    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "profile": True}, report_dir=tmp_path / "report"
    )
    _trainer([ladder, SpeedProfiler()], max_steps=4).fit(_PaddedSequences())
    assert ladder.result is not None and "same batches" in ladder.result.run["batch_shapes"]
    # the report SpeedLadder wrote beside the fit: its profile, its traces, and the fit so far by SpeedProfiler's clock
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (
        report["profile"]["windows"][0]["label"] == "baseline" and (tmp_path / "report" / "traces" / "baseline.json.gz").is_file()
    )
    assert report["fit_monitor"]["steps"] >= 1 and "SpeedProfiler" in report["fit_monitor"]["note"]
    assert (tmp_path / "report" / "report.html").is_file()
    written = write_report(ladder.result, tmp_path, formats=("md",))
    assert 'batch_shapes="vary: each A/B block times both configurations on the same batches"' in written["md"].read_text()


class StepWallTimes(pl.Callback):
    """Each optimizer step's wall time, from one step's end to the next's, once the trials are done; put
    after SpeedLadder, so what its own ``on_train_batch_end`` does (the fit check, the report) is counted."""

    def __init__(self, ladder: SpeedLadder) -> None:
        self.ladder, self.times, self.last, self.report_step = ladder, [], None, None
        self.before = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import time

        now = time.perf_counter()
        if self.ladder.result is not None and self.last is not None:
            self.times.append(now - self.last)
            if self.report_step is None and self.ladder.result.holds is not None:
                self.report_step = len(self.times) - 1  # the step where the fit check ended and the report began
        self.last = now


def test_the_report_is_written_beside_the_fit_and_no_step_after_the_trials_stalls(tmp_path):
    """On an H200 the report, written inside the step where the fit check ended, stopped the fit 1.4-3.6 s
    (0.3 s on a CPU, most of it matplotlib). It is written on a thread of its own; the fit ends with it whole."""
    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "profile": True}, report_dir=tmp_path / "r"
    )
    walls = StepWallTimes(ladder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a stall, not two intra-op threads spinning against the report's process on 2 cores
    try:
        _trainer([ladder, walls], max_steps=60).fit(UserModel(n=2048))
    finally:
        torch.set_num_threads(threads)
    assert walls.report_step is not None and len(walls.times) - walls.report_step >= 10, walls.times
    median = sorted(walls.times)[len(walls.times) // 2]
    worst = max(walls.times)
    assert worst <= median + 0.050, f"a step took {worst * 1e3:.1f} ms against a median of {median * 1e3:.1f} ms"
    for name in ("report.json", "report.md", "report.html"):  # whole once fit returned
        assert (tmp_path / "r" / name).is_file()
    assert json.loads((tmp_path / "r" / "report.json").read_text())["holds"] is not None


def _model_fingerprint(model):
    return {
        "values": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "ids": [id(p) for p in model.parameters()],
        "instance": {
            n: sorted(k for k in m.__dict__ if k in ("forward", "log", "log_dict", "training_step"))
            for n, m in model.named_modules()
        },
        "classes": [type(m) for m in model.modules()],
    }


def _assert_untouched(model, before, values=True):
    after = _model_fingerprint(model)
    if values:
        for k, v in before["values"].items():
            assert torch.equal(v, after["values"][k]), k
    assert after["ids"] == before["ids"] and after["classes"] == before["classes"]
    assert after["instance"] == before["instance"]
    group = model.opt.param_groups[0]
    assert group["fused"] is None and group["foreach"] is None and "_step_supports_amp_scaling" not in model.opt.__dict__
    torch.save(model, io.BytesIO())


@pytest.mark.parametrize(
    "when, error, raised",
    [
        ("trial", RuntimeError("user bug in training_step"), RuntimeError),
        ("trial", KeyboardInterrupt(), SystemExit),  # Lightning turns Ctrl-C into sys.exit(1)
        ("trial", signal.SIGTERM, SIGTERMException),  # a real SIGTERM, during the trials
        ("training", RuntimeError("user bug in training_step"), RuntimeError),
    ],
    ids=["exception-in-trial", "ctrl-c-in-trial", "sigterm-in-trial", "exception-in-training"],
)
def test_nothing_is_left_behind(when, error, raised, no_interpreter, monkeypatch):
    monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("kept", "forced by the test"))
    pl.seed_everything(0, verbose=False)
    model = UserModel()
    before = _model_fingerprint(model)
    sigterm_before = signal.getsignal(signal.SIGTERM)
    ladder = SpeedLadder(
        rungs=["fused_optimizer", {"name": "compile", "options": {"backend": "eager"}}], trials="always", measure=QUICK
    )

    class RaiseInTraining(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                pl_module.raise_at = (pl_module.calls + 1, error)

    if when == "trial":
        model.raise_at = (12, error)  # the 12th training_step call: inside the trials
    trainer = _trainer([ladder] + ([RaiseInTraining()] if when == "training" else []), **USER_RUN)
    with pytest.raises(raised):
        trainer.fit(model)
    assert isinstance(ladder.exception, (type(error) if not isinstance(error, int) else SIGTERMException))
    _assert_untouched(model, before, values=when == "trial")  # trained weights differ after real steps
    assert signal.getsignal(signal.SIGTERM) in (sigterm_before, signal.SIG_DFL) or callable(signal.getsignal(signal.SIGTERM))
    if when == "trial":
        assert ladder.result.interrupted is not None and ladder.applied == []


def test_given_rungs_apply_during_fit_without_trials_and_are_undone_after(bf16_cpu):
    matmul_before = torch.get_float32_matmul_precision()
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                seen.update(
                    plugin=type(trainer.strategy.precision_plugin).__name__,
                    precision=trainer.precision,
                    forward=pl_module.__dict__.get("forward"),
                    fused=trainer.optimizers[0].param_groups[0].get("fused"),
                )

    torch.manual_seed(0)
    model = NaiveGPT("tiny")
    ladder = SpeedLadder(rungs=["autocast", "fused_optimizer", {"name": "compile", "options": {"backend": "eager"}}])
    trainer = _trainer([ladder, Probe()], max_steps=3)
    trainer.fit(model, datamodule=SyntheticTokens(batch_size=2, seq_len=16, length=64))
    assert ladder.result is None  # no trials
    assert seen["plugin"] == "ClippingMixedPrecision" and seen["precision"] == "bf16-mixed"
    assert seen["fused"] is True and isinstance(seen["forward"], GuardedForward)
    assert "forward" not in model.__dict__
    assert type(trainer.strategy.precision_plugin).__name__ == "Precision"
    assert trainer.optimizers[0].param_groups[0]["fused"] is None
    assert torch.get_float32_matmul_precision() == matmul_before
    assert set(ladder.state_dict()["applied"]) >= {"fused_optimizer", "compile"}


def test_user_precision_is_left_alone():
    torch.manual_seed(0)
    ladder = SpeedLadder(rungs=["autocast"])
    trainer = _trainer([ladder], max_steps=2, precision="bf16-mixed")
    trainer.fit(NaiveGPT("tiny"), datamodule=SyntheticTokens(batch_size=2, seq_len=16, length=64))
    assert "bf16-mixed" in ladder.skipped["autocast"]


def test_teardown_keeps_what_each_change_counted_in_the_fit(monkeypatch):
    """A change's report lines and its counts (Handle.counts) are read at teardown: printed, and kept in
    ``fit_reports`` / ``fit_counts`` for a program (bench/ddp.py reads a CUDA graph's replays there)."""
    from speedkit.rungs.fused_optimizer import FusedOptimizerRung

    applied = FusedOptimizerRung.apply

    def apply(self, state):
        handle = applied(self, state)
        handle.report = lambda: ["did 3 things", ""]
        handle.counts = lambda: {"things": 3, "stopped": None}
        return handle

    monkeypatch.setattr(FusedOptimizerRung, "apply", apply)
    torch.manual_seed(0)
    ladder = SpeedLadder(rungs=["fused_optimizer", "tf32"])
    trainer = _trainer([ladder], max_steps=2)
    trainer.fit(NaiveGPT("tiny"), datamodule=SyntheticTokens(batch_size=2, seq_len=16, length=64))
    assert ladder.fit_reports == {"fused_optimizer": ["did 3 things"]}
    assert ladder.fit_counts == {"fused_optimizer": {"things": 3, "stopped": None}}  # tf32 counts nothing


def test_user_compile_is_left_alone():
    """A model passed as trainer.fit(torch.compile(model)) carries Lightning's compile context."""
    from lightning.pytorch.utilities.compile import from_compiled

    from speedkit.rungs import make
    from speedkit.training.state import TrainState

    model = from_compiled(torch.compile(NaiveGPT("tiny"), backend="eager"))
    state = TrainState(model=model, optimizer=None, device=torch.device("cpu"))
    assert "compiled by the user" in make("compile").check(state)


def test_the_fit_check_times_the_real_steps_after_the_trials(no_interpreter):
    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 1, "steps": 2, "holds_windows": 2}
    )
    _fit_user_model(ladder, max_steps=8)
    holds = ladder.result.holds
    assert holds is not None and holds.fit is not None and len(holds.fit.window_ms) == 2
    assert holds.ladder is ladder.result.final_measurement and holds.gap == pytest.approx(
        holds.fit.step_ms / holds.ladder.step_ms - 1
    )
    assert holds.fit.data_wait_ms is not None and holds.fit.host_ms is not None


class _Compiles(pl.Callback):
    """Stands in for torch.compile compiling inside the fit's steps: the graph counter the
    measurement reads goes up at the fit's batches ``at`` (1-based; None: every batch)."""

    def __init__(self, monkeypatch, at: set[int] | None) -> None:
        from speedkit import compat

        self.graphs, self.batches, self.at = 0, 0, at
        monkeypatch.setattr(compat, "graph_count", lambda: self.graphs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1
        if self.at is None or self.batches in self.at:
            self.graphs += 1


def test_the_fit_check_leaves_out_windows_in_which_torch_compile_compiled(monkeypatch, no_interpreter):
    """On the H100 a compiled Hugging Face GPT-2 met, in the fit, a sequence length outside the
    range its graphs covered: one compilation of about 25 s in the check's first windows read as a
    step 57x slower than the trials. Such a window is left out and another timed in its place."""
    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 1, "steps": 2, "holds_windows": 2}
    )
    compiles = _Compiles(monkeypatch, at={9})  # 4 micro-batches a step: warm-up step 1, windows (2, 3) (4, 5) (6, 7)
    _fit_user_model(ladder, compiles, max_steps=12)
    holds = ladder.result.holds
    assert compiles.batches == 48 and compiles.graphs == 1
    assert holds.fit is not None and len(holds.fit.window_ms) == 2
    assert "torch.compile compiled 1 new graph in 1 of the fit's timed windows" in holds.note
    assert "left out" in holds.note and (holds.cause is None or "compiled" not in holds.cause)


def test_the_fit_check_names_compilation_where_every_window_compiled(monkeypatch, no_interpreter):
    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 1, "steps": 2, "holds_windows": 2}
    )
    compiles = _Compiles(monkeypatch, at=None)
    _fit_user_model(ladder, compiles, max_steps=12)
    holds = ladder.result.holds
    assert holds.fit is not None and len(holds.fit.window_ms) == 3  # it stopped looking after 3 windows left out
    # the cause where the gap was flagged for the compiling, else the note (a 2-core CPU's speed may differ
    # by 20% between the trials and the fit, and the gap be flagged for that)
    said = f"{holds.cause or ''} {holds.note or ''}"
    assert "torch.compile compiled 24 new graphs in 3 of the fit's timed windows" in said
    assert "in every window timed: it compiles again as the inputs change" in said


def test_a_fit_that_ends_in_a_compiling_window_does_not_call_it_every_window(monkeypatch, no_interpreter):
    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 1, "steps": 2, "holds_windows": 1}
    )
    compiles = _Compiles(monkeypatch, at={5})
    _fit_user_model(ladder, compiles, max_steps=3)  # warm-up step 1, one window (2, 3): it compiled
    holds = ladder.result.holds
    # what the report says of it: the cause where the gap was flagged for the compiling, else the note
    # (a 2-core CPU's speed may differ by 20% between the trials and the fit and be flagged for that)
    said = f"{holds.cause or ''} {holds.note or ''}"
    assert "every window" not in said
    if "compiled" in (holds.cause or "") or not holds.flagged:
        assert "compiled 1 new graph in 1 of the fit's timed windows" in said
    assert "0 of 1 windows without compiling (the fit ended)" in holds.note


class _SlowBatchEnd(pl.Callback):
    """A user's callback whose batch-end hook takes 5 ms of a fake host clock (an EMA of the
    weights, say): on the H100, timm ConvNeXt-T with Lightning's WeightAveraging read +16.9% in the
    fit, 6.9 ms/step between steps against 0.8 in the trials, which do not run the callbacks."""

    def __init__(self) -> None:
        self.now, self.calls = 0.0, 0

    def clock(self) -> float:
        return self.now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.now += 0.005
        self.calls += 1


@pytest.mark.parametrize("user_profiler", [False, True], ids=["no-profiler", "simple-profiler"])
def test_the_fit_check_names_the_hook_that_takes_the_time_between_steps(user_profiler, monkeypatch, no_interpreter):
    from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

    from speedkit.lightning.speed_ladder import _HoldsProbe

    slow = _SlowBatchEnd()
    monkeypatch.setattr(_HoldsProbe, "host_clock", staticmethod(slow.clock))
    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 1, "steps": 2, "holds_windows": 2}
    )
    profiler = SimpleProfiler() if user_profiler else None
    _, trainer = _fit_user_model(ladder, slow, max_steps=8, profiler=profiler)
    holds = ladder.result.holds
    assert holds.fit is not None and len(holds.fit.window_ms) == 2
    # 4 micro-batches a step, each 5 ms in the callback; nothing else moves the fake clock
    assert holds.between_ms == {"[Callback]_SlowBatchEnd.on_train_batch_end": pytest.approx(20.0)}
    assert holds.fit.data_wait_ms == pytest.approx(20.0)
    assert isinstance(trainer.profiler, SimpleProfiler if user_profiler else PassThroughProfiler)  # given back
    if user_profiler:  # the user's profiler saw every call, the check's steps included
        assert profiler is trainer.profiler
        assert len(profiler.recorded_durations["[Callback]_SlowBatchEnd.on_train_batch_end"]) == slow.calls == 32


def test_the_fit_check_counts_the_steps_lightning_takes_at_an_epochs_short_end(monkeypatch, no_interpreter):
    """7 batches an epoch, 4 accumulated: Lightning steps after batches 3 and 6 (the epoch's last);
    the check's step boundaries are those, not every 4th batch counted across the epoch's end."""
    from speedkit.lightning.speed_ladder import _HoldsProbe

    seen: list[tuple[bool, int]] = []
    ended = _HoldsProbe.batch_ended

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if seen:
                seen[-1] = (seen[-1][0], trainer.global_step)

    def record(self, step_done):
        seen.append((step_done, -1))
        return ended(self, step_done)

    monkeypatch.setattr(_HoldsProbe, "batch_ended", record)
    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 1, "steps": 2, "holds_windows": 3}
    )
    _fit_user_model(ladder, Steps(), max_steps=12, limit_train_batches=7)
    assert len(seen) >= 8
    steps = [global_step for _, global_step in seen]
    taken = [done for done, _ in seen]
    # a batch ended a step exactly where the Trainer's global_step moved
    assert taken[1:] == [b > a for a, b in zip(steps, steps[1:])]
    assert taken.count(True) > 0 and not all(taken)


def test_the_fit_check_gives_the_profiler_back_when_the_fit_fails(monkeypatch, no_interpreter):
    from lightning.pytorch.profilers import PassThroughProfiler

    class Fails(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step >= 2:
                raise RuntimeError("the user's callback failed")

    ladder = SpeedLadder(
        rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 1, "steps": 2, "holds_windows": 2}
    )
    pl.seed_everything(0, verbose=False)
    trainer = _trainer([ladder, Fails()], max_steps=8, **USER_RUN)
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        trainer.fit(UserModel())
    assert isinstance(trainer.profiler, PassThroughProfiler)


def test_the_fit_check_waits_out_the_warm_up_kept_rungs_need_in_the_fit(monkeypatch, no_interpreter):
    """A CUDA graph kept in the trials warms up and captures again in the fit's first steps (H100,
    HF T5 with measure.warmup 2: the capture step, 157 ms against 16, fell in the first window and
    read as +230%); the check's warm-up is the longer of measure.warmup and the kept rungs' settle."""
    from speedkit.rungs.fused_optimizer import FusedOptimizerRung

    monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("kept", "forced by the test"))
    apply = FusedOptimizerRung.apply

    def settling(self, state):
        handle = apply(self, state)
        handle.settle_steps = 4
        return handle

    monkeypatch.setattr(FusedOptimizerRung, "apply", settling)
    ladder = SpeedLadder(rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 1, "steps": 2})
    _fit_user_model(ladder, max_steps=5)
    assert ladder.result.holds.fit is None
    assert "needs 6 (the kept rungs' warm-up + measure.steps)" in ladder.result.holds.note


def test_a_fit_too_short_to_time_says_so(no_interpreter):
    ladder = SpeedLadder(rungs=["fused_optimizer"], trials="always", measure={**QUICK, "warmup": 3, "steps": 5})
    _fit_user_model(ladder, max_steps=2)
    assert ladder.result.holds.fit is None and "needs 8" in ladder.result.holds.note


def test_one_callback_serves_two_fits_then_a_manual_optimization_one(no_interpreter):
    ladder = SpeedLadder(rungs=["fused_optimizer"], trials="always", measure=QUICK)
    for _ in range(2):  # the second fit runs its own trials; nothing of the first is applied again
        model, _ = _fit_user_model(ladder, max_steps=2)
        assert ladder.result is not None and ladder.applied == [] and model.opt.param_groups[0]["fused"] is None

    class Manual(UserModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = F.cross_entropy(self.model(batch[0]), batch[1])
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()

    model = Manual()
    _trainer([ladder], max_steps=2).fit(model)  # its own trials, of its whole training_step
    assert ladder.not_run is None and ladder.result is not None and ladder.result.run["optimization"] == "manual"
    fused = next(r for r in ladder.result.rungs if r.name == "fused_optimizer")
    assert fused.status in ("kept", "reverted") and fused.parity.passed, fused.reason  # one optimizer: its flags
    assert model.opt.param_groups[0]["fused"] is None  # undone after the fit


def test_optimizer_rungs_with_no_optimizer_or_several(no_interpreter):
    class TwoOptimizers(UserModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            first, second = self.optimizers()
            self.manual_backward(F.cross_entropy(self.model(batch[0]), batch[1]))
            for opt in (first, second):
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self):
            params = list(self.parameters())
            return [torch.optim.AdamW(params[:2]), torch.optim.AdamW(params[2:])]

    class NoOptimizer(UserModel):
        def configure_optimizers(self):
            return None

    ladder = SpeedLadder(rungs=["fused_optimizer"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's warning that the fit has no optimizer
        _trainer([ladder], max_steps=2).fit(NoOptimizer())
    assert ladder.applied == [] and "configure_optimizers returned None" in ladder.skipped["fused_optimizer"], ladder.skipped

    # several optimizers stepped by the user's own step: each switched, and the cuda_graph rung says why not
    ladder, seen = SpeedLadder(rungs=["fused_optimizer", "cuda_graph"]), []

    class Flags(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append([g["fused"] for opt in trainer.optimizers for g in opt.param_groups])

    module = TwoOptimizers()
    _trainer([ladder, Flags()], max_steps=2).fit(module)
    changes = ladder.applied_changes["fused_optimizer"]
    assert [c.split(":")[0] for c in changes[:2]] == ["optimizer 0 of 2", "optimizer 1 of 2"], changes
    assert seen and all(flags == [True, True] for flags in seen)  # both fused in the fit
    assert "steps the optimizers itself" in ladder.skipped["cuda_graph"]
    assert all(g["fused"] is None for opt in module.trainer.optimizers for g in opt.param_groups)  # undone


def test_state_dict_round_trip_tolerates_missing_keys():
    ladder = SpeedLadder(rungs=["tf32"])
    ladder.load_state_dict({})
    ladder.load_state_dict({"skipped": {"tf32": "no GPU"}, "future_key": 1})
    assert ladder.state_dict()["skipped"] == {"tf32": "no GPU"}


def test_the_callback_pickles_for_strategies_that_spawn_their_processes():
    """``strategy="ddp_spawn"`` pickles the Trainer's callbacks into each process it starts (a
    lambda as the default progress log made that fail before the fit began)."""
    for ladder in (
        SpeedLadder(trials="always"),
        SpeedLadder(rungs=["tf32", {"name": "compile", "options": {"mode": "default"}}]),
    ):
        copy = pickle.loads(pickle.dumps(ladder))
        assert [r.name for r in copy.rungs] == [r.name for r in ladder.rungs] and copy.trials == ladder.trials
        assert copy.on_event is ladder.on_event  # the module-level default, by reference


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ConfigError, match=r"rungs\[0\]"):
        SpeedLadder(rungs=["warp_drive"])
    with pytest.raises(ConfigError, match=r"measure\.steps"):
        SpeedLadder(trials="always", measure={"steps": 0})


def test_step_timer_times_windows_after_warmup():
    torch.manual_seed(0)
    timer = StepTimer(warmup=2, window=3)
    trainer = _trainer([timer], max_steps=2 + 3 * 2)
    trainer.fit(NaiveGPT("tiny"), datamodule=SyntheticTokens(batch_size=2, seq_len=16, length=64))
    assert len(timer.windows_ms) == 2 and timer.step_ms > 0
    assert timer.items_per_step == 32 and timer.throughput_unit == "tokens/s"
    assert timer.session.clock.syncs == 2
    assert timer.measurement.data_wait_ms >= 0 and timer.measurement.host_ms > 0


class ConvModel(pl.LightningModule):
    """A conv classifier with a ``forward`` the step calls and an ``on_train_batch_start`` of its own:
    compile, channels_last and the data path's pull-ahead each set an attribute on it during the fit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
        g = torch.Generator().manual_seed(1)
        self.data = TensorDataset(torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 5, (32,), generator=g))

    def forward(self, x):
        return self.net(x)

    def on_train_batch_start(self, batch, batch_idx):
        return None

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4, shuffle=True)


class CopiesMidFit(pl.Callback):
    """At the third step, copies the module as an EMA or SWA callback does (``copy.deepcopy``) and as
    ``torch.save(module)`` does (pickle), and runs each copy."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != 2:
            return
        import copy

        self.set_by_speedkit = {
            name: type(vars(pl_module)[name]).__name__
            for name in ("forward", "on_train_batch_start", "on_after_batch_transfer")
            if name in vars(pl_module)
        }
        x = batch[0][:3].contiguous()
        copied = copy.deepcopy(pl_module)
        self.copied_attrs_bound_to_the_copy = all(
            getattr(vars(copied)[name], "__self__", None) is copied for name in self.set_by_speedkit
        )
        restored = pickle.loads(pickle.dumps(pl_module))
        with torch.no_grad():
            self.original = pl_module(x)
            self.restored = restored(x)
            for p in copied.parameters():
                p.zero_()
            self.zeroed_copy = copied(x)


def test_the_module_copied_or_pickled_mid_fit_computes_with_its_own_weights(monkeypatch):
    """Rungs set a compiled forward and wrapped hooks as attributes of the user's module. A copy made
    mid-fit (an EMA or SWA callback's deepcopy) gets the module's own forward and hooks bound to the copy,
    so zeroing the copy's weights zeroes its output; before, its forward still ran the original's
    weights through the compiled function. Pickled (torch.save), the module no longer fails on them."""
    from test_data_path import force_prefetch

    force_prefetch(monkeypatch)
    copies = CopiesMidFit()
    ladder = SpeedLadder(
        rungs=[
            "channels_last",
            {"name": "compile", "options": {"backend": "eager"}},
            {"name": "data_path", "options": {"workers": "keep"}},
        ]
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ladder, copies],
    )
    trainer.fit(ConvModel())
    assert copies.set_by_speedkit == {
        "forward": "GuardedForward",
        "on_train_batch_start": "PullAheadAfter",
        "on_after_batch_transfer": "ChannelsLastAfterTransfer",
    }
    assert copies.copied_attrs_bound_to_the_copy
    assert torch.equal(copies.zeroed_copy, torch.zeros_like(copies.original)) and copies.original.abs().sum() > 0
    torch.testing.assert_close(copies.restored, copies.original)


def test_a_checkpoint_saved_with_rungs_applied_loads_strictly_into_the_users_plain_module(tmp_path):
    """ModelCheckpoint saves mid-fit, while the rungs are applied (swapped attention and norm classes,
    a compiled forward, a fused optimizer): the file holds the plain module's keys, shapes and dtypes,
    and loads strictly into a fresh module and the user's own optimizer, leaving its flags its own."""
    torch.manual_seed(0)
    model = NaiveGPT("tiny")
    plain = {k: (v.shape, v.dtype) for k, v in NaiveGPT("tiny").state_dict().items()}
    ladder = SpeedLadder(rungs=["fused_optimizer", "sdpa", "triton_layers", {"name": "compile", "options": {"backend": "eager"}}])
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = _trainer([ladder, every], max_steps=4, enable_checkpointing=True)
    trainer.fit(model, datamodule=SyntheticTokens(batch_size=2, seq_len=16, length=64))
    assert {"fused_optimizer", "sdpa", "triton_layers", "compile"} <= set(ladder.applied_changes), ladder.skipped
    files = sorted(tmp_path.glob("*.ckpt"))
    assert len(files) == 2
    for file in files:
        checkpoint = torch.load(file, map_location="cpu", weights_only=False)
        assert {k: (v.shape, v.dtype) for k, v in checkpoint["state_dict"].items()} == plain
        fresh = NaiveGPT("tiny")
        fresh.load_state_dict(checkpoint["state_dict"], strict=True)
        optimizer = torch.optim.AdamW(fresh.parameters(), lr=3e-4)
        user_flags = {k: optimizer.param_groups[0][k] for k in ("fused", "foreach", "capturable")}
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        assert all(len(optimizer.state[p]) for p in fresh.parameters())
        assert {k: optimizer.param_groups[0][k] for k in user_flags} == user_flags  # not turned fused by the file


def test_a_fit_resumed_from_such_a_checkpoint_gets_the_rungs_again_and_trains_as_without_them(tmp_path):
    """Lightning loads the optimizer's state after the rungs of ``on_fit_start`` applied: the loaded
    state gets the fused switch again, the resumed fit computes what a resumed plain fit computes,
    and the flags are the user's after it."""
    torch.manual_seed(0)
    first = NaiveGPT("tiny")
    data = SyntheticTokens(batch_size=2, seq_len=16, length=64)
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3)
    _trainer([SpeedLadder(rungs=["fused_optimizer"]), saving], max_steps=3, enable_checkpointing=True).fit(first, datamodule=data)
    checkpoint = saving.best_model_path
    fused_in_fit: list[object] = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            fused_in_fit.append(trainer.optimizers[0].param_groups[0].get("fused"))

    losses = {}
    for label, callbacks in (("plain", []), ("ladder", [SpeedLadder(rungs=["fused_optimizer"]), Probe()])):
        torch.manual_seed(1)
        model, record = NaiveGPT("tiny"), Recorder()
        trainer = _trainer([*callbacks, record], max_steps=6)
        trainer.fit(model, datamodule=data, ckpt_path=checkpoint)
        assert trainer.global_step == 6
        losses[label] = record.losses
        if label == "ladder":
            assert fused_in_fit == [True] * 3
            assert trainer.optimizers[0].param_groups[0]["fused"] is None
    assert len(losses["plain"]) == 3
    for a, b in zip(losses["ladder"], losses["plain"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), losses


def test_trials_leave_a_torchmetrics_metric_updated_in_training_step_as_it_was(monkeypatch, no_interpreter):
    """A metric object updated in ``training_step`` and logged ``on_epoch=True`` is neither a parameter
    nor a buffer: the trials' batches accumulated into its state and counted in the first epoch's
    value (train_acc_epoch 0.256 against the plain fit's 0.300)."""
    torchmetrics = pytest.importorskip("torchmetrics")
    monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("reverted", "forced by the test"))

    class WithAccuracy(UserModel):
        def __init__(self):
            super().__init__()
            self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=5)
            self.updates_at_epoch_end: list[int] = []

        def training_step(self, batch, batch_idx):
            logits = self.model(batch[0])
            self.acc(logits, batch[1])
            self.log("acc", self.acc, on_step=True, on_epoch=True)
            return F.cross_entropy(logits, batch[1])

        def on_train_epoch_end(self):
            self.updates_at_epoch_end.append(self.acc.update_count)

    def fit(callbacks):
        pl.seed_everything(0, verbose=False)
        model = WithAccuracy()
        trainer = _trainer(callbacks, max_steps=-1, max_epochs=2, limit_train_batches=5)
        trainer.fit(model)
        return model.updates_at_epoch_end, float(trainer.callback_metrics["acc_epoch"])

    plain = fit([])
    with_trials = fit([SpeedLadder(rungs=["fused_optimizer"], trials="always", measure=QUICK)])
    assert plain[0] == [5, 5] and with_trials == plain


def test_a_callback_serving_a_second_fit_reports_that_fits_rungs_only(monkeypatch, no_interpreter):
    """A rung kept in the first fit and reverted in the second was still listed as applied (in
    ``applied_changes`` and in the checkpoint's ``state_dict()``) after the second fit. Without the
    decision cache: with it, the second fit re-checks the first fit's decision instead of deciding."""
    ladder = SpeedLadder(rungs=["fused_optimizer"], trials="always", measure=QUICK, cache=False)
    for decision in ("kept", "reverted"):
        monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest, d=decision: (d, "forced by the test"))
        _fit_user_model(ladder, max_steps=2)
        assert [r.name for r in ladder.result.kept] == (["fused_optimizer"] if decision == "kept" else [])
        assert list(ladder.applied_changes) == list(ladder.state_dict()["applied"]) == [r.name for r in ladder.result.kept]


class _KeepsTrackOnSelf(UserModel):
    """What users keep on ``self`` from their step: a counter, a list of seen losses, a dict of
    tallies, and a tensor rebound every step (which speedkit cannot put back, and names)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.tally = {"batches": 0}
        self.history = self.seen  # the same list under two names stays one list

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.seen.append(int(batch[1][0]))
        self.tally["batches"] += 1
        self.last_loss = loss.detach()
        return loss


def test_trials_put_back_the_plain_attributes_the_users_step_changes(no_interpreter):
    """A ``self.calls += 1`` in training_step read 2412 after a 30-step fit with trials (30 without)."""
    runs = {}
    for trials in (False, True):
        pl.seed_everything(0, verbose=False)
        model = _KeepsTrackOnSelf()
        seen = model.seen
        ladder = SpeedLadder(rungs=["fused_optimizer"], trials="always" if trials else False, measure=QUICK)
        _trainer([ladder], **USER_RUN).fit(model)
        assert model.seen is seen and model.history is model.seen  # put back in place, never replaced
        runs[trials] = (model.calls, list(model.seen), dict(model.tally), ladder)
    assert runs[True][:3] == runs[False][:3] and runs[False][0] == 24  # 6 steps x 4 accumulated batches
    result = runs[True][3].result
    assert {"_KeepsTrackOnSelf.calls", "_KeepsTrackOnSelf.seen", "_KeepsTrackOnSelf.tally"} <= set(
        result.run["attributes_restored"]
    )
    assert result.run["attributes_not_restored"] == ["_KeepsTrackOnSelf.last_loss (Tensor)"]


class _FusedClipped(UserModel):
    """Clips in ``configure_gradient_clipping`` and trains with a fused SGD (as the cuda_graph rung
    leaves an SGD with a schedule, fused so its update can be captured)."""

    def configure_optimizers(self):
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=True)
        return self.opt

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.25, gradient_clip_algorithm="norm")


def test_autocast_in_bf16_clips_before_a_fused_optimizer_which_lightnings_plugin_refuses(bf16_cpu):
    """Lightning's MixedPrecision refuses clipping with a fused optimizer, for fear of clipping scaled
    gradients; bf16 scales nothing. The autocast rung's plugin clips there (lstm-lm on an H200 failed
    its autocast trial on this after cuda_graph had fused its SGD), and still refuses under fp16."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from speedkit.lightning.step import ClippingMixedPrecision

    model = UserModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 10.0)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        MixedPrecision("bf16-mixed", device="cpu").clip_gradients(opt, 0.25)
    ClippingMixedPrecision("bf16-mixed", device="cpu").clip_gradients(opt, 0.25)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert norm == pytest.approx(0.25, rel=1e-4)
    fp16 = ClippingMixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fp16.clip_gradients(opt, 0.25)

    class Plugins(pl.Callback):
        seen: list[str] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(type(trainer.precision_plugin).__name__)

    pl.seed_everything(0, verbose=False)
    fused, plugins = _FusedClipped(), Plugins()
    trainer = _trainer([SpeedLadder(["autocast"], trials=False), plugins])
    trainer.fit(fused)
    assert trainer.global_step == 6 and plugins.seen == ["ClippingMixedPrecision"] * 6


def test_the_trials_time_and_its_largest_phases_are_said_when_they_end():
    from speedkit.report.markdown import trials_time

    run = {
        "trials_s": 43.27,
        "budget": {
            "budget_s": 120.0,
            "phases": {
                "the baseline": 3.36,
                "the rungs": 20.65,
                "the plan": 0.0,
                "the switches": 4.42,
                "the second look": 10.39,
                "the profile": 1.87,
            },
        },
    }
    assert (
        trials_time(run)
        == " in 43.3 s of a 120 s budget (the rungs 20.6 s, the second look 10.4 s, the switches 4.4 s, the baseline 3.4 s, ...)"
    )
    assert trials_time({}) == ""
