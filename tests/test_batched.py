"""batched rung: each form computes what the user's code computed (outputs and gradients), the
near misses are left alone with their reason, and undo puts every module back exactly."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from speedkit.data import BatchSource
from speedkit.demos.batched import (
    Ensemble,
    HeadsList,
    LoopGEMMModel,
    LoopOfGEMMs,
    SiblingProjections,
    SyntheticGEMMs,
)
from speedkit.kernels import ops
from speedkit.rungs.batched import NOTHING_FOUND, BatchedOptions, BatchedRung
from speedkit.training.state import TrainState

# fp32 throughout: the batched GEMM may sum in another order than the per-slice ones
RTOL, ATOL = 1e-5, 1e-6


# -- models: one per form, odd shapes --------------------------------------------------------------


class OddSiblings(nn.Module):
    """Three Linears of different widths on one input, all inside one return statement."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 5), nn.Linear(7, 3), nn.Linear(7, 11)

    def forward(self, x):
        return self.a(x) * 2, self.b(x) + self.c(x).sum(-1, keepdim=True)


class StoreLoop(nn.Module):
    """``out[i] = torch.matmul(x[i], w)``: a shared 2-D weight, written into a preallocated tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 5))

    def forward(self, x):
        out = x.new_zeros(x.shape[0], x.shape[1], 5)
        for i in range(x.shape[0]):
            out[i] = torch.matmul(x[i], self.w)
        return out


class ExtendLoop(nn.Module):
    """``outs.append(torch.bmm(a[i], w[i]))`` on 3-D slices; the list itself is returned."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 2, 7, 5))

    def forward(self, a):
        outs = []
        for i in range(len(self.w)):
            outs.append(torch.bmm(a[i], self.w[i]))
        return outs


class BroadcastLoop(nn.Module):
    """``a[i] (m, k) @ w (B, k, p)``: the shared operand has batch dims of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 7, 5))

    def forward(self, a):
        outs = []
        for i in range(a.shape[0]):
            outs.append(a[i] @ self.w)
        return torch.stack(outs, dim=0)


class LinearLoop(nn.Module):
    """A ModuleList of Linears, one per slice (``layers[i](x[i])``) and all on one input (``layers[j](s)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(7, 5) for _ in range(4))

    def forward(self, x, shared):
        outs = []
        for i in range(len(self.layers)):
            outs.append(self.layers[i](x[i]))
        y = torch.stack(outs)
        res = torch.zeros(len(self.layers), *shared.shape[:-1], 5)
        for j in range(len(self.layers)):
            res[j] = self.layers[j](shared)
        return y, res


class TupleMember(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 6)
        self.scale = 0.5

    def forward(self, x):
        h = self.lin(x)
        return h.tanh(), h * self.scale


class TupleEnsemble(nn.Module):
    """Identical members returning tuples."""

    def __init__(self) -> None:
        super().__init__()
        self.members = nn.ModuleList(TupleMember() for _ in range(3))

    def forward(self, x):
        outs = [m(x) for m in self.members]
        return sum(a for a, _ in outs), torch.cat([b for _, b in outs], -1)


POSITIVE = {
    # name: (model factory, input factories (fresh random, odd shapes), rewritten sites)
    "siblings_qkv_gate_up": (lambda: SiblingProjections(dim=12, n_head=3, hidden=10), [lambda: torch.randn(2, 5, 12)], 2),
    "siblings_in_return": (OddSiblings, [lambda: torch.randn(3, 2, 7)], 1),
    "heads_list": (lambda: HeadsList(dim=7, head_dim=3, n_heads=5), [lambda: torch.randn(4, 7)], 1),
    "ensemble": (lambda: Ensemble(dim=7, hidden=9, out=5, members=3), [lambda: torch.randn(6, 7)], 1),
    "ensemble_tuples": (TupleEnsemble, [lambda: torch.randn(5, 7)], 1),
    "loop_stack": (lambda: LoopOfGEMMs(n=5, dim=7), [lambda: torch.randn(5, 7, 7)], 1),
    "loop_store": (StoreLoop, [lambda: torch.randn(6, 3, 7)], 1),
    "loop_extend": (ExtendLoop, [lambda: torch.randn(4, 2, 3, 7)], 1),
    "loop_broadcast": (BroadcastLoop, [lambda: torch.randn(6, 2, 7)], 1),
    "loop_linear_2d": (LinearLoop, [lambda: torch.randn(4, 7), lambda: torch.randn(7)], 2),
    "loop_linear_3d": (LinearLoop, [lambda: torch.randn(4, 3, 7), lambda: torch.randn(2, 3, 7)], 2),
}


def _state(model: nn.Module) -> TrainState:
    return TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), device=torch.device("cpu"))


def _run(model: nn.Module, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Outputs, input gradients and parameter gradients of a fixed random projection of the outputs."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    model.zero_grad(set_to_none=True)
    outs, _ = tree_flatten(model(*inputs))
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    return ([o.detach() for o in outs], [t.grad for t in inputs], {n: p.grad for n, p in model.named_parameters()})


def _assert_same_math(model: nn.Module, reference: nn.Module, inputs: list[torch.Tensor]) -> None:
    out, in_grads, p_grads = _run(model, inputs)
    ref_out, ref_in_grads, ref_p_grads = _run(reference, inputs)
    assert len(out) == len(ref_out)
    for a, b in zip(out + in_grads, ref_out + ref_in_grads):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert p_grads.keys() == ref_p_grads.keys()
    for name in p_grads:
        assert p_grads[name] is not None, f"no gradient reached {name}"
        torch.testing.assert_close(p_grads[name], ref_p_grads[name], rtol=RTOL, atol=ATOL, msg=name)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _gemms(model: nn.Module, *inputs: torch.Tensor) -> int:
    with torch.no_grad(), _CountOps() as mode:
        model(*inputs)
    return sum(mode.counts[k] for k in ("mm", "bmm", "addmm", "baddbmm", "matmul", "dot", "mv"))


# -- each form: same outputs and gradients ---------------------------------------------------------


@pytest.mark.parametrize("name", list(POSITIVE))
def test_rewritten_forward_matches_original_outputs_and_gradients(name):
    factory, input_factories, sites = POSITIVE[name]
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    handle = BatchedRung().apply(_state(model))
    assert handle.rewrite.counts["rewritten"] == sites, handle.changes
    assert "forward" in model.__dict__
    for _ in range(2):  # fresh inputs each time
        _assert_same_math(model, reference, [f() for f in input_factories])
    handle.undo()


def test_loop_of_gemms_becomes_one_gemm():
    model = LoopOfGEMMs(n=6, dim=5)
    x = torch.randn(6, 5, 5)
    assert _gemms(model, x) == 6
    handle = BatchedRung().apply(_state(model))
    assert _gemms(model, x) == 1
    assert "stacked loop over range(self.n) of matmuls" in handle.changes[0]
    handle.undo()
    assert _gemms(model, x) == 6


def test_siblings_and_heads_become_one_gemm_each():
    model = SiblingProjections(dim=12, n_head=3, hidden=10)
    x = torch.randn(2, 5, 12)
    assert _gemms(model, x) == 7  # q, k, v, o, gate, up, down (attention itself runs in SDPA)
    handle = BatchedRung().apply(_state(model))
    assert _gemms(model, x) == 4
    assert handle.changes[0] == (
        "batched: rewrote 2 sites in 1 modules (SiblingProjections: fused q_proj,k_proj,v_proj Linear ×1, "
        "fused gate_proj,up_proj Linear ×1)"
    )
    handle.undo()
    heads = HeadsList(dim=7, head_dim=3, n_heads=5)
    BatchedRung().apply(_state(heads))
    assert _gemms(heads, torch.randn(4, 7)) == 1


def test_ensemble_runs_the_members_forward_once_under_vmap():
    model = TupleEnsemble()
    calls = []
    hook_free_counter = TupleMember.forward

    def counting(self, x):
        calls.append(1)
        return hook_free_counter(self, x)

    BatchedRung().apply(_state(model))
    TupleMember.forward = counting
    try:
        model(torch.randn(2, 7))
    finally:
        TupleMember.forward = hook_free_counter
    assert len(calls) == 1  # the loop would call it three times


# -- near misses: left alone, with the reason -------------------------------------------------------


class TwoStatementLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 4))

    def forward(self, x):
        outs = []
        for i in range(3):
            y = x[i] @ self.w[i]
            outs.append(y)
        return torch.stack(outs)


class LoopVariableAfter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 4))

    def forward(self, x):
        outs = []
        for i in range(3):
            outs.append(x[i] @ self.w[i])
        return torch.stack(outs) * (i + 1)


class ZipAndRangeStartLoops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 4))

    def forward(self, x):
        outs = []
        for a, w in zip(x, self.w):
            outs.append(a @ w)
        for i in range(0, 3):
            outs.append(x[i] @ self.w[i])
        return torch.stack(outs)


class QKV(nn.Module):
    """q, k, v projections; tests add hooks or swap layers."""

    def __init__(self, k_bias: bool = True, v_in: int = 7) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(7, 5), nn.Linear(7, 5, bias=k_bias), nn.Linear(v_in, 4)

    def forward(self, x):
        q = self.q(x)
        k = self.k(x)
        v = self.v(x)
        return q * k, v


class InPlaceSiblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(7, 5), nn.Linear(7, 5)

    def forward(self, x):
        q = self.q(x)
        k = self.k(x)
        q.mul_(0.5)
        return q + k


class _MLP(nn.Sequential):
    def __init__(self, hidden: int) -> None:
        super().__init__(nn.Linear(7, hidden), nn.Tanh(), nn.Linear(hidden, 5))


class MixedEnsemble(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.members = nn.ModuleList([_MLP(9), _MLP(11)])

    def forward(self, x):
        return torch.stack([m(x) for m in self.members]).mean(0)


class ConfigDiffersEnsemble(nn.Module):
    """Same parameters, different behaviour: GELU(approximate='tanh') in one member."""

    def __init__(self) -> None:
        super().__init__()
        self.members = nn.ModuleList(
            [nn.Sequential(nn.Linear(7, 5), nn.GELU()), nn.Sequential(nn.Linear(7, 5), nn.GELU(approximate="tanh"))]
        )

    def forward(self, x):
        return torch.stack([m(x) for m in self.members]).sum(0)


def _identity(fn):
    return fn


class DecoratedSiblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(7, 5), nn.Linear(7, 5)

    @_identity
    def forward(self, x):
        return self.a(x) + self.b(x)


class PrivateScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(7, 5), nn.Linear(7, 5)
        self.__scale = 2.0

    def forward(self, x):
        return (self.a(x) + self.b(x)) * self.__scale


class _Root(nn.Module):
    def combine(self, y):
        return y * 10


class _WithSuper(_Root):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(7, 5), nn.Linear(7, 5)

    def combine(self, y):
        return y

    def forward(self, x):
        return super().combine(self.a(x) + self.b(x))


class InheritsSuperForward(_WithSuper):
    """Its forward's super() means _Root: recompiled for this class it would mean _WithSuper."""


def _hooked_k() -> nn.Module:
    model = QKV()
    model.k.register_forward_hook(lambda module, args, out: out * 2)
    return model


NEGATIVE = {
    # name: (model factory, input shape, sites still rewritten, reason expected in the report)
    "loop_two_statements": (TwoStatementLoop, (3, 4, 4), 0, "loop body has 2 statements"),
    "loop_variable_used_after": (LoopVariableAfter, (3, 4, 4), 0, "loop variable 'i' is read outside the loop"),
    "loop_zip": (ZipAndRangeStartLoops, (3, 4, 4), 0, "loop over zip(x, self.w): only `for i in range(N)`"),
    "loop_range_start": (ZipAndRangeStartLoops, (3, 4, 4), 0, "only range with one argument"),
    "linear_with_forward_hook": (_hooked_k, (2, 7), 1, "self.k has forward hook"),
    "bias_all_or_none": (
        lambda: QKV(k_bias=False),
        (2, 7),
        1,
        "self.k not fused with its siblings on x: no bias where the others have one",
    ),
    "different_in_features": (
        lambda: QKV(v_in=6),
        None,
        1,
        "self.v not fused with its siblings on x: in_features 6 where the others have 7",
    ),
    "linear_subclass": (
        lambda: _swap(QKV(), "v", type("MyLinear", (nn.Linear,), {})(7, 4)),
        (2, 7),
        1,
        "self.v is a MyLinear, not an nn.Linear",
    ),
    "outputs_modified_in_place": (InPlaceSiblings, (2, 7), 0, "q modified in place"),
    "ensemble_members_of_different_shapes": (MixedEnsemble, (3, 7), 0, "member 1 differs from member 0"),
    "ensemble_members_configured_differently": (ConfigDiffersEnsemble, (3, 7), 0, "member 1.1.approximate differs"),
    "decorated_forward": (DecoratedSiblings, (2, 7), 0, "decorated"),
}


def _swap(model: nn.Module, attr: str, module: nn.Module) -> nn.Module:
    setattr(model, attr, module)
    return model


@pytest.mark.parametrize("name", list(NEGATIVE))
def test_near_misses_are_left_alone_with_the_reason(name):
    factory, shape, rewritten, reason = NEGATIVE[name]
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    rung = BatchedRung()
    check = rung.check(_state(model))
    handle = rung.apply(_state(model))
    assert handle.rewrite.counts["rewritten"] == rewritten, handle.changes
    assert any(reason in line for line in handle.rewrite.left_alone), handle.rewrite.left_alone
    assert any(line.startswith("left alone: ") and reason in line for line in handle.changes)
    if rewritten == 0:
        assert check is not None and "none rewritable" in check and reason in check
        assert "forward" not in model.__dict__
    if shape is not None:
        _assert_same_math(model, reference, [torch.randn(*shape)])
    handle.undo()


@pytest.mark.parametrize("factory", [PrivateScale, InheritsSuperForward])
def test_private_names_and_inherited_super_keep_their_meaning(factory):
    """Recompiled forwards mangle `self.__x` like their class and keep their own super() class."""
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    handle = BatchedRung().apply(_state(model))
    assert handle.rewrite.counts["rewritten"] == 1, handle.changes
    _assert_same_math(model, reference, [torch.randn(2, 7)])
    handle.undo()


def test_nothing_found_says_so():
    from speedkit.demos import LaunchBoundMLP

    model = LaunchBoundMLP(features=8, hidden=8, depth=2)
    assert BatchedRung().check(_state(model)) == NOTHING_FOUND
    handle = BatchedRung().apply(_state(model))
    assert handle.rewrite.counts["found"] == 0 and "forward" not in model.__dict__


class Blocks(nn.Module):
    """Lists of blocks (not Linears), indexed in loops and chained: nothing for this rung."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(2))
        self.norm, self.drop = nn.LayerNorm(6), nn.Dropout(0.0)

    def forward(self, x):
        for i in range(len(self.blocks)):
            x = self.blocks[i](x)
        for block in self.blocks:
            x = block(x)
        outs = []
        for i in range(2):
            outs.append(self.blocks[i](x[i]))
        return self.norm(x) + self.drop(x), torch.stack(outs)


def test_own_forward_with_super_is_rewritten():
    torch.manual_seed(0)
    model = _WithSuper()
    reference = copy.deepcopy(model)
    assert BatchedRung().apply(_state(model)).rewrite.counts["rewritten"] == 1
    _assert_same_math(model, reference, [torch.randn(3, 7)])


def test_other_modules_are_not_reported():
    """Norms, dropouts and blocks called on one input, or per slice, are no Linear candidates: no noise."""
    for model in (SiblingProjections(dim=12, n_head=3, hidden=10), Blocks()):
        handle = BatchedRung().apply(_state(model))
        assert handle.rewrite.left_alone == (), handle.rewrite
        handle.undo()
    assert BatchedRung().check(_state(Blocks())) == NOTHING_FOUND


def test_options_switch_forms_off():
    model = SiblingProjections(dim=12, n_head=3, hidden=10)
    rung = BatchedRung(BatchedOptions(linears=False))
    assert rung.check(_state(model)) == NOTHING_FOUND
    loop = LoopOfGEMMs(n=3, dim=4)
    assert BatchedRung(BatchedOptions(loops=False)).check(_state(loop)) == NOTHING_FOUND
    assert (
        BatchedRung(BatchedOptions(ensembles=False)).check(_state(Ensemble(dim=7, hidden=9, out=5, members=3))) == NOTHING_FOUND
    )


def test_hook_added_after_apply_is_still_honoured():
    """The runtime re-checks: a hook registered later (a profiler, a summary) takes the original path."""
    torch.manual_seed(0)
    model = QKV()
    reference = copy.deepcopy(model)
    BatchedRung().apply(_state(model))
    for m in (model, reference):
        m.k.register_forward_hook(lambda module, args, out: out * 3)
    _assert_same_math(model, reference, [torch.randn(2, 7)])


# -- reversibility, state dicts, training, compile -------------------------------------------------


def _fingerprint(state: TrainState) -> dict:
    model = state.model
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "param_ids": [id(p) for p in model.parameters()],
        "opt_param_ids": [id(p) for g in state.optimizer.param_groups for p in g["params"]],
        "dicts": [(n, sorted(m.__dict__)) for n, m in model.named_modules()],
        "repr": repr(model),
    }


@pytest.mark.parametrize("name", ["siblings_qkv_gate_up", "heads_list", "ensemble", "loop_stack", "loop_linear_3d"])
def test_apply_undo_apply_is_stable_and_undo_restores_exactly(name):
    factory, input_factories, sites = POSITIVE[name]
    torch.manual_seed(0)
    model = factory()
    state = _state(model)
    before = _fingerprint(state)
    inputs = [f() for f in input_factories]
    with torch.no_grad():
        expected, _ = tree_flatten(model(*inputs))
    rung = BatchedRung()
    for _ in range(2):
        handle = rung.apply(state)
        assert handle.rewrite.counts["rewritten"] == sites
        assert [id(p) for p in state.optimizer.param_groups[0]["params"]] == before["param_ids"]
        handle.undo()
        handle.undo()  # idempotent
        after = _fingerprint(state)
        for key in ("param_ids", "opt_param_ids", "dicts", "repr"):
            assert after[key] == before[key], key
        for k, v in before["params"].items():
            assert torch.equal(v, after["params"][k])
        assert all("forward" not in m.__dict__ for m in model.modules())
        with torch.no_grad():
            again, _ = tree_flatten(model(*inputs))
        for a, b in zip(expected, again):
            assert torch.equal(a, b)


def test_applying_twice_without_undo_finds_nothing_left_to_batch():
    """A second application reads the rewritten source (rewrites stack): the loop is gone."""
    model = LoopOfGEMMs(n=3, dim=4)
    first = BatchedRung().apply(_state(model))
    assert BatchedRung().check(_state(model)) == NOTHING_FOUND
    first.undo()
    assert BatchedRung().check(_state(model)) is None


@pytest.mark.parametrize("name", ["siblings_qkv_gate_up", "heads_list", "ensemble", "loop_stack"])
def test_state_dict_after_rewrite_loads_strictly_into_the_original(name):
    factory, input_factories, _ = POSITIVE[name]
    torch.manual_seed(0)
    model = factory()
    BatchedRung().apply(_state(model))
    saved = copy.deepcopy(model.state_dict())
    torch.manual_seed(1)
    fresh = factory()
    fresh.load_state_dict(saved, strict=True)
    inputs = [f() for f in input_factories]
    with torch.no_grad():
        for a, b in zip(tree_flatten(model(*inputs))[0], tree_flatten(fresh(*inputs))[0]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_training_steps_after_apply_match_the_original():
    """A LightningModule through speedkit's own PlainStep: the optimizer still drives the live parameters."""
    states = []
    for rewrite in (False, True):
        torch.manual_seed(0)
        model = LoopGEMMModel(n=5, dim=6)
        dm = SyntheticGEMMs(n=5, dim=6, batches=4)
        state = TrainState(
            model=model,
            optimizer=model.configure_optimizers(),
            device=torch.device("cpu"),
            data=BatchSource(dm.train_dataloader(), torch.device("cpu")),
        )
        if rewrite:
            handle = BatchedRung().apply(state)
            assert handle.rewrite.counts["rewritten"] == 1 and "LoopOfGEMMs" in handle.changes[0]
        batches = state.data.iterator()
        losses = [state.step([next(batches)], i).item() for i in range(3)]
        states.append((state, losses))
    (ref, ref_losses), (new, new_losses) = states
    assert new_losses == pytest.approx(ref_losses, rel=1e-5)
    for (name, a), b in zip(ref.model.named_parameters(), new.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert new.optimizer.state  # AdamW state was created for the live parameters


@pytest.mark.parametrize("name", ["siblings_qkv_gate_up", "heads_list", "loop_stack", "loop_linear_3d", "ensemble"])
def test_torch_compile_of_a_rewritten_module_gives_the_same_outputs(name):
    factory, input_factories, _ = POSITIVE[name]
    torch.manual_seed(0)
    model = factory()
    BatchedRung().apply(_state(model))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    inputs = [f() for f in input_factories]
    with torch.no_grad():
        for a, b in zip(tree_flatten(compiled(*inputs))[0], tree_flatten(model(*inputs))[0]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    torch._dynamo.reset()


# -- the runtime on its own: every shape either batches exactly or replays the loop --------------------


@pytest.mark.parametrize(
    "a_shape, b_shape, a_indexed, b_indexed",
    [
        ((5, 3, 4), (5, 4, 2), True, True),
        ((5, 3, 4), (4, 2), True, False),
        ((3, 4), (5, 4, 2), False, True),
        ((5, 2, 3, 4), (5, 4, 2), True, True),  # 3-D slices against 2-D slices
        ((5, 3, 4), (5, 2, 4, 6), True, True),
        ((5, 3, 4), (2, 4, 6), True, False),  # shared operand with its own batch dim
        ((2, 3, 4), (5, 4, 6), False, True),
        ((7, 3, 4), (5, 4, 2), True, True),  # longer than the loop: only the first n slices
        ((5, 4), (5, 4, 2), True, True),  # 1-D slices: the loop is replayed
        ((5, 4), (4,), True, False),
    ],
)
def test_loop_matmul_equals_the_loop(a_shape, b_shape, a_indexed, b_indexed):
    a, b, n = torch.randn(*a_shape), torch.randn(*b_shape), 5
    expected = torch.stack([(a[i] if a_indexed else a) @ (b[i] if b_indexed else b) for i in range(n)])
    torch.testing.assert_close(ops.loop_matmul(a, b, n, a_indexed, b_indexed), expected, rtol=RTOL, atol=ATOL)
    # a list of equal tensors is stacked; of unequal ones, looped
    if a_indexed:
        torch.testing.assert_close(ops.loop_matmul(list(a), b, n, True, b_indexed), expected, rtol=RTOL, atol=ATOL)
    assert ops.loop_matmul(a, b, 0, a_indexed, b_indexed) == []  # nothing to extend or store; torch.stack([]) fails as before


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "x_shape, x_indexed",
    [
        ((5, 7), True),
        ((5, 2, 7), True),
        ((5, 2, 3, 7), True),
        ((6, 2, 7), True),
        ((5, 0, 7), True),
        ((7,), False),
        ((2, 7), False),
        ((2, 3, 7), False),
    ],
)
def test_loop_linear_broadcasts_like_the_loop(bias, x_shape, x_indexed):
    layers = nn.ModuleList(nn.Linear(7, 3, bias=bias) for _ in range(5))
    x = torch.randn(*x_shape)
    expected = torch.stack([layers[i](x[i] if x_indexed else x) for i in range(5)])
    out = ops.loop_linear(layers, x, 5, x_indexed)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


def test_store_slices_and_unequal_lists_fall_back_to_the_loop():
    out = torch.zeros(4, 3, 2)
    ops.store_slices(out, 3, torch.ones(3, 3, 2))
    assert out[:3].eq(1).all() and out[3].eq(0).all()
    listed = [None] * 3
    ops.store_slices(listed, 3, torch.arange(6.0).view(3, 2))
    assert [t.tolist() for t in listed] == [[0, 1], [2, 3], [4, 5]]
    ragged = [torch.randn(2, 4), torch.randn(3, 4)]
    w = torch.randn(4, 5)
    results = ops.loop_matmul(ragged, w, 2, True, False)  # ragged slices: the loop, result by result
    assert [tuple(r.shape) for r in ops.unstack(results)] == [(2, 5), (3, 5)]
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        ops.stack(results)  # where the user's code stacked them, it fails as it did


def test_ensemble_returns_dicts_and_tuples_per_member():
    class DictMember(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return {"y": self.lin(x), "pair": (x.sum(), self.lin(x).sum())}

    members = [DictMember() for _ in range(3)]
    x = torch.randn(4, 3)
    for got, member in zip(ops.ensemble(members, x), members):
        want = member(x)
        torch.testing.assert_close(got["y"], want["y"])
        torch.testing.assert_close(got["pair"][1], want["pair"][1])
        assert isinstance(got["pair"], tuple)


def test_the_rewrite_report_is_typed_and_apply_reuses_the_plan_check_made(monkeypatch):
    from speedkit.rewrite.pipeline import RewriteReport
    from speedkit.rungs import batched

    model = LoopOfGEMMs(n=3, dim=4)
    rung = BatchedRung()
    real_plan, plans = batched.plan_batched, []

    def counting(*args):
        plans.append(args)
        return real_plan(*args)

    monkeypatch.setattr(batched, "plan_batched", counting)
    assert rung.check(_state(model)) is None
    handle = rung.apply(_state(model))
    assert len(plans) == 1  # planned once, in check
    assert isinstance(handle.rewrite, RewriteReport)
    report = handle.rewrite.as_dict()
    assert list(report) == ["found", "rewritten", "modules", "rewrites", "left_alone"]
    assert (report["found"], report["rewritten"], report["modules"], report["left_alone"]) == (1, 1, 1, [])
    assert len(report["rewrites"]) == 1 and report["rewrites"][0].startswith("LoopOfGEMMs: ")
    handle.undo()
    model.extra = torch.nn.Linear(2, 2)  # the model changed: planned again
    rung.apply(_state(model)).undo()
    assert len(plans) == 2


def test_speedkit_apply_reads_the_rewrite_reports():
    import speedkit

    model = LoopOfGEMMs(n=3, dim=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sk = speedkit.apply(model, opt, None, rungs=["batched"], loss_fn=lambda m, b, i: m(b).sum())
    assert sk.rewrites == {"batched": sk.handles[0].rewrite.as_dict()} and sk.rewrites["batched"]["rewritten"] == 1
    sk.undo()
    assert sk.rewrites == {}
