"""compile reaches what the training step runs: modules called through attributes, helper methods
and aliases; what ran is reported; a compile the step never runs is a failure, not "not faster"."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from ranks import run_in_process
from torch import nn

from speedkit.rungs.compile import CompileOptions, CompileRung, GuardedForward, step_modules
from speedkit.training.state import TrainState


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Wrapped(pl.LightningModule):
    """``self.model`` called from ``training_step``; the LightningModule has no forward."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Backbone()
        self.criterion = nn.MSELoss()  # no parameters: not worth a graph of its own

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.criterion(self.model(x), y)
        self.log("loss", loss)
        return loss


class TwoParts(pl.LightningModule):
    """Parts called through a helper method and a local alias."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = Backbone(), nn.Linear(8, 1)

    def shared(self, x):
        enc = self.encoder
        return self.head(enc(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.shared(x).squeeze(-1), y.sum(-1))


class NeverCalls(Wrapped):
    """The step reaches ``self.model`` only on a branch it never takes."""

    use_model = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.use_model:
            return F.mse_loss(self.model(x), y)
        return F.mse_loss(x * 2.0, y).requires_grad_()


def _state(model):
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"))


def test_the_modules_the_step_calls_are_found():
    wrapped = Wrapped()
    assert [(n, m) for n, m in step_modules(wrapped)[0]] == [("model", wrapped.model)]
    two = TwoParts()
    assert {n for n, _ in step_modules(two)[0]} == {"encoder", "head"}
    plain = Backbone()  # plain PyTorch: the user's loop calls the model itself
    assert step_modules(plain)[0] == [("", plain)]


def test_compile_runs_the_inner_model_and_reports_graphs_and_breaks():
    wrapped = Wrapped()
    handle = CompileRung(CompileOptions(backend="eager")).apply(_state(wrapped))
    assert isinstance(wrapped.model.__dict__["forward"], GuardedForward)
    assert "forward" not in wrapped.__dict__
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):
        wrapped.training_step((x, y), 0).backward()
    assert handle.problem() is None
    lines = handle.report()
    assert lines[0].startswith("ran model (Backbone).forward: 2 calls, 1 graphs compiled, 0 recompiles")
    assert lines[-1].startswith("graph breaks:")
    handle.undo()
    assert "forward" not in wrapped.model.__dict__


def test_a_compile_the_step_never_runs_fails_with_that_reason():
    model = NeverCalls()
    handle = CompileRung(CompileOptions(backend="eager")).apply(_state(model))
    model.training_step((torch.randn(4, 8), torch.randn(4, 8)), 0)
    assert handle.problem() == "compiled nothing that the training step runs (model (Backbone).forward never called)"
    handle.undo()


@pytest.mark.parametrize("switch", ["config", "environment"])
def test_with_dynamo_off_in_the_process_compile_says_it_does_not_apply(switch, monkeypatch):
    """Dynamo switched off makes every ``torch.compile`` run eagerly: timing it would compare eager with
    eager and call compile not faster."""
    import torch._dynamo.config as dynamo_config

    rung = CompileRung(CompileOptions(backend="eager"))
    assert rung.check(_state(Wrapped())) is None
    if switch == "environment":
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
        assert "Dynamo is off in this process" in rung.check(_state(Wrapped()))
    else:
        with dynamo_config.patch(disable=True):
            assert "Dynamo is off in this process" in rung.check(_state(Wrapped()))
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    assert rung.check(_state(Wrapped())) is None


def test_already_compiled_inner_models_are_left_as_the_user_compiled_them():
    wrapped = Wrapped()
    wrapped.model = torch.compile(wrapped.model, backend="eager")
    reason = CompileRung().check(_state(wrapped))
    assert reason is not None and "already compiled" in reason


def test_in_the_ladder_compile_counts_frames_of_the_inner_model():
    from speedkit.data import BatchSource
    from speedkit.engine.ladder import Ladder
    from speedkit.training.step import PlainStep

    class FreshBackbone(Backbone):  # its own code: no graph cached by the tests before
        def forward(self, x):
            return self.fc2(torch.tanh(self.fc1(x)))

    # nothing an earlier test compiled in this process may stand in for this test's graphs
    torch._dynamo.reset()
    torch.manual_seed(0)
    wrapped = Wrapped()
    wrapped.model = FreshBackbone()
    optimizer = torch.optim.AdamW(wrapped.parameters())
    data = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(64)]
    state = TrainState(
        model=wrapped,
        optimizer=optimizer,
        device=torch.device("cpu"),
        step=PlainStep(wrapped, optimizer, "cpu", loss_fn=lambda m, b, i: m.training_step(b, i)),
        data=BatchSource(data, torch.device("cpu")),
    )
    result = Ladder(
        state,
        [CompileRung(CompileOptions(backend="eager"))],
        {
            "warmup": 1,
            "steps": 2,
            "repeats": 2,
            "parity_steps": 2,
            "min_blocks": 2,
            "max_blocks": 2,
            "telemetry": False,
            "final_check": False,
            # the trial's count, not the floor's: where the switches end the climb (a tie goes to them), the
            # kept entry reports the switches' own compile, whose first call found the trial's graphs cached
            "switches_floor": False,
        },
    ).run()
    entry = result.rungs[1]
    assert entry.status in ("kept", "reverted") and entry.parity.passed, entry.reason
    ran = next(line for line in entry.changes if line.startswith("ran model (FreshBackbone).forward"))
    assert " 0 graphs" not in ran and " 0 calls" not in ran


def test_inductor_settings_go_to_torch_compile_with_the_modes_own(monkeypatch):
    """``inductor`` reaches ``torch.compile(options=...)`` merged over the mode's settings (torch takes
    a mode or options, not both); a name Inductor lacks is one line naming it, before any work."""
    from speedkit.errors import ConfigError
    from speedkit.options import parse_options

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    options = parse_options(
        CompileOptions,
        {"mode": "max-autotune-no-cudagraphs", "inductor": {"coordinate_descent_tuning": False}},
        "ladder[0].options",
    )
    wrapped = Wrapped()
    handle = CompileRung(options).apply(_state(wrapped))
    assert "mode" not in seen[0]
    assert seen[0]["options"]["max_autotune"] is True  # from the mode
    assert seen[0]["options"]["coordinate_descent_tuning"] is False  # the setting given wins
    assert "options={'coordinate_descent_tuning': False}" in " ".join(handle.changes)
    handle.undo()
    plain = CompileOptions(mode="max-autotune-no-cudagraphs").compile_kwargs()
    assert plain["mode"] == "max-autotune-no-cudagraphs" and "options" not in plain
    with pytest.raises(ConfigError, match="'no_such_setting' is not an Inductor setting"):
        parse_options(CompileOptions, {"inductor": {"no_such_setting": 1}}, "ladder[0].options")
    with pytest.raises(ConfigError, match="need backend 'inductor'"):
        parse_options(CompileOptions, {"backend": "eager", "inductor": {"max_autotune": True}}, "ladder[0].options")


def test_compile_follows_a_forward_rewritten_beneath_it_and_undo_leaves_nothing():
    """A rung that replaced ``forward`` before compile, switched off while compile is off and on again
    (the ladder's closing check), is off under compile too; switching back compiles nothing new; and
    undoing it and then compile leaves the class's forward, not the rewritten one."""
    from speedkit.handle import Handle, set_attr

    model = Backbone()
    x = torch.randn(3, 8)
    expected = model(x)

    def rewritten(x):
        return Backbone.forward(model, x) + 1.0

    below = Handle("rewrite")
    set_attr(below, model, "forward", rewritten)
    compiled = CompileRung(CompileOptions(backend="eager")).apply(_state(model))
    guarded = model.__dict__["forward"]
    torch.testing.assert_close(model(x), expected + 1.0)
    compiled.suspend(), below.suspend(), compiled.resume()  # without the rewrite, compile on
    assert model.__dict__["forward"] is guarded
    torch.testing.assert_close(model(x), expected)
    compiled.suspend(), below.resume(), compiled.resume()  # back: the first compiled function again
    torch.testing.assert_close(model(x), expected + 1.0)
    assert guarded.variants == 2 and guarded.recompiles == 0
    compiled.suspend(), below.suspend(), compiled.resume()
    below.undo()  # reverted beneath compile, which stays
    torch.testing.assert_close(model(x), expected)
    compiled.undo()
    assert "forward" not in model.__dict__
    torch.testing.assert_close(model(x), expected)


def test_logging_inside_a_hugging_face_forward_does_not_break_the_graph():
    """transformers' models call ``logger.warning_once`` in forward (5.x: ``loss_function`` when the
    config has no ``loss_type``), which breaks Dynamo's graph; under the rung Dynamo skips it."""
    import logging

    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from speedkit import compat

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=63, eos_token_id=63)
    )
    skipped = compat.dynamo_ignored_logging()
    assert skipped is not None and logging.Logger.warning_once not in skipped
    handle = CompileRung(CompileOptions(backend="eager")).apply(_state(model))
    assert logging.Logger.warning_once in skipped
    assert any(c.startswith("Dynamo skips transformers' logger.warning_once") for c in handle.changes)
    # torch 2.11 writes this set, sorted, as JSON with every compilation's metrics (a function there
    # failed it, an error traceback after each compilation); copies and pickles keep the function
    assert json.loads(json.dumps(sorted(skipped))) == ["transformers.utils.logging.warning_once"]
    assert logging.Logger.warning_once in copy.deepcopy(skipped) and logging.Logger.warning_once in pickle.loads(
        pickle.dumps(skipped)
    )
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
    assert handle.report()[-1] == "graph breaks: none"
    handle.suspend()
    assert logging.Logger.warning_once not in skipped
    handle.resume()
    assert logging.Logger.warning_once in skipped
    handle.undo()
    assert logging.Logger.warning_once not in skipped and "forward" not in model.__dict__


def test_plain_models_leave_dynamos_logging_alone():
    import logging

    from speedkit import compat

    before = set(compat.dynamo_ignored_logging() or ())
    handle = CompileRung(CompileOptions(backend="eager")).apply(_state(Wrapped()))
    assert set(compat.dynamo_ignored_logging() or ()) == before and not any("logger" in c for c in handle.changes)
    assert getattr(logging.Logger, "warning_once", None) not in (compat.dynamo_ignored_logging() or ())
    handle.undo()


COUNTED = {"graphs": 0, "runs": 0}


def _counting_backend(gm, example_inputs):
    COUNTED["graphs"] += 1

    def run(*args):
        COUNTED["runs"] += 1
        return gm.forward(*args)

    return run


def compile_after_the_process_used_dynamos_entries_up(out: str) -> None:
    """In a process of its own (Dynamo's entries are the process's): ten ``torch.compile(module)`` of
    the user's, which share one wrapper frame of Dynamo's, use its entries up; then speedkit's compile
    of a plain ``nn.Sequential`` and of a stack of torch's own ``nn.TransformerEncoderLayer`` blocks."""
    from torch._dynamo import register_backend

    from speedkit.rungs.compile import apply_compile

    register_backend(_counting_backend, name="speedkit_test_counting")
    for k in range(10):  # each another module: another entry of the one frame, given up after 8
        torch.compile(nn.Sequential(*[nn.Linear(4, 4) for _ in range(k + 1)]), backend="eager")(torch.randn(2, 4))
    results = {}
    layer = dict(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    models = {
        "sequential": (nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3)), torch.randn(5, 4)),
        "torch blocks": (nn.Sequential(*[nn.TransformerEncoderLayer(**layer) for _ in range(3)]), torch.randn(2, 5, 8)),
    }
    for name, (model, x) in models.items():
        COUNTED.update(graphs=0, runs=0)
        handle, guards = apply_compile(model, CompileOptions(backend="speedkit_test_counting"))
        for _ in range(2):
            model(x).sum().backward()
        results[name] = dict(COUNTED, calls=sum(g.calls for _, g in guards), targets=[label for label, _ in guards])
        handle.undo()
    (Path(out) / "counted.json").write_text(json.dumps(results))


def test_compile_runs_torchs_own_modules_compiled_where_the_process_used_dynamos_shared_frame_up(tmp_path):
    """torch's own forwards (``nn.Sequential``'s) are compiled by Dynamo in a wrapper frame that every
    ``torch.compile(module)`` in the process shares; once earlier compiles used its entries up, Dynamo
    ran speedkit's compile of such a model eagerly, compiling nothing (in the test suite's process, a
    Sequential model's compile then measured nothing). Each configuration now traces a frame of its own."""
    run_in_process(
        "test_compile_reach", f"compile_after_the_process_used_dynamos_entries_up({str(tmp_path)!r})", 240, "the process"
    )
    counted = json.loads((tmp_path / "counted.json").read_text())
    assert counted["sequential"]["targets"] == ["Sequential.forward"], counted
    assert counted["sequential"]["graphs"] == 1 and counted["sequential"]["runs"] == counted["sequential"]["calls"] == 2
    blocks = counted["torch blocks"]
    assert blocks["graphs"] >= 1 and blocks["runs"] == blocks["calls"] > 0, blocks  # every call compiled code
