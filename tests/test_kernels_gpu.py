"""speedkit's Triton kernels on a real GPU.

(a) Every launcher and every functional op against a float64 reference, per dtype and on odd shapes:
    outputs and all gradients, with the launchers' output buffers poisoned with NaN first (an element
    the kernel forgets to write stays NaN and fails the check); cross-entropy for every reduction,
    with ignored rows, label smoothing and non-uniform upstream gradients.
(b) ``torch.compile(fullgraph=True)`` of a small model built from all five ops: no graph break,
    forward and gradients equal to eager.
(c) A whole training step of that model (forward, backward, capturable AdamW) captured in one
    ``torch.cuda.CUDAGraph`` and replayed on new data: losses and parameters equal to eager steps.
(d) (slow) Offsets past 2**31 elements: LayerNorm and cross-entropy on > 2**31-element tensors.

Tolerances: relative error norm ‖out − ref‖/‖ref‖ (METHOD.md), 1e-5 for fp32, 1e-2 for bf16/fp16
(one rounding of the output to 8 or 11 bits of mantissa). All tests skip without a CUDA GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedkit.kernels import bias_gelu, cross_entropy, geglu, layer_norm, rms_norm, rotary, swiglu
from speedkit.kernels.activations import (
    bias_gelu_backward,
    bias_gelu_forward,
    geglu_backward,
    geglu_forward,
    swiglu_backward,
    swiglu_forward,
)
from speedkit.kernels.cross_entropy import cross_entropy_forward
from speedkit.kernels.norms import norm_backward, norm_forward

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = list(TOL)
# (..., hidden): a 3-D input, hidden 1, a tiny odd hidden, one past a power of two, and one wider than
# the widest row kept in registers (16384), which takes the looped kernels
SHAPES = [(3, 5, 123), (16, 1), (33, 7), (9, 4097), (5, 20000)]
# (tokens, vocab): vocab 2 rather than 1, whose loss is 0 by definition (lse = x_t) and leaves only rounding to compare
CE_SHAPES = [(15, 123), (16, 2), (33, 7), (9, 4097), (5, 20000), (4, 50304)]
LN_EPS, RMS_EPS = 1e-5, 1e-6
IGNORE = -100


def rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", dtype=torch.float64) * scale + offset).to(dtype)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def check(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str, floor: float = 0.0) -> None:
    """‖actual − expected‖ / max(‖expected‖, floor, 1e-6) ≤ tol in float64; any NaN/inf fails.

    ``floor`` is the size of the terms a result is the difference of, for results that cancel (RMSNorm's
    dx at hidden 1). The 1e-6 stands for "zero": inputs here are O(1), and a reference of norm below it
    (LayerNorm's dw at hidden 1: 1e-17 in float64, exactly 0 from the kernel) is zero up to rounding.
    """
    assert actual is not None, f"{what}: missing"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values (an element left unwritten?)"
    denom = max(e.norm().item(), floor, 1e-6)
    err = (a - e).norm().item() / denom
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().requires_grad_()


# -- (a) norms ------------------------------------------------------------------------------------------

NORM_CASES = [("ln", "weight+bias"), ("ln", "weight"), ("ln", "none"), ("rms", "weight"), ("rms", "none")]


def norm_inputs(kind: str, affine: str, shape: tuple[int, ...], dtype: torch.dtype):
    N = shape[-1]
    x, dy = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    w = rand(N, dtype=dtype, scale=0.5, offset=1.0) if affine != "none" else None
    b = rand(N, dtype=dtype, scale=0.5) if affine == "weight+bias" else None
    return x, dy, w, b


def norm_reference(kind: str, x, dy, w, b):
    """float64 autograd: (y, dx, dw, db, dx_floor); dx_floor = ‖dy·w·rstd‖, the size of the terms dx subtracts."""
    N = x.shape[-1]
    xd, wd, bd = leaf(x.double()), leaf(None if w is None else w.double()), leaf(None if b is None else b.double())
    if kind == "ln":
        y = F.layer_norm(xd, (N,), wd, bd, LN_EPS)
        xc = x.double() - x.double().mean(-1, keepdim=True)
        rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + LN_EPS)
    else:
        y = F.rms_norm(xd, (N,), wd, RMS_EPS)
        rstd = torch.rsqrt(x.double().square().mean(-1, keepdim=True) + RMS_EPS)
    y.backward(dy.double())
    g = dy.double() * (w.double() if w is not None else 1.0)
    return (y.detach(), xd.grad, None if wd is None else wd.grad, None if bd is None else bd.grad, (g * rstd).norm().item())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,affine", NORM_CASES)
def test_norm_launchers_write_every_output(kind, affine, dtype, shape):
    torch.manual_seed(0)
    x, dy, w, b = norm_inputs(kind, affine, shape, dtype)
    N = shape[-1]
    x2, dy2 = x.reshape(-1, N), dy.reshape(-1, N)
    eps, rms = (RMS_EPS, True) if kind == "rms" else (LN_EPS, False)
    out, dx_out = nan_like(x2), nan_like(x2)
    y, mean, rstd = norm_forward(x2, w, b, eps, rms, out=out)
    dx, dw, db = norm_backward(dy2, x2, w, mean, rstd, rms, b is not None, dx_out=dx_out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr() and dx.data_ptr() == dx_out.data_ptr(), "the launchers must write into out=/dx_out="
    assert (dw is None) == (w is None) and (db is None) == (b is None)
    ry, rdx, rdw, rdb, floor = norm_reference(kind, x2, dy2, w, b)
    tol = TOL[dtype]
    check(y, ry, tol, "y")
    check(dx, rdx, tol, "dx", floor=floor)
    if w is not None:
        assert dw.dtype == w.dtype
        check(dw, rdw, tol, "dw")
    if b is not None:
        check(db, rdb, tol, "db")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,affine", NORM_CASES)
def test_norm_autograd_matches_float64(kind, affine, dtype, shape):
    torch.manual_seed(1)
    x, dy, w, b = norm_inputs(kind, affine, shape, dtype)
    xl, wl, bl = leaf(x), leaf(w), leaf(b)
    y = layer_norm(xl, wl, bl, LN_EPS) if kind == "ln" else rms_norm(xl, wl, RMS_EPS)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    ry, rdx, rdw, rdb, floor = norm_reference(kind, x, dy, w, b)
    tol = TOL[dtype]
    check(y, ry, tol, "y")
    check(xl.grad, rdx, tol, "dx", floor=floor)
    if w is not None:
        check(wl.grad, rdw, tol, "dw")
    if b is not None:
        check(bl.grad, rdb, tol, "db")


# -- (a) cross-entropy ----------------------------------------------------------------------------------


def ce_inputs(n: int, V: int, dtype: torch.dtype):
    logits = rand(n, V, dtype=dtype, scale=2.0)
    target = torch.randint(0, V, (n,), device="cuda")
    target[::3] = IGNORE  # rows 0, 3, 6, ... are ignored; the others are not
    return logits, target


@pytest.mark.parametrize("shape", CE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_launcher_writes_loss_and_gradient(reduction, smoothing, dtype, shape):
    torch.manual_seed(2)
    logits, target = ce_inputs(*shape, dtype)
    grad_out = nan_like(logits)
    losses, grad = cross_entropy_forward(logits, target, reduction, IGNORE, smoothing, grad_out=grad_out)
    torch.cuda.synchronize()
    assert grad.data_ptr() == grad_out.data_ptr(), "the launcher must write into grad_out="
    ld = leaf(logits.double())
    per_row = F.cross_entropy(ld, target, reduction="none", ignore_index=IGNORE, label_smoothing=smoothing)
    loss = F.cross_entropy(ld, target, reduction=reduction, ignore_index=IGNORE, label_smoothing=smoothing)
    loss.backward(torch.ones_like(loss))  # the launcher's gradient is for dL/dloss = 1
    check(losses, per_row.detach(), TOL[dtype], "per-row losses")
    check(grad, ld.grad, TOL[dtype], "gradient")
    assert (grad[target == IGNORE] == 0).all(), "ignored rows must get a zero gradient"


@pytest.mark.parametrize("shape", CE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("upstream", ["one", "random"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_autograd_matches_float64(reduction, smoothing, upstream, dtype, shape):
    torch.manual_seed(3)
    logits, target = ce_inputs(*shape, dtype)
    x = leaf(logits)
    loss = cross_entropy(x, target, reduction=reduction, ignore_index=IGNORE, label_smoothing=smoothing)
    assert loss.dtype == torch.float32
    if reduction == "none":
        gout = torch.ones(shape[0], device="cuda") if upstream == "one" else rand(shape[0])
        if upstream == "random":
            gout[1] = 1.0  # a row scaled by exactly 1 (skipped by the backward kernel) among others
    else:
        gout = torch.tensor(1.0 if upstream == "one" else 0.37, device="cuda")
    loss.backward(gout)
    ld = leaf(logits.double())
    ref = F.cross_entropy(ld, target, reduction=reduction, ignore_index=IGNORE, label_smoothing=smoothing)
    ref.backward(gout.double())
    check(loss, ref.detach(), TOL[dtype], "loss")
    check(x.grad, ld.grad, TOL[dtype], "gradient")
    assert torch.equal(x.detach(), logits), "the logits must not be written to"


# -- (a) bias + GELU, SwiGLU ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_launchers_and_autograd(approximate, dtype, shape):
    torch.manual_seed(4)
    N = shape[-1]
    x, dy, bias = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype), rand(N, dtype=dtype, scale=0.5)
    xd, bd = leaf(x.double()), leaf(bias.double())
    ref = F.gelu(xd + bd, approximate=approximate)
    ref.backward(dy.double())
    tol, tanh = TOL[dtype], approximate == "tanh"

    x2, dy2 = x.reshape(-1, N), dy.reshape(-1, N)
    out, dx_out = nan_like(x2), nan_like(x2)
    y = bias_gelu_forward(x2, bias, tanh, out=out)
    dx, db = bias_gelu_backward(dy2, x2, bias, tanh, dx_out=dx_out)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr() and dx.data_ptr() == dx_out.data_ptr()
    check(y, ref.detach().reshape(-1, N), tol, "launcher y")
    check(dx, xd.grad.reshape(-1, N), tol, "launcher dx")
    check(db, bd.grad, tol, "launcher db")

    xl, bl = leaf(x), leaf(bias)
    y = bias_gelu(xl, bl, approximate=approximate)
    y.backward(dy)
    check(y, ref.detach(), tol, "y")
    check(xl.grad, xd.grad, tol, "dx")
    check(bl.grad, bd.grad, tol, "db")


@pytest.mark.parametrize("act", ["silu", "none", "tanh"], ids=["swiglu", "geglu", "geglu-tanh"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_launchers_and_autograd(dtype, shape, act):
    torch.manual_seed(5)
    gate, up, dy = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    gd, ud = leaf(gate.double()), leaf(up.double())
    ref = (F.silu(gd) if act == "silu" else F.gelu(gd, approximate=act)) * ud
    ref.backward(dy.double())
    tol = TOL[dtype]

    tanh = act == "tanh"
    out, dg_out, du_out = nan_like(gate), nan_like(gate), nan_like(up)
    if act == "silu":
        y = swiglu_forward(gate, up, out=out)
        dg, du = swiglu_backward(dy, gate, up, dg_out=dg_out, du_out=du_out)
    else:
        y = geglu_forward(gate, up, tanh, out=out)
        dg, du = geglu_backward(dy, gate, up, tanh, dg_out=dg_out, du_out=du_out)
    torch.cuda.synchronize()
    assert (y.data_ptr(), dg.data_ptr(), du.data_ptr()) == (out.data_ptr(), dg_out.data_ptr(), du_out.data_ptr())
    check(y, ref.detach(), tol, "launcher y")
    check(dg, gd.grad, tol, "launcher dgate")
    check(du, ud.grad, tol, "launcher dup")

    gl, ul = leaf(gate), leaf(up)
    y = swiglu(gl, ul) if act == "silu" else geglu(gl, ul, act)
    y.backward(dy)
    check(y, ref.detach(), tol, "y")
    check(gl.grad, gd.grad, tol, "dgate")
    check(ul.grad, ud.grad, tol, "dup")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 22])
def test_rotary_forward_and_backward(dtype, head_dim):
    """Llama's layout: a projection viewed as heads and transposed, fp32 tables broadcast over the heads."""
    torch.manual_seed(7)
    B, T, H = 2, 301, 5
    x = leaf(rand(B, T, H, head_dim, dtype=dtype).transpose(1, 2))
    cos, sin = rand(B, T, head_dim).unsqueeze(1), rand(B, T, head_dim).unsqueeze(1)
    y = rotary(x, cos, sin)
    dy = rand(*y.shape, dtype=y.dtype)
    y.backward(dy)
    xd = leaf(x.detach().double())
    half = head_dim // 2
    ref = xd * cos.double() + torch.cat((-xd[..., half:], xd[..., :half]), -1) * sin.double()
    ref.backward(dy.double())
    check(y, ref.detach(), TOL[dtype], "y")
    check(x.grad, xd.grad, TOL[dtype], "dx")


# -- (b), (c) a small model of all five ops ---------------------------------------------------------------


class TinyLM(nn.Module):
    """Features (B, T, d_in) -> logits over ``vocab`` -> speedkit cross-entropy, through every kernel."""

    def __init__(self, d_in: int = 24, d: int = 64, hidden: int = 96, vocab: int = 101) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.ln1 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, hidden, bias=False)
        self.fc_bias = nn.Parameter(0.1 * torch.randn(hidden))
        self.proj = nn.Linear(hidden, d)
        self.rms_weight = nn.Parameter(1.0 + 0.1 * torch.randn(d))
        self.gate, self.up, self.down = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.inp(features)  # (B, T, d)
        h = layer_norm(x, self.ln1.weight, self.ln1.bias)
        x = x + self.proj(bias_gelu(self.fc(h), self.fc_bias, approximate="tanh"))  # (B, T, d)
        h = rms_norm(x, self.rms_weight)
        x = x + self.down(swiglu(self.gate(h), self.up(h)))  # (B, T, d)
        logits = self.head(layer_norm(x, self.ln_f.weight, self.ln_f.bias))  # (B, T, vocab)
        return cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_batch(B: int = 4, T: int = 16, d_in: int = 24, vocab: int = 101) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, T, d_in, device="cuda"), torch.randint(0, vocab, (B, T), device="cuda")


def test_compile_fullgraph_has_no_graph_breaks_and_matches_eager():
    from torch._dynamo.utils import counters

    torch.manual_seed(6)
    model = TinyLM().cuda()
    eager = copy.deepcopy(model)
    features, targets = tiny_batch()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(features, targets)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph=True raises on any graph break
    loss = compiled(features, targets)
    loss.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    ref = eager(features, targets)
    ref.backward()
    check(loss, ref, 1e-4, "loss")  # fp32, but inductor may reorder the ops around the kernels
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        check(p.grad, q.grad, 1e-4, f"grad of {name}")


def test_whole_training_step_replays_in_a_cuda_graph_and_matches_eager():
    torch.manual_seed(7)
    model = TinyLM().cuda()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, capturable=True)
    warmup, replays = 3, 4
    batches = [tiny_batch() for _ in range(warmup + replays)]

    # eager: the same steps on the same batches
    ref_losses = []
    for features, targets in batches:
        ref_opt.zero_grad(set_to_none=True)
        loss = ref_model(features, targets)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach().clone())

    # graph: warm up on a side stream (Triton compiles, AdamW creates its state), then capture one step
    static_features, static_targets = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    losses = []
    with torch.cuda.stream(side):
        for features, targets in batches[:warmup]:
            static_features.copy_(features)
            static_targets.copy_(targets)
            opt.zero_grad(set_to_none=True)
            loss = model(static_features, static_targets)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = model(static_features, static_targets)
        static_loss.backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]  # capture runs nothing: the warm-up's result
    for features, targets in batches[warmup:]:
        static_features.copy_(features)
        static_targets.copy_(targets)
        graph.replay()
        losses.append(static_loss.detach().clone())
    torch.cuda.synchronize()

    assert any(not torch.equal(p, q) for p, q in zip(before, model.parameters())), "the replays changed nothing"
    check(torch.stack(losses), torch.stack(ref_losses), 1e-5, "losses, step by step")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        check(p, q, 1e-4, f"parameter {name} after {warmup + replays} steps")


# -- (d) offsets past 2**31 elements ------------------------------------------------------------------------


def need_free_gpu_memory(gb: float) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gb * 1e9:
        pytest.skip(f"needs {gb:.0f} GB of free GPU memory, {free / 1e9:.1f} GB free")


@pytest.mark.slow
def test_layer_norm_past_2_31_elements():
    need_free_gpu_memory(20)
    torch.manual_seed(8)
    M, N = 2**16 + 3, 2**15 + 1  # 2,147,680,291 elements: rows past M = 65535 start beyond 2**31
    assert M * N > 2**31
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w, b = rand(N, dtype=torch.bfloat16, scale=0.5, offset=1.0), rand(N, dtype=torch.bfloat16, scale=0.5)
    rows = torch.tensor([0, 1, M // 2, M - 3, M - 2, M - 1], device="cuda")

    y, mean, rstd = norm_forward(x, w, b, LN_EPS, False, out=torch.full_like(x, float("nan")))
    assert not y.isnan().any(), "some output elements were not written"
    ry = F.layer_norm(x[rows].double(), (N,), w.double(), b.double(), LN_EPS)
    check(y[rows], ry, 1e-2, "y on the first, middle and last rows")
    del y

    dy = torch.randn_like(x)
    dx, dw, db = norm_backward(dy, x, w, mean, rstd, False, True, dx_out=torch.full_like(x, float("nan")))
    assert not dx.isnan().any(), "some dx elements were not written"
    _, rdx, _, _, floor = norm_reference("ln", x[rows], dy[rows], w, b)
    check(dx[rows], rdx, 1e-2, "dx on the first, middle and last rows", floor=floor)
    # dw, db over every row, in float64, a slice of rows at a time
    rdw = torch.zeros(N, device="cuda", dtype=torch.float64)
    rdb = torch.zeros_like(rdw)
    for i in range(0, M, 1024):
        xc, dyc = x[i : i + 1024].double(), dy[i : i + 1024].double()
        xc = xc - xc.mean(-1, keepdim=True)
        xhat = xc * torch.rsqrt(xc.square().mean(-1, keepdim=True) + LN_EPS)
        rdw += (dyc * xhat).sum(0)
        rdb += dyc.sum(0)
    check(dw, rdw, 1e-2, "dw")
    check(db, rdb, 1e-2, "db")


@pytest.mark.slow
def test_cross_entropy_past_2_31_elements():
    need_free_gpu_memory(20)
    torch.manual_seed(9)
    n, V = 2**14 + 1, 2**17 + 1  # 2,147,631,105 logits: the last rows start beyond 2**31
    assert n * V > 2**31
    logits = torch.randn(n, V, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, V, (n,), device="cuda")
    target[-2] = V - 1  # the farthest element of all is a target
    losses, grad = cross_entropy_forward(logits, target, "sum", IGNORE, 0.0, grad_out=torch.full_like(logits, float("nan")))
    assert not grad.isnan().any(), "some gradient elements were not written"
    rows = torch.tensor([0, n // 2, n - 2, n - 1], device="cuda")
    ld = leaf(logits[rows].double())
    ref = F.cross_entropy(ld, target[rows], reduction="none")
    ref.sum().backward()
    check(losses[rows], ref.detach(), 1e-5, "per-row losses on the first, middle and last rows")
    check(grad[rows], ld.grad, 1e-2, "gradient rows")
