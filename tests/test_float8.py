"""float8: says why not on a CPU, on GPUs without float8 tensor cores and without torchao; chooses only
the Linears whose GEMM shapes pay (both widths at least ``min_features``, divisible by 16, not an LM's
output head); on a GPU with float8 (gpu mark) converts them to torchao's Float8Linear on the same
parameters, computes the same function within float8's rounding, and undo puts the modules back."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from speedkit import config
from speedkit.measure import layer_shapes
from speedkit.rungs import float8 as float8_module
from speedkit.rungs.float8 import Float8Options, Float8Rung, Measured, Prior, chosen_linears, prior_for
from speedkit.training.state import TrainState


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(2048, 4096)
        self.down = nn.Linear(4096, 2048)
        self.small = nn.Linear(768, 768)
        self.odd = nn.Linear(2048, 2050)


def _state(model: nn.Module, device: str = "cpu") -> TrainState:
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device(device))


def test_says_why_not_on_a_cpu():
    assert Float8Rung().precision_in_play(_state(Wide())) is None  # no float8 tolerance calibrated for it
    reason = Float8Rung().check(_state(Wide()))
    assert reason == "float8 GEMMs need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); this run is on cpu"


def test_says_why_not_on_a_gpu_without_float8(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    reason = Float8Rung().check(_state(Wide(), "cuda"))
    assert reason == "float8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); NVIDIA A100-SXM4-80GB is 8.0"


def test_says_how_to_install_torchao(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert Float8Rung().check(_state(Wide(), "cuda")) == "torchao is not installed (pip install 'speedkit[float8]')"


def test_chooses_the_linears_whose_shapes_pay():
    model = Wide()
    chosen, notes = chosen_linears(model, Float8Options())
    assert [name for _, name, _ in chosen] == ["up", "down"]
    assert notes == [
        "1 Linear(s) narrower than 2048 features (float8 loses there)",
        "1 Linear(s) with features not divisible by 16 (float8 GEMMs need it)",
    ]
    assert chosen_linears(model, Float8Options(min_features=8192))[0] == []


def _fed(model: nn.Module, tokens: int) -> dict[int, list]:
    with layer_shapes.recording(model) as fed:
        for linear in (model.up, model.down, model.small):
            linear(torch.zeros(tokens, linear.in_features))
    return fed


#: a made-up table for the tests: float8 wins on many tokens at wide shapes, loses on few
PRIOR = Prior(
    "test table",
    [
        Measured(1024, 2048, 4096, 0.8),
        Measured(16384, 2048, 4096, 1.3),
        Measured(16384, 4096, 2048, 1.25),
        Measured(16384, 768, 768, 0.7),
    ],
)


def test_the_measured_table_chooses_by_tokens_and_widths():
    model = Wide()
    chosen, notes = chosen_linears(model, Float8Options(), _fed(model, 16384), PRIOR)
    assert [name for _, name, _ in chosen] == ["up", "down"]  # nearest 16384x2048x4096 (1.3x) and 16384x4096x2048
    assert any("small" in n or "768" in n for n in notes)  # nearest 16384x768x768: 0.70x
    chosen, notes = chosen_linears(model, Float8Options(), _fed(model, 1024), PRIOR)
    assert chosen == []
    assert notes[0].startswith(
        "3 Linear(s) whose GEMM shapes lose or gain under 1.05x in float8: 1024x2048x4096 (nearest measured 1024x2048x4096: 0.80x)"
    )
    # a Linear whose tokens were not recorded is judged by width, and the note says so
    chosen, notes = chosen_linears(model, Float8Options(), {}, PRIOR)
    assert [name for _, name, _ in chosen] == ["up", "down"]
    assert "3 Linear(s) without recorded tokens judged by width (at least 2048)" in notes


def test_every_recorded_input_must_pay():
    model = Wide()
    fed = _fed(model, 16384)
    for k, v in _fed(model, 1024).items():
        fed[k] += v
    assert chosen_linears(model, Float8Options(), fed, PRIOR)[0] == []


def test_the_table_is_read_per_compute_capability_and_recipe():
    table = {
        "measured": [
            {
                "device": "NVIDIA H100",
                "capability": "9.0",
                "recipe": "rowwise",
                "commit": "abc",
                "date": "2026-12-07",
                "shapes": [[8192, 2048, 5632, 1.12]],
            }
        ]
    }
    prior = prior_for((9, 0), "rowwise", table)
    assert prior is not None and prior.rows == [Measured(8192, 2048, 5632, 1.12)]
    assert prior.source == "NVIDIA H100 at abc, 2026-12-07"
    assert prior_for((8, 9), "rowwise", table) is None and prior_for((9, 0), "tensorwise", table) is None
    assert "measured" in __import__("speedkit.config", fromlist=["load"]).load("float8_gemms")  # the shipped table parses


def test_layer_shapes_gives_a_linears_gemm_rows():
    model = Wide()
    with layer_shapes.recording(model) as fed:
        model.up(torch.zeros(3, 5, 2048))
    assert layer_shapes.tokens(fed[id(model.up)]) == [15]


def test_float8_is_the_loosest_precision_with_a_calibration_epsilon():
    assert config.loosest("bf16", "fp8") == "fp8"
    assert config.parity_calibration()["epsilon"]["fp8"] == pytest.approx(2**-4)
    assert config.tolerance("fp8", "cuda") > config.tolerance("bf16", "cuda")


@pytest.mark.gpu
def test_converts_and_undoes_on_a_gpu_with_float8():
    if not torch.cuda.is_available() or float8_module.hardware_reason(torch.device("cuda")):
        pytest.skip("needs a GPU with float8 tensor cores")
    if float8_module.torchao_missing():
        pytest.skip("needs torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.GELU(), nn.Linear(4096, 2048)).cuda()
    weights = [p for p in model.parameters()]
    x = torch.randn(4096, 2048, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = model(x).float()
    state = _state(model, "cuda")
    rung = Float8Rung()
    assert rung.check(state) is None
    handle = rung.apply(state)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "GELU", "Float8Linear"]
    assert list(model.parameters()) == weights  # the same parameters: the optimizer's state stays theirs
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = model(x).float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.1, rel
    handle.undo()
    assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear]
