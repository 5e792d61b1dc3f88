"""CPU tests of the cuda_graph rung: the capture check refuses what would replay wrong (each pattern
with its reason and source line), static batch buffers never serve a stale sample, the rung's
applicability, and the handle changes that stay on while a rung is suspended."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import random
import sys
import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from speedkit import rungs
from speedkit.cudagraph.safety import scan_function, scan_step
from speedkit.data.static import StaticBatch
from speedkit.handle import Handle
from speedkit.rungs.cuda_graph import optimizer_blocker, scaler_blocker
from speedkit.training.state import TrainState
from speedkit.training.step import PlainStep


class _Base(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.counter = 0
        self.seen: list[int] = []

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


class ItemSync(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        self.log("loss", loss.item())
        return loss


class BoolSync(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        scale = float(loss)
        return loss * scale


class CpuCopy(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        kept = loss.detach().cpu()
        return loss + 0 * kept.sum()


class Nonzero(_Base):
    def training_step(self, batch, batch_idx):
        idx = torch.nonzero(batch[:, 0] > 0)
        return self.net(batch[idx[:, 0]]).sum()


class MaskIndex(_Base):
    def training_step(self, batch, batch_idx):
        out = self.net(batch)
        return out[out > 0].sum()


class LossBranch(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        if loss > 10:
            loss = loss / 10
        return loss


class EveryNSteps(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        if batch_idx % 10 == 0:
            loss = loss * 2
        return loss


class Prints(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        print("step", batch_idx)
        return loss


class Clock(_Base):
    def training_step(self, batch, batch_idx):
        start = time.perf_counter()
        loss = self.net(batch).sum()
        return loss * 0 + start * 0


class HostRandom(_Base):
    def training_step(self, batch, batch_idx):
        return self.net(batch).sum() * random.random()


class Counter(_Base):
    def training_step(self, batch, batch_idx):
        self.counter += 1
        return self.net(batch).sum()


class AppendsToSelf(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        self.seen.append(batch_idx)
        return loss


class Synchronizes(_Base):
    def training_step(self, batch, batch_idx):
        torch.cuda.synchronize()
        return self.net(batch).sum()


class HelperSyncs(_Base):
    def training_step(self, batch, batch_idx):
        return self.shared_step(batch)

    def shared_step(self, batch):
        loss = self.net(batch).sum()
        self.log("loss", loss.item())
        return loss


class ForwardBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, scale: float = 1.0):
        y = self.lin(x)
        while y.abs().max() > 1:
            y = y / 2
        return y * scale


class InForward(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.net = ForwardBranches()

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()


class SuperStep(Prints):
    """The step is the parent's, reached through ``super()``."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)


class ClassMethodHelper(_Base):
    @classmethod
    def reduce(cls, out):
        return out * out.abs().max().item()

    def training_step(self, batch, batch_idx):
        return self.reduce(self.net(batch)).sum()


def _jitter(loss):
    """A helper at module level, not a method."""
    return loss * random.uniform(0.9, 1.1)


class FunctionHelper(_Base):
    def training_step(self, batch, batch_idx):
        return _jitter(self.net(batch).sum())


class NamedMask(_Base):
    def training_step(self, batch, batch_idx):
        x, y = batch
        keep = y != -100
        out = self.net(x)
        return out[keep].sum()


class TensorRepeats(_Base):
    def training_step(self, batch, batch_idx):
        x, counts = batch
        return self.net(x).repeat_interleave(counts, dim=0).sum()


class GlobalStepBranch(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        if self.global_step % 100 == 0:
            loss = loss * 2
        return loss


class AnnealedWeight(_Base):
    """A KL weight annealed with the global step: a Python number the graph would bake in."""

    def training_step(self, batch, batch_idx):
        out = self.net(batch)
        beta = min(1.0, self.global_step / 1000)
        return out.pow(2).mean() + beta * out.abs().mean()


class AfterSubscriptAssign(_Base):
    def training_step(self, batch, batch_idx):
        out = self.net(batch)
        out[:, 0] = 0
        if out.sum() > 0:
            out = out * 2
        return out.sum()


class AfterAugAssign(_Base):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch).sum()
        loss += 0.1
        if loss > 1:
            loss = loss / 2
        return loss


class ForwardHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def _scale(self, y):
        print("scale", y.shape)
        return y * 2

    def forward(self, x):
        return self._scale(self.lin(x))


class InForwardHelper(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.net = ForwardHelper()

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()


UNSAFE = [
    (ItemSync, "host sync", "`.item()`", "loss.item()"),
    (BoolSync, "host sync", "`float(...)`", "float(loss)"),
    (CpuCopy, "host sync", "`.cpu()`", ".cpu()"),
    (Synchronizes, "host sync", "`.synchronize()`", "torch.cuda.synchronize()"),
    (Nonzero, "dynamic shape", "`nonzero`", "torch.nonzero"),
    (MaskIndex, "dynamic shape", "boolean mask", "out[out > 0]"),
    (LossBranch, "data-dependent control flow", "per-step value (loss)", "if loss > 10"),
    (EveryNSteps, "data-dependent control flow", "per-step value (batch_idx)", "if batch_idx % 10 == 0"),
    (Prints, "host work", "`print`", "print("),
    (Clock, "host work", "host clock", "time.perf_counter()"),
    (HostRandom, "host work", "host random number", "random.random()"),
    (Counter, "host work", "`self.counter`", "self.counter += 1"),
    (AppendsToSelf, "host work", "`self.seen.append`", "self.seen.append"),
    (HelperSyncs, "host sync", "`.item()`", "loss.item()"),
    (InForward, "data-dependent control flow", "per-step value (y)", "while y.abs().max() > 1"),
    (SuperStep, "host work", "`print`", "print("),
    (ClassMethodHelper, "host sync", "`.item()`", "out.abs().max().item()"),
    (FunctionHelper, "host work", "host random number", "random.uniform(0.9, 1.1)"),
    (NamedMask, "dynamic shape", "boolean mask", "out[keep]"),
    (TensorRepeats, "dynamic shape", "`repeat_interleave`", "repeat_interleave(counts"),
    (GlobalStepBranch, "data-dependent control flow", "per-step value (self.global_step)", "if self.global_step % 100"),
    (AnnealedWeight, "data-dependent control flow", "host number that changes every step (beta)", "beta * out"),
    (AfterSubscriptAssign, "data-dependent control flow", "per-step value (out)", "if out.sum() > 0"),
    (AfterAugAssign, "data-dependent control flow", "per-step value (loss)", "if loss > 1"),
    (InForwardHelper, "host work", "`print`", 'print("scale"'),
]


def _line_of(cls: type, snippet: str) -> int:
    """The file line of ``snippet`` in the class's source (or its helper/forward)."""
    bases = [k for k in cls.__mro__[1:] if k.__module__ == __name__]
    for obj in (cls, *bases, ForwardBranches, ForwardHelper, _jitter):
        lines, start = inspect.getsourcelines(obj)
        for i, line in enumerate(lines):
            if snippet in line:
                return start + i
    raise AssertionError(f"{snippet!r} not in the source of {cls.__name__}")


@pytest.mark.parametrize("cls,kind,reason,snippet", UNSAFE, ids=[u[0].__name__ for u in UNSAFE])
def test_capture_check_refuses_unsafe_pattern_with_reason_and_line(cls, kind, reason, snippet):
    blockers = scan_step(cls())
    assert blockers, f"{cls.__name__}: nothing found"
    found = [b for b in blockers if b.kind == kind and reason in b.reason]
    assert found, f"{cls.__name__}: {[str(b) for b in blockers]}"
    b = found[0]
    assert snippet in b.code
    assert b.where == f"{__file__}:{_line_of(cls, snippet)} in {b.where.rsplit(' in ', 1)[1]}"
    # the rung refuses with that reason, wherever it runs
    check = rungs.make("cuda_graph").check(_state(cls()))
    assert check is not None and kind in check and str(_line_of(cls, snippet)) in check


class Safe(_Base):
    """Patterns that are the same every step: shapes, None checks, flags, logging tensors."""

    def __init__(self, flip: bool = False) -> None:
        super().__init__()
        self.flip = flip

    def training_step(self, batch, batch_idx):
        x, y = batch
        if x.shape[0] > 1 and y is not None and isinstance(x, torch.Tensor):
            x = x * 1.0
        if self.flip:
            x = -x
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        acc = (logits.argmax(-1) == y).float().mean()
        self.log("train_loss", loss, prog_bar=True)
        self.log_dict({"acc": acc})
        for _ in range(2):
            loss = loss + 0.0
        return {"loss": loss}


def _layerdrop(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LayerDrop (Wav2Vec2, BART with layerdrop > 0): whether a layer runs is drawn on the host."""
    if torch.rand([]) < 0.1:
        return x
    return x * 2


def test_the_capture_check_finds_random_numbers_drawn_on_the_host_and_names_the_line():
    """On the H100 timm's Mixup in a training_step passed parity (the loss of a fresh ViT barely
    depends on the mix) and only an undecided timing kept the graph from replaying one mix forever."""
    import numpy as np
    from timm.data import Mixup

    from speedkit.cudagraph.step_watch import find_host_draws

    x, y = torch.randn(4, 3, 16, 16), torch.arange(4)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10)
    beta, profile = np.random.beta, sys.getprofile()
    _, found = find_host_draws(lambda: mixup(x.clone(), y))
    assert found and all(b.kind == "host work" for b in found)
    assert "timm/data/mixup.py" in found[0].where and "np.random.rand()" in found[0].code
    assert "numpy.random.rand" in found[0].reason and f"reached from {__file__}" in found[0].reason
    assert np.random.beta == beta and sys.getprofile() is profile  # put back
    _, found = find_host_draws(lambda: _layerdrop(x))
    assert [(b.where.split(":")[0], b.code) for b in found] == [(__file__, "if torch.rand([]) < 0.1:")]
    assert "torch.rand on the CPU" in found[0].reason
    _, found = find_host_draws(lambda: x * random.uniform(0.5, 1.0))
    assert len(found) == 1 and "Random.random" in found[0].reason and found[0].where.startswith(f"{__file__}:")
    # where the call is not traced (torch.compile runs the step), the generator that drew says it
    _, found = find_host_draws(lambda: mixup(x.clone(), y), locate=False)
    assert len(found) == 1 and found[0].reason.startswith("NumPy's global generator drew during the step")
    assert "not located" in str(found[0]) and not str(found[0]).endswith("(``)")
    out, found = find_host_draws(lambda: (x * 2).sum())
    assert found == [] and out == (x * 2).sum()
    private = torch.Generator().manual_seed(0)  # a generator of the step's own: not a global one, not seen
    assert find_host_draws(lambda: torch.rand(3, generator=private), locate=False)[1] == []


def test_safe_step_passes_the_check():
    assert scan_step(Safe()) == []


class TensorProperties(_Base):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if not x.is_contiguous() or not x.is_floating_point():
            x = x.contiguous().float()
        return self.net(x).sum() / x.nelement()


class BatchKeys(_Base):
    def training_step(self, batch, batch_idx):
        x = batch["x"]
        if "weight" in batch:
            x = x * batch["weight"]
        return self.net(x).sum()


class LoopsOverTheBatch(_Base):
    def training_step(self, batch, batch_idx):
        loss = 0
        for x, y in zip(*batch):
            loss = loss + nn.functional.mse_loss(self.net(x), y)
        for part in batch:
            loss = loss + 0 * part.sum()
        return loss


class MaskedFillByIndexing(_Base):
    """``t[mask] = number`` is ``masked_fill_``: no data-dependent size."""

    def training_step(self, batch, batch_idx):
        x, labels = batch
        labels = labels.clone()
        labels[labels == 0] = -100
        logits = self.net(x)
        logits[logits < -5] = float("-inf")
        return nn.functional.cross_entropy(logits, labels, ignore_index=-100)


class NumberRepeats(_Base):
    def training_step(self, batch, batch_idx):
        return self.net(batch).repeat_interleave(2, dim=0).sum()


class IndexPassedToHelper(_Base):
    def training_step(self, batch, batch_idx):
        return self._shared_step(batch, batch_idx, "train")

    def _shared_step(self, batch, batch_idx, stage):
        loss = self.net(batch).sum()
        self.log(f"{stage}_loss", loss)
        return loss


class CallsTheStandardLibrary(_Base):
    """Python's own library is not the user's code: not read (`json.dumps` branches on its options)."""

    def training_step(self, batch, batch_idx):
        tags = json.dumps({"stage": "train"})
        kept = copy.deepcopy(self.seen)
        return self.net(batch).sum() * (len(tags) + len(kept))


SAFE = [
    TensorProperties,
    BatchKeys,
    LoopsOverTheBatch,
    MaskedFillByIndexing,
    NumberRepeats,
    IndexPassedToHelper,
    CallsTheStandardLibrary,
]


@pytest.mark.parametrize("cls", SAFE, ids=[c.__name__ for c in SAFE])
def test_capture_check_passes_what_replays_the_same(cls):
    """Tensor properties a graph fixes, the batch's own structure, `t[mask] = 0.0`, number repeats and
    the batch index passed on to a helper that does not compute with it: no refusal."""
    assert scan_step(cls()) == [], [str(b) for b in scan_step(cls())]


def test_demo_models_pass_the_check():
    from speedkit.demos import LaunchBoundMLP
    from speedkit.demos.gpt2 import NaiveGPT

    for model in (NaiveGPT(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=8), LaunchBoundMLP(16, 16, 2, 4)):
        assert scan_step(model) == [], [str(b) for b in scan_step(model)]


def test_speedkit_layers_swapped_into_a_demo_model_pass_the_check():
    """The zoo's models live in speedkit.demos (their own package is speedkit): the norms that
    triton_layers swaps in are speedkit's, capture-safe by construction, and not scanned as user code."""
    from speedkit.demos.gpt2 import NaiveGPT
    from speedkit.kernels.layers import LayerNorm

    model = NaiveGPT(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=8)
    model.ln_f = LayerNorm(16)
    assert scan_step(model) == [], [str(b) for b in scan_step(model)]


def test_forward_option_arguments_are_not_per_step():
    def forward(x, use_cache: bool = False, mask=None):
        if use_cache:
            x = x + 1
        if mask is not None:
            x = x * mask
        return x

    assert scan_function(forward, per_step_args=False) == []
    blockers = scan_function(forward, per_step_args=True)
    assert [b.kind for b in blockers] == ["data-dependent control flow"]


def _state(model: nn.Module, device: str = "cpu", opt=None) -> TrainState:
    return TrainState(model=model, optimizer=opt or torch.optim.AdamW(model.parameters()), device=torch.device(device))


def test_rung_needs_cuda_for_a_safe_step():
    reason = rungs.make("cuda_graph").check(_state(Safe()))
    assert reason == "CUDA graphs need a CUDA device; this run is on cpu"


def test_training_across_processes_needs_ddp_over_nccl():
    """Several processes: only Lightning's DDP over NCCL without find_unused_parameters is captured;
    every rank reads the same options, so every rank decides alike."""
    from speedkit.lightning.step import LightningStep

    class Module(Safe):
        def training_step(self, batch, batch_idx):
            return self(batch)

    model = Module()
    opt = torch.optim.AdamW(model.parameters())
    trainer = SimpleNamespace(
        world_size=2,
        lr_scheduler_configs=[],
        callbacks=[],
        accumulate_grad_batches=1,
        optimizers=[opt],
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        precision_plugin=SimpleNamespace(precision="32-true"),
    )
    step = LightningStep(trainer, model)
    state = TrainState(model=model, optimizer=opt, device=torch.device("cpu"), step=step)
    rung = rungs.make("cuda_graph")
    reason = rung.check(state)
    assert reason is not None and reason.startswith("training across 2 processes without Lightning's DDP strategy"), reason
    step.ddp_options = lambda: {"backend": "gloo"}
    assert rung.check(state).startswith("the gloo backend's collectives run on the host")
    step.ddp_options = lambda: {"backend": "nccl", "find_unused_parameters": True}
    assert rung.check(state).startswith("the strategy sets find_unused_parameters=True")
    step.ddp_options = lambda: {"backend": "nccl", "static_graph": True}
    assert rung.check(state) == "CUDA graphs need a CUDA device; this run is on cpu"  # DDP over NCCL passes
    trainer.world_size = 1
    assert "CUDA device" in rung.check(state)
    plain = _state(Safe())
    plain.step.world_size = lambda: 4  # a plain loop under torchrun: the default process group's size
    assert rung.check(plain).startswith("training across 4 processes without Lightning's DDP strategy")


def test_optimizer_blockers():
    p = [nn.Parameter(torch.zeros(2))]
    assert optimizer_blocker(torch.optim.AdamW(p), scheduled=True) is None
    assert optimizer_blocker(torch.optim.SGD(p, lr=0.1), scheduled=False) is None
    # a scheduled SGD: through its fused implementation, whose kernel reads a tensor learning rate
    assert optimizer_blocker(torch.optim.SGD(p, lr=0.1, momentum=0.9), scheduled=True) is None
    clipped = "Lightning's mixed precision refuses gradient clipping"
    reason = optimizer_blocker(torch.optim.SGD(p, lr=0.1), scheduled=True, fused_step_blocker=clipped)
    assert "only when fused" in reason and clipped in reason
    sparse = nn.Embedding(4, 2, sparse=True)
    reason = optimizer_blocker(torch.optim.SGD(sparse.parameters(), lr=0.1), scheduled=True, model=sparse)
    assert "sparse" in reason
    assert "cannot read a scheduled learning rate" in optimizer_blocker(torch.optim.Adagrad(p), scheduled=True)
    assert "LBFGS" in optimizer_blocker(torch.optim.LBFGS(p), scheduled=False)


def test_a_scheduled_sgd_is_fused_while_captured_and_checkpoints_keep_its_flags():
    """cuda_graph on SGD with a schedule (the LSTM LM, timm's MobileNet recipe): fused for the graph,
    the user's flags back on undo and in every checkpoint written meanwhile."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = PlainStep(model, opt, torch.device("cpu"), loss_fn=lambda m, b, i: m(b).sum(), scheduler=schedule)
    state = TrainState(model=model, optimizer=opt, device=torch.device("cpu"), step=step)
    assert step.has_schedule()
    handle = rungs.make("cuda_graph").apply(state)
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    assert any("fused implementation" in c and "schedule" in c for c in handle.changes), handle.changes
    assert any("read by the graph from a device tensor" in c for c in handle.changes), handle.changes
    saved = opt.state_dict()["param_groups"][0]
    assert saved["foreach"] is True and saved["fused"] is None
    handle.suspend()  # the flag stays while the graph is off in a comparison (it computes the same update)
    assert opt.param_groups[0]["fused"]
    handle.undo()
    assert opt.param_groups[0]["foreach"] is True and opt.param_groups[0]["fused"] is None


def test_fp16_loss_scaling_blocks_only_optimizers_that_unscale_on_the_host():
    p = [nn.Parameter(torch.zeros(2))]
    assert "fused=True" in scaler_blocker(torch.optim.AdamW(p))
    assert scaler_blocker(torch.optim.AdamW(p, fused=True)) is None  # the scale and the inf check taken on the device


def test_bad_options_are_one_line_errors():
    from speedkit.errors import ConfigError

    with pytest.raises(ConfigError, match="warmup"):
        rungs.make({"name": "cuda_graph", "options": {"warmup": 0}})


# -- static buffers ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    source: str


def _batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(n, 3, generator=g),
        "pair": (torch.randint(0, 9, (n,), generator=g), "tag"),
        "sample": Sample(torch.rand(n, 2, generator=g), torch.arange(n) + seed, "disk"),
    }


def _flat(batch):
    from speedkit.data.batch import batch_leaves

    return batch_leaves(batch)


def test_static_buffers_serve_each_batch_never_a_stale_one():
    first = _batch(0)
    static = StaticBatch(first)
    buffers = [t for t in _flat(static.batch) if isinstance(t, torch.Tensor)]
    for seed in range(1, 6):
        batch = _batch(seed)
        out = static.fill(batch)
        assert out is static.batch
        for got, want in zip(_flat(out), _flat(batch)):
            if isinstance(want, torch.Tensor):
                assert torch.equal(got, want) and got.data_ptr() != want.data_ptr()
            else:
                assert got == want
        # the same buffers every time: what a captured graph reads
        assert [t.data_ptr() for t in _flat(out) if isinstance(t, torch.Tensor)] == [t.data_ptr() for t in buffers]
    assert static.filled == 5 and static.refused == 0


def test_static_buffers_refuse_a_short_last_batch_and_a_changed_leaf():
    static = StaticBatch(_batch(0))
    static.fill(_batch(1))
    before = [t.clone() for t in _flat(static.batch) if isinstance(t, torch.Tensor)]
    assert static.fill(_batch(2, n=3)) is None  # a short last batch: the caller runs it outside the graph
    assert "short last batch" in (static.refused_reason or "")
    changed = _batch(3)
    changed["pair"] = (changed["pair"][0], "other")
    assert static.fill(changed) is None
    # refused batches wrote nothing into the buffers
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in _flat(static.batch) if isinstance(t, torch.Tensor)]))
    assert static.refused == 2
    assert "2 batches ran outside them" in static.report()


# -- handle: changes that stay on while suspended -----------------------------------------------------


def test_persistent_changes_survive_suspend_and_go_with_undo():
    log: list[str] = []
    h = Handle("x")
    h.record("flag", lambda: log.append("flag off"), persistent=True)
    h.record("wrap", lambda: log.append("unwrap"), lambda: log.append("rewrap"))
    assert h.toggleable
    h.suspend()
    h.resume()
    assert log == ["unwrap", "rewrap"]
    h.suspend()
    h.undo()
    assert log == ["unwrap", "rewrap", "unwrap", "flag off"]
    h2 = Handle("y")
    h2.record("flag", lambda: log.append("flag2 off"), persistent=True)
    h2.record("wrap", lambda: log.append("unwrap2"), lambda: None)
    h2.undo()
    assert log[-2:] == ["unwrap2", "flag2 off"]


def test_the_report_says_how_the_learning_rate_reaches_the_graph():
    """AdamW (capturable) reads it from a device tensor; SGD keeps a number baked into the graph."""
    for opt_cls, says in (
        (torch.optim.AdamW, "read by the graph from a device tensor"),
        (torch.optim.SGD, "baked into the graph"),
    ):
        model = nn.Linear(4, 2)
        opt = opt_cls(model.parameters(), lr=0.1)
        state = TrainState(
            model=model,
            optimizer=opt,
            device=torch.device("cpu"),
            step=PlainStep(model, opt, "cpu", loss_fn=lambda m, b, i: m(b[0]).sum()),
        )
        handle = rungs.make("cuda_graph").apply(state)
        assert any(line.startswith(f"{opt_cls.__name__}: learning rate {says}") for line in handle.changes), handle.changes
        handle.undo()


def test_the_graphs_rate_tensors_sit_in_the_groups_only_for_the_capture_and_follow_their_numbers():
    """Schedules, get_last_lr() and checkpoints see numbers: a tensor is in a capturable group only
    while the step is captured; before each replay the group's number is written into it, once per
    change (a user's own tensor rate is copied)."""
    from speedkit.cudagraph.graphed_step import GraphedStep

    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.2}], capturable=True)
    graphed = GraphedStep(PlainStep(model, opt, "cpu", loss_fn=lambda m, b, i: m(b[0]).sum()))
    numbers = graphed._rates_into_tensors()
    groups = opt.param_groups
    assert [float(g["lr"]) for g in groups] == [pytest.approx(0.1), pytest.approx(0.2)]
    assert all(isinstance(g["lr"], torch.Tensor) for g in groups)
    tensors = [g["lr"] for g in groups]
    graphed._rates_back(numbers)
    assert [g["lr"] for g in groups] == [0.1, 0.2]  # the very numbers, not a float() of a tensor
    writes = []
    for t in tensors:
        t.fill_ = (lambda t: lambda v: (writes.append(v), torch.Tensor.fill_(t, v))[1])(t)
    for rate in graphed._rates:
        rate.fill()
    assert writes == []  # unchanged since the capture: nothing written
    groups[0]["lr"] = 0.05  # the schedule stepped
    for rate in graphed._rates:
        rate.fill()
    assert writes == [0.05] and float(tensors[0]) == pytest.approx(0.05) and float(tensors[1]) == pytest.approx(0.2)
    groups[1]["lr"] = torch.tensor(0.3)  # a user's own tensor rate
    graphed._rates[1].fill()
    assert float(tensors[1]) == pytest.approx(0.3)
    graphed.drop_rate_tensors()
    assert graphed._rates == [] and groups[0]["lr"] == 0.05
    graphed._rates_into_tensors()  # a capture cut short, its numbers never put back: the undo does it
    graphed.drop_rate_tensors()
    assert [type(g["lr"]) for g in groups] == [float, torch.Tensor] and groups[0]["lr"] == pytest.approx(0.05)


def test_a_capture_error_torch_words_obscurely_is_explained():
    from speedkit.cudagraph.graphed_step import capture_failure

    why = capture_failure(RuntimeError("Attempt to increase offset for a CUDA generator not in capture mode."))
    assert why.startswith("the step sets the CUDA random generator's state while it is captured (activation checkpointing")
    assert why.endswith("RuntimeError: Attempt to increase offset for a CUDA generator not in capture mode.")
    assert capture_failure(ValueError("other\nlines")) == "ValueError: other"


def test_a_sync_made_while_torch_compile_compiles_is_not_the_steps():
    """Inductor folds a constant with ``.item()`` on a configuration's first call (seen on the H200 under
    the demo Transformer): a sync once, while compiling, not in the step a graph replays. A sync at a
    graph break runs in the caller's frames, compiled code's or the user's, and still counts."""
    import traceback

    from speedkit.cudagraph.step_watch import while_compiling

    def frames(*files: str) -> list[traceback.FrameSummary]:
        return [traceback.FrameSummary(f, 1, "f") for f in files]

    site = "/venv/lib/python3.12/site-packages"
    assert while_compiling(
        frames("/work/train.py", f"{site}/torch/_dynamo/convert_frame.py", f"{site}/torch/_inductor/fx_passes/joint_graph.py")
    )
    assert while_compiling(frames(f"{site}/torch/_inductor/compile_fx.py"))
    assert not while_compiling(
        frames(
            "/work/train.py",
            f"{site}/torch/_dynamo/eval_frame.py",
            "/tmp/torchinductor_root/ab/cabc.py",
            f"{site}/torch/nn/modules/transformer.py",
        )
    )


def test_a_graph_captured_before_a_change_in_place_is_captured_again_and_switched_handles_keep_it():
    """The ladder's parity checks set dropout rates to 0 with the graph on (a rung beneath compile on
    Lightning's demo Transformer, judged with dropout off): the captured kernels still drop out, and
    the loss moved by 1.4e-3 in fp32. Such a change in place drops the graph; it warms up again
    (``rewarm`` eager steps) and captures anew. Switching handles does not: the graph's own suspend
    and resume in its A/B comparison, or a rung above it switched, left the capture as valid as it
    was, and dropping it there (d9ada28..c5f4f53) put a warm-up and a capture into every timed B
    block: cuda_graph measured 0.835x on GPT-2, 0.852x on Llama, 0.943x on ViT (H200), where it had
    been kept before. A rung switched beneath the graph rebases it through ``Handle.rebase``."""
    from speedkit.cudagraph.graphed_step import GraphedStep
    from speedkit.engine.parity import dropout_off as _dropout_off
    from speedkit.handle import Handle, configuration_changed, in_place_changes, set_attr

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    state = SimpleNamespace(step=PlainStep(model, opt, "cpu", loss_fn=lambda m, b, i: m(b[0]).sum()))
    graphed = GraphedStep(state.step, warmup=2, rewarm=1)
    own = Handle("cuda_graph")
    set_attr(own, state, "step", graphed, "the whole step captured")
    reset = []
    graphed.graph = SimpleNamespace(reset=lambda: reset.append(1))  # as if captured
    graphed._captured_at = in_place_changes()
    graphed._eager_needed = 0
    assert graphed._ready() and graphed.graph is not None  # nothing changed: replayed
    for _ in range(3):  # its own A/B blocks
        own.suspend()
        assert state.step is not graphed
        own.resume()
        assert state.step is graphed and graphed._ready() and graphed.graph is not None
    other = Handle("async_progress_bar")
    set_attr(other, model, "speedkit_flag", True, "a rung above the graph")
    other.suspend(), other.resume(), configuration_changed()
    assert graphed._ready() and graphed.graph is not None and reset == []
    with _dropout_off(model):
        assert not graphed._ready() and graphed.graph is None and reset == [1]
        assert graphed._eager_needed == 1  # one eager step, then a capture with dropout off
        graphed.graph = SimpleNamespace(reset=lambda: reset.append(2))  # as if captured with dropout off
        graphed._captured_at = in_place_changes()
        graphed._eager_needed = 0
        assert graphed._ready() and graphed.graph is not None
    assert not graphed._ready() and graphed.graph is None and reset == [1, 2]  # the rates back: captured again


def test_a_fits_checked_warm_up_step_records_its_logs_as_the_capture_does(monkeypatch):
    """In a fit, the warm-up step checked before the capture runs Lightning's own step with ``self.log``
    recorded (as the capture records it) and made after it, once each; the other warm-up steps log as
    Lightning does. A compiled ``training_step`` (all of it, under DDP) guards on the module's ``log``:
    meeting the recording first inside the capture compiled it again there, which failed the capture."""
    from speedkit.cudagraph import graphed_step
    from speedkit.cudagraph.graphed_step import GraphedStep

    class _StandIn:  # a CUDA stream: what the CPU run needs of it
        device = None

        def wait_stream(self, other) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _StandIn())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(graphed_step, "find_syncs", lambda run: (run(), []))
    monkeypatch.setattr(graphed_step, "find_host_draws", lambda run, locate=True: (run(), []))

    model = _Base()
    made: list[tuple[str, float, str | None]] = []  # name, value, the hook Lightning would see
    monkeypatch.setattr(
        type(model), "log", lambda self, name, value, **kw: made.append((name, float(value), self._current_fx_name))
    )

    class Logging(PlainStep):  # makes recorded log calls on the module, as LightningStep.emit does
        def emit(self, logs, batch) -> None:
            for args, kwargs, _ in logs:
                model.log(*args, **kwargs)

    step = Logging(model.net, torch.optim.SGD(model.net.parameters(), lr=0.1), "cpu", loss_fn=lambda m, b, i: m(b).sum())
    step.model = model
    graphed = GraphedStep(step, warmup=2)
    monkeypatch.setattr(graphed, "_side_stream", lambda: _StandIn())
    recording: list[bool] = []

    def lightning_step(optimizer, batch_idx, kwargs):  # Lightning's own step, logging from training_step
        recording.append("log" in model.__dict__)
        model.log("train_loss", torch.tensor(float(batch_idx)))
        return {"loss": torch.tensor(1.0)}

    for i in range(2):
        out = graphed._fit_step(None, lightning_step, None, i, {"batch": torch.ones(2, 4)})
        assert out == {"loss": torch.tensor(1.0)}
    assert recording == [False, True]  # the second warm-up step is the checked one
    assert made == [("train_loss", 0.0, None), ("train_loss", 1.0, "training_step")]
    assert "log" not in model.__dict__ and graphed.eager_steps == 2 and graphed._checked
