"""fused_optimizer over every optimizer class torch.optim exports (found at run time, so a class a
new torch adds is tested too): where the rung does not apply its reason is true; where it does, it
picks fused where torch's own ``fused=True`` optimizer runs and foreach otherwise, the updates equal
the original implementation's, and undo / suspend / resume put back exactly the flags it had."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from conftest import assert_rel_close
from torch import nn

from speedkit import compat
from speedkit.rungs.fused_optimizer import FusedOptimizerOptions, FusedOptimizerRung
from speedkit.training.state import TrainState

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-5  # fp32: the implementations round in another order, nothing more

OPTIMIZERS = sorted(
    (
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    ),
    key=lambda c: c.__name__,
)

#: settings that select other code paths of a class (each class also runs with its defaults, and
#: with maximize=True where it takes it)
EXTRA: dict[str, list[dict[str, Any]]] = {
    "Adam": [{"amsgrad": True, "weight_decay": 0.1}],
    "AdamW": [{"amsgrad": True}],
    "SGD": [{"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, {"momentum": 0.9, "dampening": 0.1}],
    "Adagrad": [{"lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.1}],
    "RMSprop": [{"centered": True, "momentum": 0.9}],
    "NAdam": [{"decoupled_weight_decay": True, "weight_decay": 0.1}],
    "RAdam": [{"decoupled_weight_decay": True, "weight_decay": 0.1}],
    "Adafactor": [{"weight_decay": 0.1}],
    "ASGD": [{"t0": 1.0}],
}
#: a larger step than some defaults, so that 3 steps move the parameters visibly
LR = {"SGD": 0.1, "Adadelta": 1.0, "ASGD": 0.1}


def _takes(cls: type, flag: str) -> bool:
    return flag in inspect.signature(cls.__init__).parameters


APPLICABLE = [c for c in OPTIMIZERS if _takes(c, "fused") or _takes(c, "foreach")]
NOT_APPLICABLE = [c for c in OPTIMIZERS if c not in APPLICABLE]
CASES = [
    pytest.param(cls, {"lr": LR.get(cls.__name__, 1e-2), **kw}, id=f"{cls.__name__}-{'-'.join(kw) or 'defaults'}")
    for cls in APPLICABLE
    for kw in [{}, *([{"maximize": True}] if _takes(cls, "maximize") else []), *EXTRA.get(cls.__name__, [])]
]


def test_discovery_finds_the_known_classes():
    names = {c.__name__ for c in OPTIMIZERS}
    assert {"Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "LBFGS", "SparseAdam"} <= names
    assert {"LBFGS", "SparseAdam"} <= {c.__name__ for c in NOT_APPLICABLE}


# -- helpers -------------------------------------------------------------------------------------------------


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 5).to(DEVICE)  # a 2-D weight and a 1-D bias: Adafactor factors one, not the other


def _step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """One step on fixed data (the same for every model of a test)."""
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(7, 3, generator=gen).to(DEVICE), torch.randn(7, 5, generator=gen).to(DEVICE)
    optimizer.zero_grad()
    ((model(x) - t) ** 2).mean().backward()
    optimizer.step()


def _pair(cls: type, kwargs: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    ref, cand = _model(), _model()
    return ref, cls(ref.parameters(), **kwargs), cand, cls(cand.parameters(), **kwargs)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    return TrainState(model=model, optimizer=optimizer, device=DEVICE)


def _flags(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """Every setting of every group and the defaults, and the flag GradScaler reads (by value)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return groups, dict(optimizer.defaults), optimizer.__dict__.get(compat.AMP_SCALING_FLAG, "absent")


def _fused_runs(cls: type, kwargs: dict[str, Any]) -> bool:
    """torch's own answer: an optimizer built with fused=True takes a step on these parameters."""
    if not _takes(cls, "fused"):
        return False
    model = _model()
    try:
        _step(cls(model.parameters(), **kwargs, fused=True), model)
    except RuntimeError:
        return False
    return True


def _assert_params_close(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_rel_close(p, q, TOL, name)


# -- not applicable: the reason is true ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", NOT_APPLICABLE, ids=lambda c: c.__name__)
def test_reason_when_neither_implementation_exists(cls):
    params = [nn.Parameter(torch.randn(5, 3, device=DEVICE))]  # 2-D: Muon takes nothing else
    reason = FusedOptimizerRung().check(_state(nn.Linear(3, 5), cls(params)))
    assert reason == f"{cls.__name__} has neither a fused nor a foreach implementation"
    for flag in ("fused", "foreach"):  # true: the constructor takes neither flag
        with pytest.raises(TypeError):
            cls(params, **{flag: True})


@pytest.mark.parametrize("cls", [c for c in APPLICABLE if _takes(c, "differentiable")], ids=lambda c: c.__name__)
def test_differentiable_needs_the_for_loop(cls):
    model = _model()
    reason = FusedOptimizerRung().check(_state(model, cls(model.parameters(), differentiable=True)))
    assert reason.startswith(f"differentiable=True needs {cls.__name__}'s for-loop implementation"), reason


# -- applicable: the same updates, undone exactly ------------------------------------------------------------


@pytest.mark.parametrize("cls, kwargs", CASES)
def test_three_steps_equal_the_original_implementation(cls, kwargs):
    ref, ref_opt, cand, cand_opt = _pair(cls, kwargs)
    for model, opt in ((ref, ref_opt), (cand, cand_opt)):  # state (moments, step counters) exists before the switch
        _step(opt, model)
    state = _state(cand, cand_opt)
    assert FusedOptimizerRung().check(state) is None
    handle = FusedOptimizerRung().apply(state)
    picked = "fused" if _fused_runs(cls, kwargs) else "foreach"
    assert handle.changes[0].startswith(f"{cls.__name__}: {picked} implementation"), handle.changes
    if picked == "foreach":  # and the report says why not fused
        assert handle.changes[1].startswith("not fused: "), handle.changes
        assert all(g["foreach"] is True for g in cand_opt.param_groups)
    else:
        assert all(g["fused"] is True for g in cand_opt.param_groups)
    for _ in range(3):
        _step(ref_opt, ref)
        _step(cand_opt, cand)
    _assert_params_close(cand, ref)
    assert not torch.equal(cand.weight, _model().weight)  # the steps moved the parameters


@pytest.mark.parametrize("cls, kwargs", CASES)
def test_undo_restores_flags_and_defaults_exactly(cls, kwargs):
    model = _model()
    opt = cls(model.parameters(), **kwargs)
    _step(opt, model)
    before = copy.deepcopy(_flags(opt))
    steps = {id(p): (s["step"].device, s["step"].dtype) for p, s in opt.state.items() if torch.is_tensor(s.get("step"))}
    handle = FusedOptimizerRung().apply(_state(model, opt))
    assert _flags(opt) != before
    _step(opt, model)
    handle.undo()
    assert _flags(opt) == before
    assert {id(p): (s["step"].device, s["step"].dtype) for p, s in opt.state.items() if torch.is_tensor(s.get("step"))} == steps


@pytest.mark.parametrize("cls, kwargs", CASES)
def test_suspend_and_resume_twice(cls, kwargs):
    ref, ref_opt, cand, cand_opt = _pair(cls, kwargs)
    before = copy.deepcopy(_flags(cand_opt))
    handle = FusedOptimizerRung().apply(_state(cand, cand_opt))
    applied = copy.deepcopy(_flags(cand_opt))
    _step(cand_opt, cand)
    for _ in range(2):
        handle.suspend()
        assert _flags(cand_opt) == before
        _step(cand_opt, cand)
        handle.resume()
        assert _flags(cand_opt) == applied
        _step(cand_opt, cand)
    for _ in range(5):
        _step(ref_opt, ref)
    _assert_params_close(cand, ref)
    handle.undo()
    assert _flags(cand_opt) == before


def _saved(state_dict: dict[str, Any]) -> tuple[Any, ...]:
    """A saved optimizer state's group settings and where and how its step counters are kept."""
    steps = {i: (s["step"].device, s["step"].dtype) for i, s in state_dict["state"].items() if torch.is_tensor(s.get("step"))}
    return [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]], steps


@pytest.mark.parametrize("cls, kwargs", CASES)
def test_a_state_dict_saved_while_applied_is_the_users_and_one_loaded_keeps_the_switch(cls, kwargs):
    """A checkpoint written with the rung on is the one the user's configuration writes (its flags,
    step counters where it keeps them); the live optimizer keeps the switch. One loaded with the
    rung on (a resumed fit) gets the switch again, and training goes on as without the rung."""
    ref, ref_opt, cand, cand_opt = _pair(cls, kwargs)
    _step(ref_opt, ref)
    _step(cand_opt, cand)
    handle = FusedOptimizerRung().apply(_state(cand, cand_opt))
    applied = copy.deepcopy(_flags(cand_opt))
    saved = cand_opt.state_dict()
    assert _saved(saved) == _saved(ref_opt.state_dict())
    assert _flags(cand_opt) == applied
    user = cls(_model().parameters(), **kwargs)  # the user's own optimizer, without speedkit, loads it as its own
    user_groups = copy.deepcopy(_flags(user)[0])
    user.load_state_dict(saved)
    assert _flags(user)[0] == user_groups
    cand_opt.load_state_dict(saved)
    assert _flags(cand_opt)[0::2] == applied[0::2]  # (loading adds keys to Adafactor's defaults by itself)
    for _ in range(2):
        _step(cand_opt, cand)
        _step(ref_opt, ref)
    _assert_params_close(cand, ref)
    handle.suspend()  # the switch off: what is saved is what is live
    assert _saved(cand_opt.state_dict())[0] == _flags(cand_opt)[0]
    handle.resume()
    handle.undo()
    assert _saved(cand_opt.state_dict())[0] == _flags(cand_opt)[0]


# -- settings torch's implementations take or refuse ----------------------------------------------------------


def test_param_group_added_after_apply_gets_the_original_flags_back():
    model, extra = _model(), nn.Parameter(torch.ones(2, device=DEVICE))
    opt = torch.optim.RMSprop(model.parameters())
    handle = FusedOptimizerRung().apply(_state(model, opt))
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[1]["foreach"] is True and "fused" not in opt.param_groups[1]
    handle.undo()
    assert opt.param_groups[1]["foreach"] is None and "fused" not in opt.defaults


def test_sparse_gradients_are_not_fused():
    torch.manual_seed(0)
    emb = nn.Embedding(11, 4, sparse=True).to(DEVICE)
    ref = copy.deepcopy(emb)
    opt, ref_opt = torch.optim.SGD(emb.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    handle = FusedOptimizerRung().apply(_state(emb, opt))
    assert handle.changes[1] == "not fused: fused kernels do not take sparse gradients (an nn.Embedding with sparse=True)"
    idx = torch.tensor([[1, 2, 4], [4, 3, 9]], device=DEVICE)
    for module, o in ((emb, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            module(idx).pow(2).sum().backward()
            o.step()
    assert_rel_close(emb.weight, ref.weight, TOL, "weight")


def test_tensor_lr_takes_fused_and_says_why_not_foreach():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    assert FusedOptimizerRung().check(_state(model, opt)) is None  # fused takes a tensor lr
    reason = FusedOptimizerRung(FusedOptimizerOptions(implementation="foreach")).check(_state(model, opt))
    assert "lr as a Tensor is not supported for capturable=False and foreach=True" in reason


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [c for c in APPLICABLE if _takes(c, "capturable")], ids=lambda c: c.__name__)
def test_capturable_step_counters_stay_on_the_device(cls):
    ref, ref_opt, cand, cand_opt = _pair(cls, {"capturable": True})
    _step(cand_opt, cand)
    handle = FusedOptimizerRung().apply(_state(cand, cand_opt))
    for _ in range(3):
        _step(cand_opt, cand)
    for _ in range(4):
        _step(ref_opt, ref)
    _assert_params_close(cand, ref)
    handle.undo()
    assert all(s["step"].device.type == "cuda" for s in cand_opt.state.values())
