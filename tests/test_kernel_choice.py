"""A norm's kernel or Inductor's code under compile, chosen per shape: the micro-benchmark's decision
with a fake timer (faster by the margin or not), remembered in the store and read back without timing,
nothing measured without CUDA; the baseline's pass records the shapes each norm is fed; triton_layers
gives the class that keeps the kernel under compile only to the norms measured faster at every shape
they are fed, says so per norm, and undo puts the PyTorch class back; under compile that class puts
the kernel's op in the traced graph and the plain swap does not, both computing the same function. A
SwiGLU's ``nn.SiLU`` likewise: its gate's shape recorded, the class that keeps ``silu_mul``'s kernel under
compile given only where measured faster, the product traced as the kernel's op, and its
micro-benchmark runs both paths."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_rel_close
from torch import nn

from speedkit.kernels import choice as kernel_choice
from speedkit.kernels import layers
from speedkit.kernels.choice import ChoiceStore, LayerCase, choose
from speedkit.kernels.recognise import gates
from speedkit.measure import layer_shapes
from speedkit.rungs.triton_layers import TritonLayersOptions, TritonLayersRung, choose_under_compile, plan_triton_layers
from speedkit.training.state import TrainState

CASE = LayerCase("layer_norm", (8, 64, 768), "bfloat16", "bfloat16")


class FakeTimer:
    """Milliseconds per call by what is timed and the case's width; counts its calls, runs nothing."""

    def __init__(self, kernel_ms: dict[int, float], compiled_ms: float = 1.0) -> None:
        self.kernel_ms, self.compiled_ms, self.calls = kernel_ms, compiled_ms, []

    def __call__(self, what, call):
        self.calls.append(what)
        return self.compiled_ms if what == "compiled" else self.kernel_ms[self.width]

    width = 768


def test_the_kernel_is_chosen_only_where_faster_by_the_margin(tmp_path):
    store = ChoiceStore(tmp_path / "k.json")
    assert choose(CASE, torch.device("cpu"), store, FakeTimer({768: 0.90})).use_kernel
    slower = LayerCase("layer_norm", (8, 64, 512), "bfloat16", "bfloat16")
    timer = FakeTimer({768: 0.98})
    timer.width = 512
    timer.kernel_ms[512] = 0.98  # 2% faster: under the 3% margin
    choice = choose(slower, torch.device("cpu"), store, timer)
    assert not choice.use_kernel and "Inductor's code" in choice.why and "3%" in choice.why


def test_a_decision_is_remembered_and_read_back_without_timing(tmp_path):
    path = tmp_path / "k.json"
    first = choose(CASE, torch.device("cpu"), ChoiceStore(path), FakeTimer({768: 0.5}))
    assert first.measured and first.use_kernel and "(measured)" in first.why
    stored = json.loads(path.read_text())
    assert len(stored) == 1 and next(iter(stored.values())) == {"kernel_ms": 0.5, "compiled_ms": 1.0}
    again_timer = FakeTimer({768: 5.0})
    again = choose(CASE, torch.device("cpu"), ChoiceStore(path), again_timer)  # a new store reads the file
    assert again_timer.calls == [] and again.use_kernel and not again.measured and "(remembered)" in again.why
    # another dtype is another case
    other = LayerCase("layer_norm", (8, 64, 768), "float32", None)
    assert kernel_choice.key(other, torch.device("cpu")) != kernel_choice.key(CASE, torch.device("cpu"))


def test_nothing_is_measured_without_cuda(tmp_path):
    choice = choose(CASE, torch.device("cpu"), ChoiceStore(tmp_path / "k.json"))
    assert not choice.use_kernel and "CUDA only" in choice.why and choice.kernel_ms is None


def test_an_unreadable_store_is_left_alone(tmp_path):
    path = tmp_path / "k.json"
    path.write_text("{not json")
    assert ChoiceStore(path).entries == {}


class TwoNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide, self.proj, self.narrow = nn.LayerNorm(24), nn.Linear(24, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.narrow(self.proj(self.wide(x)))


def test_the_counted_pass_records_what_each_norm_is_fed():
    model = TwoNorms()
    with layer_shapes.recording(model) as fed:
        model(torch.randn(3, 5, 24))
        model(torch.randn(3, 5, 24))  # the same input again: recorded once
        model(torch.randn(2, 24))
    assert fed[id(model.wide)] == [((3, 5, 24), torch.float32), ((2, 24), torch.float32)]
    assert fed[id(model.narrow)] == [((3, 5, 16), torch.float32), ((2, 16), torch.float32)]
    assert all(not m._forward_pre_hooks for m in model.modules())
    with layer_shapes.recording(model, when=False) as nothing:
        model(torch.randn(3, 5, 24))
    assert nothing == {}


def _state(model, fed, precision="bf16"):
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu")
    state.notes[layer_shapes.NOTE] = fed
    state.precision = precision
    return state


class WidthTimer(FakeTimer):
    """The kernel faster at width 24, slower at 16."""

    def __call__(self, what, call):
        self.calls.append(what)
        return 1.0 if what == "compiled" else self.kernel_ms[self.current]

    current = 24


def test_triton_layers_keeps_the_kernel_under_compile_only_where_it_was_measured_faster(monkeypatch):
    model = TwoNorms()
    with layer_shapes.recording(model) as fed:
        model(torch.randn(3, 5, 24))
    timer = WidthTimer({24: 0.8, 16: 1.2})
    real_case_of = kernel_choice.case_of

    def case_of(module, shape, dtype, autocast):
        timer.current = shape[-1]
        return real_case_of(module, shape, dtype, autocast)

    monkeypatch.setattr(kernel_choice, "case_of", case_of)
    monkeypatch.setattr(TritonLayersRung, "timer", timer)
    rung = TritonLayersRung()
    state = _state(model, fed)
    assert rung.check(state) is None
    handle = rung.apply(state)
    assert type(model.wide) is layers.LayerNormUnderCompile and type(model.narrow) is layers.LayerNorm
    lines = [c for c in handle.changes if "autocast bfloat16" in c]
    assert any(line.startswith("LayerNorm at layer_norm (3, 5, 24) bfloat16") and ": the kernel" in line for line in lines)
    assert any("(3, 5, 16)" in line and "Inductor's code" in line for line in lines)
    handle.undo()
    assert type(model.wide) is nn.LayerNorm and type(model.narrow) is nn.LayerNorm


def test_a_norm_without_recorded_shapes_or_with_the_option_off_keeps_inductors_code(monkeypatch):
    model = TwoNorms()
    plan = plan_triton_layers(model, TritonLayersOptions())
    chosen, lines = choose_under_compile(_state(model, {}), plan, WidthTimer({24: 0.1, 16: 0.1}))
    assert lines == [] and {cls for _, cls in chosen.swaps} == {layers.LayerNorm}
    monkeypatch.setattr(TritonLayersRung, "timer", WidthTimer({24: 0.1, 16: 0.1}))
    with layer_shapes.recording(model) as fed:
        model(torch.randn(2, 24))
    rung = TritonLayersRung(TritonLayersOptions(kernel_choice=False))
    handle = rung.apply(_state(model, fed))
    assert type(model.wide) is layers.LayerNorm
    handle.undo()


def _graph_keeper(graphs: list[str]):
    """A torch.compile backend that keeps each traced graph's text in ``graphs`` and runs it as traced."""

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    return backend


def test_under_compile_the_chosen_class_traces_the_kernel_and_computes_the_same():
    graphs: list[str] = []
    backend = _graph_keeper(graphs)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=gen)
    outputs = {}
    for cls in (layers.LayerNorm, layers.LayerNormUnderCompile):
        norm = nn.LayerNorm(24)
        with torch.no_grad():
            norm.weight.normal_(generator=gen)
            norm.bias.normal_(generator=gen)
        want = norm(x)
        norm.__class__ = cls
        torch._dynamo.reset()
        outputs[cls] = torch.compile(norm, backend=backend)(x)
        assert_rel_close(outputs[cls], want, 1e-5, cls.__name__)
    plain, kernel = graphs
    assert "speedkit" not in plain and "layer_norm" in plain
    assert "speedkit" in kernel


def test_the_ladders_baseline_records_the_norms_inputs():
    from fakes import VirtualTime, timed_state

    from speedkit.engine.ladder import Ladder

    time = VirtualTime(noise=0.0)
    state = timed_state(time, 0.01)
    norm, act = nn.LayerNorm(32), LibrarySiLU()
    state.model.net.insert(1, norm)  # after the first Linear: fed (batch, hidden)
    state.model.net.insert(2, act)  # a library's own SiLU module: recorded as an nn.SiLU would be
    fast = {"warmup": 1, "steps": 3, "repeats": 3, "parity_steps": 3, "telemetry": False, "profile": False}
    Ladder(state, [], fast, clock=time.clock(), host_clock=time).run()
    assert state.notes[layer_shapes.NOTE][id(norm)] == [((8, 32), torch.float32)]
    assert state.notes[layer_shapes.NOTE][id(act)] == [((8, 32), torch.float32)]
    assert state.notes[kernel_choice.NOTE].path is None  # no decision cache: the measurements kept in memory
    assert not norm._forward_pre_hooks and not act._forward_pre_hooks


def test_the_store_follows_the_ladders_cache(tmp_path):
    in_memory = ChoiceStore(None)
    assert kernel_choice.store_for({kernel_choice.NOTE: in_memory}) is in_memory  # the ladder's, cache off: memory only
    notes = {}
    first = kernel_choice.store_for(notes)  # no ladder: speedkit's cache folder, kept for the run
    assert first.path.name == kernel_choice.STORE_NAME and kernel_choice.store_for(notes) is first


def test_a_case_is_measured_once_a_run_with_the_cache_off_and_the_plan_check_made_stays_as_made(monkeypatch):
    model = TwoNorms()
    with layer_shapes.recording(model) as fed:
        model(torch.randn(3, 5, 24))
    timer = WidthTimer({24: 0.8, 16: 0.8})
    monkeypatch.setattr(TritonLayersRung, "timer", timer)
    state = _state(model, fed)
    state.notes[kernel_choice.NOTE] = ChoiceStore(None)
    rung = TritonLayersRung()
    assert rung.check(state) is None
    made = rung.plan(model)
    rung.apply(state).undo()
    assert timer.calls == ["kernel", "compiled", "kernel", "compiled"]  # two norms, one shape each
    rung.apply(state).undo()  # tried again in the same run (a second look): remembered, not timed
    assert len(timer.calls) == 4
    assert {cls for _, cls in made.swaps} == {layers.LayerNorm}


class LibrarySiLU(nn.Module):
    """transformers' ``ACT2FN["silu"]`` as the library writes it (``SiLUActivation``): not an ``nn.SiLU``."""

    def forward(self, input):
        return nn.functional.silu(input)


class LlamaLikeMLP(nn.Module):
    """A SwiGLU MLP as transformers writes Llama's: ``down(act_fn(gate(x)) * up(x))``, ``act_fn`` an
    ``nn.SiLU`` or the library's own SiLU module."""

    def __init__(self, act: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(24, 40), nn.Linear(24, 40), nn.Linear(40, 24)
        self.act_fn = act()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GateTimer(FakeTimer):
    """A gated product's kernel at ``kernel_ms`` against 1.0 ms compiled; counts its calls, runs nothing."""

    def __init__(self, kernel_ms: float) -> None:
        super().__init__({}, 1.0)
        self.kernel = kernel_ms

    def __call__(self, what, call):
        self.calls.append(what)
        return 1.0 if what == "compiled" else self.kernel


class LibraryGELUTanh(nn.Module):
    """transformers' ``GELUTanh`` (Gemma's ``ACT2FN["gelu_pytorch_tanh"]``): not an ``nn.GELU``."""

    def forward(self, input):
        return nn.functional.gelu(input, approximate="tanh")


#: a gated MLP's activation -> (the class it has in eager runs, its label and kind in the kernel choice's lines)
GATED = {
    nn.SiLU: (nn.SiLU, "SwiGLU at swiglu"),
    LibrarySiLU: (layers.SiLU, "SwiGLU at swiglu"),
    nn.GELU: (nn.GELU, "GeGLU at geglu"),
    LibraryGELUTanh: (layers.GELUTanh, "GeGLU at geglu_tanh"),
}


@pytest.mark.parametrize("act", list(GATED), ids=lambda c: c.__name__)
def test_a_gated_activation_keeps_the_kernel_under_compile_only_where_it_was_measured_faster(monkeypatch, act):
    eager, label = GATED[act]  # a library's module becomes one silu_mul / gelu_mul knows
    for kernel_ms, chosen in ((0.8, True), (0.99, False)):
        model = LlamaLikeMLP(act)
        with layer_shapes.recording(model, also=gates) as fed:  # as the baseline records
            model(torch.randn(3, 5, 24))
        assert fed[id(model.act_fn)] == [((3, 5, 40), torch.float32)]  # the gate, as the baseline fed it
        monkeypatch.setattr(TritonLayersRung, "timer", GateTimer(kernel_ms))
        state = _state(model, fed)
        state.notes[kernel_choice.NOTE] = ChoiceStore()  # in memory: each case measured afresh
        handle = TritonLayersRung().apply(state)
        line = next(c for c in handle.changes if c.startswith(f"{label} (3, 5, 40) bfloat16"))
        assert (": the kernel" in line) is chosen and ("Inductor's code" in line) is not chosen, line
        under = layers.UNDER_COMPILE[eager]
        assert type(model.act_fn) is (under if chosen else eager)
        assert_rel_close(model.act_fn(torch.linspace(-5, 5, 11)), act()(torch.linspace(-5, 5, 11)), 0.0, "alone")
        handle.undo()
        assert type(model.act_fn) is act and (
            act in (nn.SiLU, nn.GELU) or not vars(model.act_fn).keys() & {"inplace", "approximate"}
        )


def test_under_compile_the_chosen_swiglu_traces_the_kernel_and_computes_the_same():
    graphs: list[str] = []
    backend = _graph_keeper(graphs)
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(3, 7, 40, generator=gen), torch.randn(3, 7, 40, generator=gen)
    want = nn.functional.silu(gate) * up
    library_act = LibrarySiLU()
    library_act.__class__ = layers.SiLUUnderCompile  # as triton_layers gives it: no inplace of its own
    for cls, act in ((nn.SiLU, nn.SiLU()), (layers.SiLUUnderCompile, layers.SiLUUnderCompile()), ("library", library_act)):
        torch._dynamo.reset()
        got = torch.compile(lambda g, u, act=act: layers.silu_mul(g, u, act), backend=backend)(gate, up)
        name = getattr(cls, "__name__", cls)
        assert_rel_close(got, want, 1e-5, name)
        assert_rel_close(act(gate), nn.functional.silu(gate), 1e-6, f"{name} alone")
    plain, kernel, library = graphs
    assert "speedkit" not in plain and "silu" in plain
    assert "speedkit" in kernel and "speedkit" in library


@pytest.mark.parametrize(
    ("act", "kind"),
    [(nn.SiLU(), "swiglu"), (nn.GELU(), "geglu"), (LibraryGELUTanh(), "geglu_tanh")],
    ids=["silu", "gelu", "tanh"],
)
def test_the_gated_micro_benchmark_times_the_kernel_and_the_compiled_product(act, kind):
    seen = []

    def timer(what, call):
        call()  # one forward and backward: both paths run (the kernel under Triton's interpreter here)
        seen.append(what)
        return 1.0

    case = kernel_choice.case_of(act, (3, 7, 40), torch.float32, torch.bfloat16)
    assert case == LayerCase(kind, (3, 7, 40), "bfloat16", None, affine=False, bias=False, eps=None)
    torch._dynamo.reset()
    fp32 = LayerCase(kind, (3, 7, 40), "float32", None, affine=False, bias=False, eps=None)
    assert kernel_choice.measure(fp32, torch.device("cpu"), timer) == (1.0, 1.0) and seen == ["kernel", "compiled"]


def test_under_compile_the_chosen_geglu_traces_the_kernel_and_computes_the_same():
    graphs: list[str] = []
    backend = _graph_keeper(graphs)
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(3, 7, 40, generator=gen), torch.randn(3, 7, 40, generator=gen)
    library = LibraryGELUTanh()
    library.__class__ = layers.GELUTanhUnderCompile  # as triton_layers gives it: no approximate of its own
    for act in (nn.GELU(approximate="tanh"), layers.GELUTanhUnderCompile(), library):
        torch._dynamo.reset()
        got = torch.compile(lambda g, u, act=act: layers.gelu_mul(g, u, act), backend=backend)(gate, up)
        assert_rel_close(got, nn.functional.gelu(gate, approximate="tanh") * up, 1e-5, type(act).__name__)
    plain, kernel, from_library = graphs
    assert "speedkit" not in plain and "gelu" in plain
    assert "speedkit" in kernel and "speedkit" in from_library
