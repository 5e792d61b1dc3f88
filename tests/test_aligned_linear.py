"""The aligned_linear rung: which layers it pads and why not, the same values and gradients, and an
exact undo."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import speedkit
from speedkit.kernels import layers
from speedkit.rungs.aligned_linear import AlignedLinearOptions, AlignedLinearRung, misaligned_linears
from speedkit.training.state import TrainState


class TiedLM(nn.Module):
    """A language-model head the way GPT-2 writes it: a vocabulary that is not a multiple of 8, the
    head's weight tied to the embedding."""

    def __init__(self, vocab: int = 1031, dim: int = 24) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(torch.tanh(self.mix(self.wte(idx))))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class MyLinear(nn.Linear):
    pass


def _state(model: nn.Module, device: str = "cuda") -> TrainState:
    """A state that says it runs on ``device``; nothing is moved (the rung only swaps classes)."""
    return TrainState(model=model, optimizer=None, device=torch.device(device))


def test_on_the_cpu_it_says_why():
    assert AlignedLinearRung().check(_state(TiedLM(), "cpu")) == (
        "misaligned GEMM rows are slow in cuBLAS; the run is on cpu, where no gain is known"
    )


def test_applies_to_a_misaligned_head_only():
    assert AlignedLinearRung().check(_state(TiedLM())) is None
    found, notes = misaligned_linears(TiedLM(), AlignedLinearOptions())
    assert [name for name, _ in found] == ["lm_head"] and notes == []


@pytest.mark.parametrize(
    "model, reason",
    [
        (
            nn.Sequential(nn.Linear(16, 2048), nn.Linear(2048, 1000)),
            "no nn.Linear with 1024 or more output features that are not a multiple of 8",
        ),
        (nn.Sequential(nn.Linear(16, 1001)), "no nn.Linear with 1024 or more output features that are not a multiple of 8"),
        (
            nn.Sequential(MyLinear(16, 1031)),
            "no nn.Linear with 1024 or more output features that are not a multiple of 8; "
            "left alone: 0 (1031 outputs) is a MyLinear, not an nn.Linear",
        ),
    ],
)
def test_not_applicable_says_why(model, reason):
    assert AlignedLinearRung().check(_state(model)) == reason


def test_a_forward_replaced_on_the_instance_is_left_alone():
    model = TiedLM()
    model.lm_head.forward = model.lm_head.forward  # e.g. compiled or patched by someone else
    found, notes = misaligned_linears(model, AlignedLinearOptions())
    assert found == [] and notes == ["lm_head (1031 outputs): its forward was replaced on the instance"]


def test_options_are_checked():
    with pytest.raises(ValueError, match="multiple must be a positive multiple of 8, found 12"):
        AlignedLinearOptions(multiple=12)
    assert misaligned_linears(TiedLM(vocab=1001), AlignedLinearOptions(min_out_features=1000))[0]


def test_apply_swaps_the_class_and_undo_puts_it_back_exactly():
    model = TiedLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    handle = AlignedLinearRung().apply(_state(model))
    assert type(model.lm_head) is layers.AlignedLinear and type(model.mix) is nn.Linear
    assert handle.changes == [
        "linear layers computed on weights padded to a multiple of 64 output features: lm_head (1031 → 1088)"
    ]
    assert handle.sites == {"padded": ["lm_head"], "left_alone": []}
    assert model.lm_head.weight is model.wte.weight and "multiple" not in model.lm_head.__dict__
    assert repr(model.lm_head).startswith("speedkit.AlignedLinear(in_features=24, out_features=1031")
    for _ in range(2):
        handle.suspend()
        assert type(model.lm_head) is nn.Linear
        handle.resume()
        assert type(model.lm_head) is layers.AlignedLinear
    handle.undo()
    assert type(model.lm_head) is nn.Linear and [id(p) for p in model.parameters()] == params
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_another_multiple_gets_its_own_class():
    model = TiedLM()
    AlignedLinearRung(AlignedLinearOptions(multiple=128)).apply(_state(model))
    assert isinstance(model.lm_head, layers.AlignedLinear) and model.lm_head.multiple == 128
    assert layers.aligned_linear_class(128) is type(model.lm_head)


@pytest.mark.parametrize(
    "shape, out_features, bias", [((7, 13), 1031, True), ((3, 5, 13), 1031, False), ((2, 13), 64, True), ((4, 1, 13), 9, True)]
)
def test_padded_linear_computes_the_same_function(shape, out_features, bias):
    torch.manual_seed(0)
    lin = nn.Linear(13, out_features, bias=bias)
    x = torch.randn(*shape, requires_grad=True)
    grad = torch.randn(*shape[:-1], out_features)
    exact = lin(x)
    exact.backward(grad)
    expected = [x.grad.clone(), *(p.grad.clone() for p in lin.parameters())]
    x.grad = None
    lin.zero_grad(set_to_none=True)
    padded = layers.padded_linear(x, lin.weight, lin.bias, 64)
    assert padded.shape == exact.shape and padded.stride(-2) == -(-out_features // 64) * 64
    torch.testing.assert_close(padded, exact, rtol=1e-6, atol=1e-6)
    padded.backward(grad)
    # x's gradient sums over the 1031 outputs, in another order once the weight is padded (zero rows
    # change the GEMM's blocking): fp32 reduction-order noise, ~eps * sqrt(n) of the sum's scale
    for got, want in zip([x.grad, *(p.grad for p in lin.parameters())], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_under_autocast_the_weight_is_cast_before_padding():
    torch.manual_seed(0)
    lin = nn.Linear(16, 1031)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact, padded = lin(x), layers.padded_linear(x, lin.weight, lin.bias, 64)
    assert padded.dtype == exact.dtype == torch.bfloat16
    torch.testing.assert_close(padded, exact, rtol=1e-2, atol=1e-2)


def _train(model: nn.Module, steps: int = 3, compile_backend: str | None = None) -> list[float]:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = torch.compile(model, backend=compile_backend) if compile_backend else model
    losses = []
    for _ in range(steps):
        idx, targets = torch.randint(0, 1031, (3, 11)), torch.randint(0, 1031, (3, 11))
        loss = forward(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_training_with_the_rung_matches_the_plain_model(backend):
    torch.manual_seed(0)
    plain = TiedLM()
    swapped = TiedLM()
    swapped.load_state_dict(plain.state_dict())
    AlignedLinearRung().apply(_state(swapped))
    want, got = _train(plain, compile_backend=backend), _train(swapped, compile_backend=backend)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for a, b in zip(plain.parameters(), swapped.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_in_a_run_on_the_cpu_it_is_not_applicable():
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = speedkit.apply(model, opt, rungs=["aligned_linear"], device="cpu", loss_fn=lambda m, b, i: m(*b))
    assert applied.skipped["aligned_linear"].startswith("misaligned GEMM rows are slow in cuBLAS")
    assert type(model.lm_head) is nn.Linear


@pytest.mark.gpu
def test_gpu_padded_head_matches_and_trains_like_the_plain_model():
    torch.manual_seed(0)
    plain = TiedLM(vocab=50257, dim=64).cuda()
    swapped = TiedLM(vocab=50257, dim=64).cuda()
    swapped.load_state_dict(plain.state_dict())
    runs = []
    for model, rungs in ((plain, []), (swapped, ["aligned_linear"])):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        applied = speedkit.apply(model, opt, rungs=rungs, device="cuda", loss_fn=lambda m, b, i: m(*b))
        gen = torch.Generator(device="cuda").manual_seed(3)
        losses = []
        for i in range(5):
            batch = tuple(torch.randint(0, 50257, (4, 37), device="cuda", generator=gen) for _ in range(2))
            losses.append(float(applied.step(batch, i)))
        runs.append(losses)
    assert type(swapped.lm_head) is layers.AlignedLinear
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-5, atol=0)
