"""Each rung: check says why not, apply changes what it says, undo restores everything exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import mlp_state, tiny_gpt_state
from torch import nn

from speedkit import rungs
from speedkit.errors import ConfigError
from speedkit.rungs.compile import CompileOptions, GuardedForward, apply_compile

CPU_RUNGS = ["tf32", "autocast", "fused_optimizer", "sdpa", "compile"]


def _fingerprint(state):
    """Everything a rung might touch, captured by value."""
    model, opt = state.model, state.optimizer
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "param_ids": [id(p) for p in model.parameters()],
        "opt_param_ids": [id(p) for g in opt.param_groups for p in g["params"]],
        "opt_state": copy.deepcopy(opt.state_dict()),
        "opt_defaults": dict(opt.defaults),
        "opt_amp": opt.__dict__.get("_step_supports_amp_scaling"),
        "modules": [(n, type(m).__name__) for n, m in model.named_modules()],
        "model_dict_keys": sorted(model.__dict__),
        "repr": repr(model),
        "state": (state.step, state.data, state.precision, state.step.autocast_dtype, state.step.scaler, state.step.loss_fn),
        "flags": (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32),
    }


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    for key in ("param_ids", "opt_param_ids", "opt_defaults", "opt_amp", "modules", "model_dict_keys", "repr", "state", "flags"):
        assert a[key] == b[key], key
    sa, sb = a["opt_state"], b["opt_state"]
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            w = sb["state"][i][k]
            assert torch.equal(v, w) and v.device == w.device, (i, k)


@pytest.mark.parametrize("name", CPU_RUNGS)
def test_apply_then_undo_restores_everything_exactly(name, bf16_cpu):
    state = tiny_gpt_state()
    batches = state.data.iterator()
    for i in range(2):  # give the optimizer real state to keep
        state.step([next(batches)], i)
    before = _fingerprint(state)
    rung = rungs.make(name)
    reason = rung.check(state)
    if reason is not None:
        pytest.skip(f"{name} does not apply on this machine: {reason}")
    handle = rung.apply(state)
    assert handle.changes, "a rung must say what it changed"
    handle.undo()
    _assert_same(before, _fingerprint(state))
    handle.undo()  # idempotent
    _assert_same(before, _fingerprint(state))


@pytest.mark.parametrize("name", CPU_RUNGS)
def test_suspend_and_resume_switch_the_same_change_off_and_on(name, bf16_cpu):
    """The ladder times a rung on and off in interleaved windows: its handle switches the very same
    change off (everything as before) and on again (everything as applied), nothing rebuilt."""
    state = tiny_gpt_state()
    for i, b in zip(range(2), state.data.iterator()):
        state.step([b], i)
    rung = rungs.make(name)
    if rung.check(state) is not None:
        pytest.skip(rung.check(state))
    before = _fingerprint(state)
    handle = rung.apply(state)
    applied = _fingerprint(state)
    forwards = {n: m.__dict__.get("forward") for n, m in state.model.named_modules()}
    assert handle.toggleable
    for _ in range(2):
        handle.suspend()
        _assert_same(before, _fingerprint(state))
        handle.resume()
        _assert_same(applied, _fingerprint(state))
        assert {n: m.__dict__.get("forward") for n, m in state.model.named_modules()} == forwards
    handle.undo()
    _assert_same(before, _fingerprint(state))


@pytest.mark.parametrize("name", CPU_RUNGS)
def test_training_after_undo_matches_never_applied(name, bf16_cpu):
    """Apply, train, undo, train: the optimizer still drives the live parameters, the same way."""
    ref, cand = tiny_gpt_state(), tiny_gpt_state()
    rung = rungs.make(name)
    if rung.check(cand) is not None:
        pytest.skip(rung.check(cand))
    handle = rung.apply(cand)
    handle.undo()
    for state in (ref, cand):
        batches = state.data.iterator()
        for i in range(2):
            state.step([next(batches)], i)
    for (k, a), b in zip(ref.model.state_dict().items(), cand.model.state_dict().values()):
        assert torch.equal(a, b), k


def test_fused_optimizer_keeps_state_hyperparameters_and_updates():
    ref, cand = tiny_gpt_state(), tiny_gpt_state()
    for state in (ref, cand):
        for i, b in zip(range(2), state.data.iterator()):
            state.step([b], i)
    lr_before = cand.optimizer.param_groups[0]["lr"]
    state_before = copy.deepcopy(cand.optimizer.state_dict()["state"])
    handle = rungs.make("fused_optimizer").apply(cand)
    assert cand.optimizer.param_groups[0]["fused"] is True
    assert cand.optimizer.param_groups[0]["lr"] == lr_before
    for i, st in cand.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v.cpu(), state_before[i][k].cpu())
    # one more step each: fused and for-loop AdamW compute the same update (fp32 rounding apart)
    for state in (ref, cand):
        b = next(state.data.iterator())
        state.step([b], 3)
    for a, b in zip(ref.model.parameters(), cand.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    handle.undo()
    assert cand.optimizer.param_groups[0]["fused"] is None


def test_fused_optimizer_not_applicable_reasons():
    state = mlp_state()
    state.optimizer = torch.optim.AdamW(state.model.parameters(), fused=True)
    assert "already fused" in rungs.make("fused_optimizer").check(state)
    state.optimizer = torch.optim.LBFGS(state.model.parameters())
    assert "neither a fused nor a foreach" in rungs.make("fused_optimizer").check(state)


def test_autocast_sets_dtype_and_reverts(bf16_cpu):
    state = tiny_gpt_state()
    rung = rungs.make({"name": "autocast", "options": {"dtype": "bf16"}})
    if rung.check(state):
        pytest.skip(rung.check(state))
    handle = rung.apply(state)
    assert state.step.autocast_dtype == torch.bfloat16 and state.precision == "bf16"
    with state.step.autocast():
        out = state.model.lm_head(torch.randn(2, 64))
    assert out.dtype == torch.bfloat16
    handle.undo()
    assert state.step.autocast_dtype is None and state.precision == "fp32"


def test_autocast_fp16_on_cpu_is_refused_with_reason():
    state = mlp_state()
    assert "fp16 autocast on CPU" in rungs.make({"name": "autocast", "options": {"dtype": "fp16"}}).check(state)


def test_compile_replaces_forward_and_undo_restores_the_class_method():
    state = mlp_state()
    rung = rungs.make({"name": "compile", "options": {"backend": "eager"}})
    handle = rung.apply(state)
    assert isinstance(state.model.forward, GuardedForward)
    assert "already compiled" in rung.check(state)
    x = torch.randn(8, 16)
    torch.testing.assert_close(state.model(x), state.model.forward.eager(x))
    handle.undo()
    assert "forward" not in state.model.__dict__
    assert rung.check(state) is None


def test_compile_falls_back_to_eager_on_a_recompilation_storm():
    state = mlp_state()
    rung = rungs.make({"name": "compile", "options": {"backend": "eager", "dynamic": False, "max_recompiles": 1}})
    handle = rung.apply(state)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="recompilation storm"):
        for batch in (3, 4, 5, 6, 7):  # each new batch size is a new static graph
            out = state.model(torch.randn(batch, 16))
            assert out.shape == (batch, 10)
    assert "recompilation storm" in handle.problem()
    handle.undo()


class _Scaled(nn.Module):
    """A forward reading a float attribute, which Dynamo guards on: each new value compiles a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 10)
        self.scale = 1.0

    def forward(self, x):
        return self.net(x) * self.scale


@pytest.mark.parametrize("announced", [True, False])
def test_compile_counts_graphs_for_switched_configurations_apart_from_a_storm(announced):
    """A rung or parity check switching the configuration beneath compile (here a guarded float, as a
    dropout rate set to 0 is) compiles that configuration once: not a recompile. The same recompiles
    with no switch announced are a storm."""
    from speedkit.handle import configuration_changed

    torch._dynamo.reset()
    model = _Scaled()
    handle, [(_, guarded)] = apply_compile(model, CompileOptions(backend="eager", dynamic=False, max_recompiles=2))
    x = torch.randn(4, 16)
    for value in (1.0, 2.0, 3.0, 4.0, 5.0, 1.0, 2.0):  # five configurations, then two seen before
        model.scale = value
        if announced:
            configuration_changed()
        torch.testing.assert_close(model(x), model.net(x) * value)
        torch.testing.assert_close(model(x), model.net(x) * value)
    if announced:
        assert guarded.fallback_reason is None and guarded.recompiles == 0 and guarded.switch_graphs == 4
        assert "4 graphs for configurations other rungs switched" in handle.report()[0]
    else:
        assert "recompilation storm" in guarded.fallback_reason
    handle.undo()


def test_compile_makes_room_for_each_configuration_in_dynamos_cache_and_gives_it_back():
    from speedkit import compat
    from speedkit.rungs.compile import CONFIGURATION_ENTRIES

    before = compat.dynamo_recompile_limit()
    handle, _ = apply_compile(_Scaled(), CompileOptions(backend="eager"))
    assert compat.dynamo_recompile_limit() == max(before, CONFIGURATION_ENTRIES)
    handle.suspend()
    assert compat.dynamo_recompile_limit() == before
    handle.resume()
    assert compat.dynamo_recompile_limit() == max(before, CONFIGURATION_ENTRIES)
    handle.undo()
    assert compat.dynamo_recompile_limit() == before


def test_dropout_off_for_parity_announces_the_switch():
    from speedkit.engine.parity import dropout_off as _dropout_off
    from speedkit.handle import configuration_changes

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    before = configuration_changes()
    with _dropout_off(model):
        assert model[1].p == 0.0 and configuration_changes() == before + 1
    assert model[1].p == 0.1 and configuration_changes() == before + 2


def test_compile_falls_back_to_eager_when_compilation_fails():
    from torch._dynamo.exc import BackendCompilerFailed

    calls = []

    def eager(x):
        calls.append("eager")
        return x + 1

    def broken(x):
        # the constructor's signature differs between torch versions; build it without calling it
        exc = BackendCompilerFailed.__new__(BackendCompilerFailed)
        Exception.__init__(exc, "inductor exploded")
        raise exc

    guarded = GuardedForward(eager, lambda fn: broken, max_recompiles=8)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        assert guarded(torch.ones(1)).item() == 2
    assert "BackendCompilerFailed" in guarded.fallback_reason
    assert guarded(torch.ones(1)).item() == 2 and calls == ["eager", "eager"]


class _FailsUnderCompile(nn.Module):
    """A model whose forward raises while Dynamo traces it: Dynamo gives the frame up and runs it eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 10)

    def forward(self, x):
        if torch.compiler.is_compiling():
            raise RuntimeError("this model cannot be traced")
        return self.net(x)


def test_compile_that_compiled_nothing_is_a_problem_not_a_cache_hit():
    torch._dynamo.reset()
    state = mlp_state()
    state.model = model = _FailsUnderCompile()
    handle = rungs.make({"name": "compile", "options": {"backend": "eager"}}).apply(state)
    with pytest.warns(UserWarning, match="compiled no graph"):
        assert model(torch.randn(4, 16)).shape == (4, 10)
    assert model(torch.randn(4, 16)).shape == (4, 10)
    problem = handle.problem()
    assert problem is not None and "compiled no graph: Dynamo gave up on the forward" in problem, problem
    assert "this model cannot be traced" in problem
    assert not any("compile cache" in line for line in handle.report()), handle.report()
    handle.undo()
    torch._dynamo.reset()  # a second model of a class compiled before: its graph comes from the cache, no problem
    states = [mlp_state() for _ in range(2)]
    handles = [rungs.make({"name": "compile", "options": {"backend": "eager"}}).apply(st) for st in states]
    for st in states:
        st.model(torch.randn(4, 16))
    assert [h.problem() for h in handles] == [None, None]
    for h in handles:
        h.undo()


def test_tf32_reverts_global_flags():
    state = mlp_state()
    rung = rungs.make("tf32")
    if rung.check(state):
        assert "bf16" in rung.check(state) or "already" in rung.check(state)
        return
    before = torch.get_float32_matmul_precision()
    handle = rung.apply(state)
    assert torch.get_float32_matmul_precision() != before
    assert state.precision == "tf32"
    handle.undo()
    assert torch.get_float32_matmul_precision() == before and state.precision == "fp32"


@pytest.mark.parametrize(
    "spec, where",
    [
        ("warp_drive", "ladder[0]"),
        ({"name": "compile", "options": {"mode": "ludicrous"}}, "ladder[0].options.mode"),
        ({"name": "compile", "options": {"fullgraph": "yes"}}, "ladder[0].options.fullgraph"),
        ({"name": "compile", "options": {"max_recompiles": -1}}, "ladder[0].options"),
        ({"name": "autocast", "options": {"dtype": "fp8"}}, "ladder[0].options.dtype"),
        ({"name": "tf32", "options": {"speed": 11}}, "ladder[0].options.speed"),
        ({"options": {}}, "ladder[0]"),
        (42, "ladder[0]"),
    ],
)
def test_bad_rung_specs_name_the_field(spec, where):
    with pytest.raises(ConfigError) as err:
        rungs.make_all([spec])
    assert str(err.value).startswith(where) and "\n" not in str(err.value)


def test_registry_lists_first_rungs_in_ladder_order():
    assert rungs.names()[:4] == ["tf32", "autocast", "fused_optimizer", "compile"]


def test_rung_checks_draw_nothing_from_the_global_rng():
    """Checking and applying rungs must not shift the user's random streams (dropout, shuffling)."""
    state = tiny_gpt_state()
    for name in rungs.names():
        rung = rungs.make(name)
        before = torch.get_rng_state()
        if rung.check(state) is None:
            rung.apply(state).undo()
        assert torch.equal(torch.get_rng_state(), before), name


class _MaskedTransformer(nn.Module):
    """nn.Transformer called with a causal mask and no hint: its decoder asks whether the mask is the
    causal one (``.all()`` on the host), a graph break inside the submodule under compile."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16, dropout=0.0)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(0))
        return self.t(x, x, tgt_mask=mask).sum()


def test_a_change_beneath_compile_that_alters_the_trace_is_traced_from_the_top_as_a_fresh_process_would():
    """Compiled first, the model's frame breaks inside the decoder and Dynamo's guards see nothing past
    the break: a submodule wrapper put in beneath afterwards (as explicit_mask does) ran the old split
    graphs, where a process applying it first traces one graph. A handle marked ``traced`` makes the
    compiled forward compile a copy of it for that configuration, traced from the top: no graph break
    then, and switching the change off and on again runs what each configuration compiled, nothing anew."""
    from torch._dynamo.utils import counters

    from speedkit import compat
    from speedkit.handle import Handle, set_attr
    from speedkit.rungs.explicit_mask import MaskAsGiven

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _MaskedTransformer(), torch.randn(5, 2, 16)
    eager = model.forward
    traced = []  # the graphs Dynamo hands to the backend, as the code they run

    def record(gm, example_inputs):
        traced.append(gm.code)
        return gm.forward

    guarded = GuardedForward(eager, lambda fn: torch.compile(fn, backend=record), max_recompiles=8)
    model.forward = guarded
    expected = eager(x)

    def breaks() -> int:
        return sum(counters["graph_break"].values())

    assert torch.allclose(model(x), expected) and breaks() > 0  # compiled first: split at the decoder's check
    handle = Handle("mask")
    decoder = model.t.decoder
    set_attr(handle, decoder, "forward", MaskAsGiven(decoder.forward, nn.TransformerDecoder))
    handle.traced = True
    guarded.use(eager)  # what compile's handle does when the stack switches it on again above the change
    before, graphs = breaks(), compat.graph_count()
    assert torch.allclose(model(x), expected, atol=1e-6)
    whole = traced[-1]  # one graph from the mask to the loss: the model's frame traced anew from the top
    assert "triu" in whole and "sum" in whole and "linear" in whole, whole
    assert breaks() == before and compat.graph_count() == graphs + 1 and guarded.variants == 2
    graphs = compat.graph_count()
    for on in (False, True, False, True):  # each configuration runs what it compiled
        handle.resume() if on else handle.suspend()
        guarded.use(eager)
        assert torch.allclose(model(x), expected, atol=1e-6)
    assert compat.graph_count() == graphs and guarded.variants == 2
    handle.undo()
    model.forward = eager
