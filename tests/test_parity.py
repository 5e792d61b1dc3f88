"""Parity tells a bug from rounding: the changes users train with pass, planted defects do not.

Each change is judged against the envelope of its class, calibrated on the model itself (see
``configs/tolerances.yaml``): a layout, compile or kernel against the reduction order and kernel
choice of the precision in effect, a precision rung against that precision's own rounding. The
accepted changes are the real rungs on models of the kinds users train (a BatchNorm convnet with
depthwise convolutions under SGD and a cosine schedule; a BERT classifier on per-batch padded text
under AdamW); the defects are the ones a rewrite or a kernel can bring: a dropped attention scale,
a wrong gradient, a dropped bias. Timing is not what these tests are about: comparisons are
short and their verdicts are not asserted.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedkit import compat
from speedkit.data import BatchSource
from speedkit.engine.ladder import Ladder
from speedkit.handle import Handle, set_attr
from speedkit.rungs import make as get_rung
from speedkit.rungs.base import Rung
from speedkit.training.state import TrainState
from speedkit.training.step import StepWrapper

#: judge parity; spend as little as possible on timing
QUICK = {
    "warmup": 1,
    "steps": 1,
    "repeats": 2,
    "parity_steps": 4,
    "min_blocks": 2,
    "max_blocks": 2,
    "settle": 0,
    "budget_s": 60.0,
    "telemetry": False,
    "final_check": False,
    "together_passes": 0,
    "switches_floor": False,
}


def _ladder(model, optimizer, batches, rungs, scheduler=None, autocast=None, device="cpu"):
    """The ladder over ``rungs``; ``autocast``: the run's own autocast dtype (as a user who chose bf16)."""
    from speedkit.training.step import PlainStep

    device = torch.device(device)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    step = PlainStep(model, optimizer, device, scheduler=scheduler)
    step.autocast_dtype = autocast
    state = TrainState(model=model, optimizer=optimizer, device=device, step=step, data=BatchSource(loader, device))
    assert state.precision == ("bf16" if autocast is torch.bfloat16 else "fp32")
    ladder = Ladder(state, rungs, QUICK)
    return ladder, ladder.run()


def _entry(result, name):
    return next(r for r in result.rungs if r.name == name)


# -- the models ------------------------------------------------------------------------------------


class DepthwiseConvNet(nn.Module):
    """A mobile-class convnet: stem, inverted residual blocks (pointwise expand, depthwise 3x3,
    pointwise project, BatchNorm after each), pooled classifier; returns the loss."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()

        def block(c_in, c_out, stride):
            hidden = c_in * 4
            return nn.Sequential(
                nn.Conv2d(c_in, hidden, 1, bias=False),
                nn.BatchNorm2d(hidden),
                nn.Hardswish(),
                nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                nn.BatchNorm2d(hidden),
                nn.Hardswish(),
                nn.Conv2d(hidden, c_out, 1, bias=False),
                nn.BatchNorm2d(c_out),
            )

        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.Hardswish())
        self.blocks = nn.Sequential(block(width, width, 1), block(width, 2 * width, 2), block(2 * width, 2 * width, 1))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x, y):
        h = self.blocks(self.stem(x))
        return F.cross_entropy(self.head(h.mean((2, 3))), y, label_smoothing=0.1)


def _convnet(device="cpu"):
    torch.manual_seed(0)
    model = DepthwiseConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=4e-5)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(8)]
    return model, optimizer, batches, scheduler


def _bert_classifier(device="cpu"):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=2,
        attn_implementation="eager",
    )
    bert = BertForSequenceClassification(config).to(device)

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = bert

        def forward(self, batch):
            return self.model(**batch).loss

    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(8):  # each batch padded to its own longest sequence, as DataCollatorWithPadding does
        lengths = torch.randint(8, 60, (8,), generator=g)
        longest = int(lengths.max())
        ids = torch.randint(1, 512, (8, longest), generator=g)
        mask = (torch.arange(longest)[None] < lengths[:, None]).long()
        batches.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.randint(0, 2, (8,), generator=g)})
    return model, optimizer, batches


class Attention(nn.Module):
    """Attention written by hand: the pattern sdpa-like rewrites replace."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        return self.out((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(dim),
                    "att": Attention(dim, heads),
                    "ln2": nn.LayerNorm(dim),
                    "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
                }
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer["att"](layer["ln1"](h))
            h = h + layer["mlp"](layer["ln2"](h))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _transformer(device="cpu"):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (8, 24), generator=g), torch.randint(0, 128, (8, 24), generator=g)) for _ in range(8)]
    return model, optimizer, batches


# -- what users train with: accepted -------------------------------------------------------------------


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_and_compile_pass_parity_on_a_batchnorm_depthwise_convnet(device):
    """Other conv algorithms (oneDNN's or cuDNN's channels_last kernels, in TF32 on CUDA by
    default) and Inductor's fused, reordered reductions move the loss by rounding only: both within
    the envelope of the kernels' own precision, step by step."""
    model, optimizer, batches, scheduler = _convnet(device)
    _, result = _ladder(model, optimizer, batches, [get_rung("channels_last"), get_rung("compile")], scheduler, device=device)
    for name in ("channels_last", "compile"):
        entry = _entry(result, name)
        assert entry.parity is not None and entry.parity.passed, (name, entry.reason, entry.parity)
        assert entry.parity.precision == "fp32" and len(entry.parity.envelope) == QUICK["parity_steps"]
    calibration = result.parity_calibration["fp32"]
    assert calibration["seeds"] >= 2 and len(calibration["envelope"]) == QUICK["parity_steps"]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_passes_parity_on_a_small_bert_classifier_on_padded_batches(device, bf16_cpu):
    """On CUDA its dropout masks differ from fp32's (the kernels map the random stream by vector
    width): judged with dropout off there."""
    model, optimizer, batches = _bert_classifier(device)
    _, result = _ladder(model, optimizer, batches, [get_rung({"name": "autocast", "options": {"dtype": "bf16"}})], device=device)
    entry = _entry(result, "autocast")
    assert entry.parity is not None and entry.parity.passed, (entry.reason, entry.parity)
    assert entry.parity.precision == "bf16" and entry.parity.max_rel_diff > 0  # it did round


# -- planted defects: rejected ---------------------------------------------------------------------------


class RewriteRung(Rung):
    """A rewrite of the modules of one type: each instance's forward replaced by ``make(module)``."""

    judged_at_full_precision = True

    def __init__(self, name: str, kind: type[nn.Module], make, precision: str | None = None) -> None:
        super().__init__()
        self.name, self.kind, self.make, self.precision = name, kind, make, precision

    def apply(self, state):
        handle = Handle(self.name)
        for module in state.model.modules():
            if isinstance(module, self.kind):
                set_attr(handle, module, "forward", self.make(module), f"{type(module).__name__}.forward rewritten")
        return handle


def _attention_without_scale(module: Attention):
    def forward(x):
        b, t, d = x.shape
        q, k, v = module.qkv(x).view(b, t, 3, module.heads, d // module.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)  # the defect: the 1/sqrt(d) scale dropped
        return module.out(out.transpose(1, 2).reshape(b, t, d))

    return forward


def _attention_fused(module: Attention):
    def forward(x):
        b, t, d = x.shape
        q, k, v = module.qkv(x).view(b, t, 3, module.heads, d // module.heads).permute(2, 0, 3, 1, 4)
        return module.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))

    return forward


class _LayerNormWrongGradient(torch.autograd.Function):
    """LayerNorm whose forward is right and whose input gradient drops the mean-subtraction term."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        mean = x.mean(-1, keepdim=True)
        rstd = (x.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
        xhat = (x - mean) * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        return xhat * weight + bias

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        g = grad * weight
        # right: rstd * (g - g.mean(-1) - xhat * (g * xhat).mean(-1)); the defect drops g.mean(-1)
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dims = tuple(range(grad.dim() - 1))
        return dx, (grad * xhat).sum(dims), grad.sum(dims), None


def _layernorm_wrong_gradient(module: nn.LayerNorm):
    return lambda x: _LayerNormWrongGradient.apply(x, module.weight, module.bias, module.eps)


def _linear_without_bias(module: nn.Linear):
    return lambda x: F.linear(x, module.weight)  # the defect: a fused linear kernel that drops the bias


def _keep_every_rung(monkeypatch):
    """Decisions on timing are not what these tests are about: every measured rung is kept."""
    monkeypatch.setattr(
        "speedkit.engine.comparison.decide", lambda cfg, paired, memory_comparable=True: ("kept", "kept by the test")
    )


def _rungs_under(under: str, rung: Rung) -> list[Rung]:
    return [get_rung({"name": "autocast", "options": {"dtype": "bf16"}}), rung] if under == "bf16" else [rung]


@pytest.mark.parametrize("under", ["fp32", "bf16"])
def test_a_correct_attention_rewrite_passes_where_its_defects_fail(under, monkeypatch, bf16_cpu):
    _keep_every_rung(monkeypatch)
    model, optimizer, batches = _transformer()
    _, result = _ladder(model, optimizer, batches, _rungs_under(under, RewriteRung("sdpa_rewrite", Attention, _attention_fused)))
    entry = _entry(result, "sdpa_rewrite")
    assert entry.status == "kept" and entry.parity.passed and entry.parity.precision == under
    if under == "bf16":
        assert any("also judged with the precision rungs off (fp32)" in c for c in entry.changes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("defect", ["dropped_attention_scale", "wrong_layernorm_gradient", "linear_bias_dropped"])
@pytest.mark.parametrize("under", ["fp32", "bf16"])
def test_planted_defects_are_rejected(defect, under, device, monkeypatch, request, bf16_cpu):
    """Each defect changes the function or its gradient. Rejected in fp32; on top of bf16 autocast,
    where some move the loss less than bf16's own rounding does (a wrong LayerNorm gradient: 6e-5
    against an envelope of 3e-4 here), a rewrite is also judged with the precision rungs off, and
    rejected there. On CUDA too, where fp32's envelope holds the kernels' reduction order."""
    if device == "cuda" and defect == "wrong_layernorm_gradient":
        # measured on the H200 (0b83d0c): over the 4 parity steps it moves this model's loss by at most
        # 2.9e-5 (fp32), under the 1e-4 floor of fp32 on CUDA (configs/tolerances.yaml); telling it from
        # rounding there takes more steps or a tighter floor: a known gap, kept visible
        request.applymarker(
            pytest.mark.xfail(
                strict=True, reason="a wrong LayerNorm gradient moves the loss less than fp32's CUDA floor within 4 parity steps"
            )
        )
    _keep_every_rung(monkeypatch)
    kind, make = {
        "dropped_attention_scale": (Attention, _attention_without_scale),
        "wrong_layernorm_gradient": (nn.LayerNorm, _layernorm_wrong_gradient),
        "linear_bias_dropped": (nn.Linear, _linear_without_bias),
    }[defect]
    model, optimizer, batches = _transformer(device)
    _, result = _ladder(model, optimizer, batches, _rungs_under(under, RewriteRung(defect, kind, make)), device=device)
    if under == "bf16":
        assert _entry(result, "autocast").status == "kept"
    entry = _entry(result, defect)
    parity = entry.parity
    assert entry.status == "reverted" and "numerics changed" in entry.reason, (
        entry.reason,
        parity and _moves(parity),
        parity and parity.envelope,
    )
    assert parity.precision == "fp32" and "for fp32" in entry.reason
    # rejected at a step where the envelope is narrow: not by a hair
    assert any(m > 2 * t for m, t in zip(_moves(parity), parity.envelope)), (_moves(parity), parity.envelope)


def _moves(parity):
    return [abs(a - b) / abs(b) if math.isfinite(a) else math.inf for a, b in zip(parity.losses, parity.reference_losses)]


def test_reduction_order_noise_grows_with_the_sums_a_cuda_leaf_computes():
    """fp32's envelope on CUDA: a kernel's reduction order is its own (tiles, split-K, atomics), so a
    leaf summing K terms gets about sqrt(K) fp32 roundings; a coarser precision's calibration (bf16)
    keeps its own rounding, and a leaf that sums nothing keeps fp32's."""
    from speedkit.engine.parity import RoundingNoise as _RoundingNoise
    from speedkit.engine.parity import reduction_length as _reduction_length

    eps = {"fp32": 1.19e-7, "tf32": 9.77e-4, "bf16": 7.81e-3}
    assert _reduction_length(nn.Linear(512, 8)) == 512
    assert _reduction_length(nn.Conv2d(32, 64, 3, groups=4)) == 8 * 9
    assert _reduction_length(nn.LayerNorm(256)) == 256
    assert _reduction_length(nn.Embedding(10, 4)) == 1 and _reduction_length(nn.GELU()) == 1
    assert _reduction_length(nn.BatchNorm2d(8)) == 1

    class T5LikeNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(384))

    assert _reduction_length(T5LikeNorm()) == 384
    noise = _RoundingNoise(nn.Linear(512, 8), eps["fp32"], epsilons=eps)
    assert noise._kernel_precision(nn.Linear(512, 8)) == (eps["fp32"], None)  # on the CPU: fp32's own rounding


@pytest.mark.gpu
def test_reduction_order_noise_on_cuda_leaves():
    from speedkit.engine.parity import RoundingNoise as _RoundingNoise

    eps = {"fp32": 1.19e-7, "tf32": 9.77e-4, "bf16": 7.81e-3}
    linear = nn.Linear(512, 8).cuda()
    noise = _RoundingNoise(linear, eps["fp32"], epsilons=eps)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        relative, why = noise._kernel_precision(linear)
        assert relative == pytest.approx(eps["fp32"] * math.sqrt(512)) and "reduction order" in why
        assert _RoundingNoise(linear, eps["bf16"], epsilons=eps)._kernel_precision(linear) == (eps["bf16"], None)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert noise._kernel_precision(linear)[0] == eps["tf32"]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def test_dropout_off_reaches_the_rates_models_pass_to_kernels_themselves():
    """Hugging Face's T5 attention keeps its rate as a float (``self.dropout``) and hands it to SDPA:
    compile's masks there are Inductor's, so judging compile 'with dropout off' must zero it too (on the
    H200 a compiled T5 moved its loss 3.6e-4, the same every run, with its nn.Dropout modules off)."""
    from transformers import T5Config, T5ForConditionalGeneration

    from speedkit.engine.parity import dropout_off as _dropout_off
    from speedkit.rungs.base import active_dropouts

    config = T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    found = active_dropouts(model)
    floats = {(type(m).__name__, name) for m, name in found if name != "p"}
    assert ("T5Attention", "dropout") in floats, floats
    assert any(name == "p" for _, name in found)
    with _dropout_off(model):
        assert not active_dropouts(model)
        assert all(m.dropout == 0.0 for m in model.modules() if type(m).__name__ == "T5Attention")
    assert {(id(m), n) for m, n in active_dropouts(model)} == {(id(m), n) for m, n in found}
    assert all(m.dropout == 0.1 for m in model.modules() if type(m).__name__ == "T5Attention")
    model.train()
    ids = torch.randint(0, 64, (2, 7))
    with _dropout_off(model):  # with every rate at 0 the training forward draws nothing: twice the same loss
        a = model(input_ids=ids, labels=ids).loss
        b = model(input_ids=ids, labels=ids).loss
    assert torch.equal(a, b)


# -- a change that acts only after steps of its own ------------------------------------------------


class _Ripening(StepWrapper):
    """The step, unchanged in what it computes, whose change acts only after ``needs`` steps of its
    own, as a CUDA graph on a DDP wrapper made in the trials captures only after the wrapper's first
    iterations; it counts the steps in which it acted."""

    def __init__(self, inner, needs: int) -> None:
        super().__init__(inner)
        self.needs, self.taken, self.acted = needs, 0, 0

    def __call__(self, batches, batch_idx):
        self.taken += 1
        self.acted += self.taken > self.needs
        return self.inner(batches, batch_idx)


class RipeningRung(Rung):
    name = "ripening"

    def apply(self, state):
        handle = Handle(self.name)
        step = _Ripening(state.step, needs=6)
        set_attr(handle, state, "step", step, "the step wrapped")
        handle.steps_before_effect = lambda: max(0, step.needs - step.taken)
        handle.problem = lambda: None if step.acted else "it never acted in a step"
        self.step = step
        return handle


def test_a_change_that_needs_steps_before_it_acts_is_judged_on_a_trajectory_where_it_acts(monkeypatch):
    """The parity check runs the steps a change still needs first, then restores its snapshot: the
    trajectory judged is the change acting in every step, and the steps before it leave no trace
    (the weights, SGD's momentum and the cosine schedule restored: the losses are bit-identical)."""
    _keep_every_rung(monkeypatch)
    model, optimizer, batches, scheduler = _convnet()
    rung = RipeningRung()
    _, result = _ladder(model, optimizer, batches, [rung], scheduler)
    entry = _entry(result, "ripening")
    assert entry.status == "kept", entry.reason
    assert entry.parity.passed and entry.parity.max_rel_diff == 0.0, entry.parity
    # 6 steps first, then every parity step and every timed one acted
    assert rung.step.acted == rung.step.taken - 6 >= QUICK["parity_steps"], (rung.step.taken, rung.step.acted)


class _AttentionWithDropout(torch.nn.Module):
    """Attention handing its dropout rate, a float, to SDPA itself (as Hugging Face models do), and an
    nn.Dropout after it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.attention_dropout = 0.1
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 16).permute(2, 0, 3, 1, 4)
        rate = self.attention_dropout if self.training else 0.0
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=rate)
        return self.dropout(out.transpose(1, 2).reshape(2, 5, 32)).sum()


def test_a_compile_with_dropout_off_leaves_the_rates_constants_for_the_fits_graph():
    """Parity compiles the forward with every rate at 0 first; the fit's graph, with the rates back, must
    compile them as constants. Changed and put back plainly, Dynamo marks the rate dynamic and, as SDPA
    cannot take it as a tensor, traces the frame twice (on an H200 a GPT-2's cached re-check lost 9.6 s
    of its 29.5 s to that second trace)."""
    import torch._dynamo

    from speedkit.engine.parity import dropout_off as _dropout_off

    x = torch.randn(2, 5, 32, requires_grad=True)

    def restarts_after_rates_at_zero_then_back(off: Any) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _AttentionWithDropout().train()
        compiled = torch.compile(model.forward, backend="aot_eager")
        before = compat.dynamo_restarts()
        with off(model):
            compiled(x).backward()
        compiled(x).backward()
        return compat.dynamo_restarts() - before

    @contextlib.contextmanager
    def plainly(model: Any) -> Iterator[None]:
        model.attention_dropout, model.dropout.p = 0.0, 0.0
        yield
        model.attention_dropout, model.dropout.p = 0.1, 0.1

    if restarts_after_rates_at_zero_then_back(plainly) == 0:
        pytest.skip(f"torch {torch.__version__} does not make a changed float dynamic: nothing to avoid")
    assert restarts_after_rates_at_zero_then_back(_dropout_off) == 0
