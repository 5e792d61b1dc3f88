"""speedkit's Triton kernels against float64 references, on the CPU through TRITON_INTERPRET.

Every check draws fresh random inputs of odd shapes, poisons the outputs with NaN before the run
(so an element the kernel forgets to write fails), feeds non-uniform upstream gradients, and
compares by relative norm in float64. Tolerances, per dtype:
  fp32: 1e-5;
  bf16: 1e-2 (8-bit mantissa: one rounding of the output is ~4e-3);
  fp16: 5e-3 (11-bit mantissa);
relative to the result, or for a norm's dx to the terms that cancel in it (see ``_close``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel_close

from speedkit.kernels import bias_gelu, cross_entropy, geglu, kernels_available, layer_norm, rms_norm, rotary, swiglu
from speedkit.kernels.activations import (
    bias_gelu_backward,
    bias_gelu_forward,
    geglu_backward,
    geglu_forward,
    swiglu_backward,
    swiglu_forward,
)
from speedkit.kernels.cross_entropy import cross_entropy_forward
from speedkit.kernels.norms import MAX_FUSED, norm_backward, norm_forward

pytestmark = pytest.mark.skipif(
    kernels_available(torch.device("cpu")) is not None and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (set by conftest) or a GPU",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# hidden sizes: degenerate, odd, just past a power of two, wider than one register block
HIDDEN = [1, 7, 123, 4097, MAX_FUSED + 3]


def _rand(*shape, dtype=torch.float32, seed=None, scale=1.0):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _close(actual, expected64, dtype, msg, floor: float = 0.0):
    """Within the dtype's tolerance of the float64 result, relative to max(‖result‖, floor).

    ``floor`` is the size of the terms that cancel in an ill-conditioned result (the RMSNorm
    gradient of a 1-wide row is rstd·g·(1 − x̂²) ≈ rstd·g·eps/x²): any fp32 computation of it,
    PyTorch's too, loses digits relative to the result but not relative to those terms.
    """
    tol = TOL[dtype]
    a, e = actual.detach().double(), expected64.detach().double()
    assert torch.isfinite(a).all(), f"{msg}: non-finite values"
    denom = max(e.norm().item(), floor, 1e-6)
    rel = (a - e).norm().item() / denom
    assert rel <= tol, f"{msg}: relative error {rel:.3e} > {tol:.0e}"


def _rows(N):
    return 5 if N < 1000 else 3  # the interpreter is slow: fewer rows for wide ones


# -- LayerNorm / RMSNorm --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", HIDDEN)
@pytest.mark.parametrize("kind", ["layer_norm", "layer_norm_no_bias", "layer_norm_no_affine", "rms_norm", "rms_norm_no_weight"])
def test_norms_forward_and_backward_launchers(kind, N, dtype):
    rms = kind.startswith("rms")
    M = _rows(N)
    x = _rand(M, N, dtype=dtype, scale=3.0) + 0.5  # a nonzero mean: LayerNorm must subtract it
    w = _rand(N, dtype=dtype) if kind not in ("layer_norm_no_affine", "rms_norm_no_weight") else None
    b = _rand(N, dtype=dtype) if kind in ("layer_norm",) else None
    eps = 1e-5
    y, mean, rstd = norm_forward(x, w, b, eps, rms, out=_nan_like(x))
    dy = _rand(M, N, dtype=dtype)
    dx, dw, db = norm_backward(dy, x, w, mean, rstd, rms, b is not None, dx_out=_nan_like(x))

    def reference(x_, w_, b_):
        return F.rms_norm(x_, (N,), w_, eps) if rms else F.layer_norm(x_, (N,), w_, b_, eps)

    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref = reference(*leaves)
    ref_grads = torch.autograd.grad(ref, [t for t in leaves if t is not None], dy.double())
    # the terms that cancel in dx: rstd·(dy·w), with rstd from the float64 statistics
    x64 = x.double()
    centred = x64 if rms else x64 - x64.mean(-1, keepdim=True)
    rstd64 = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    floor = (rstd64 * dy.double() * (w.double() if w is not None else 1.0)).norm().item()
    _close(y, ref, dtype, "y")
    _close(dx, ref_grads[0], dtype, "dx", floor)
    i = 1
    for name, got in (("dw", dw), ("db", db)):
        if got is not None:
            assert got.dtype == dtype
            _close(got, ref_grads[i], dtype, name)
            i += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_functions_on_3d_inputs_with_autograd(dtype):
    x = _rand(3, 5, 123, dtype=dtype).requires_grad_()
    w = _rand(123, dtype=dtype).requires_grad_()
    b = _rand(123, dtype=dtype).requires_grad_()
    g = _rand(3, 5, 123, dtype=dtype)
    for fn, ref_fn, params in (
        (lambda *a: layer_norm(*a, 1e-5), lambda x_, w_, b_: F.layer_norm(x_, (123,), w_, b_, 1e-5), (w, b)),
        (lambda x_, w_: rms_norm(x_, w_, 1e-6), lambda x_, w_: F.rms_norm(x_, (123,), w_, 1e-6), (w,)),
    ):
        out = fn(x, *params)
        assert out.shape == x.shape and out.dtype == dtype
        grads = torch.autograd.grad(out, (x, *params), g)
        leaves = [t.detach().double().requires_grad_() for t in (x, *params)]
        ref = ref_fn(*leaves)
        ref_grads = torch.autograd.grad(ref, leaves, g.double())
        _close(out, ref, dtype, "out")
        for a, e in zip(grads, ref_grads):
            _close(a, e, dtype, "grad")


def test_norms_without_weight_or_bias_backpropagate():
    x = _rand(4, 33).requires_grad_()
    g = _rand(4, 33)
    for fn, ref in ((layer_norm, lambda t: F.layer_norm(t, (33,))), (rms_norm, lambda t: F.rms_norm(t, (33,), eps=1e-6))):
        (dx,) = torch.autograd.grad(fn(x), x, g)
        leaf = x.detach().double().requires_grad_()
        (rdx,) = torch.autograd.grad(ref(leaf), leaf, g.double())
        assert_rel_close(dx, rdx, 1e-5)


@pytest.mark.parametrize("rows", [1, 2])
def test_norm_backward_with_a_single_program(rows):
    """One row block: a grid of one program (Triton specializes an argument equal to 1)."""
    x, w, b, dy = _rand(rows, 19), _rand(19), _rand(19), _rand(rows, 19)
    y, mean, rstd = norm_forward(x, w, b, 1e-5, False)
    dx, dw, db = norm_backward(dy, x, w, mean, rstd, False, True)
    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    ref = F.layer_norm(leaves[0], (19,), leaves[1], leaves[2], 1e-5)
    for got, exp in zip((dx, dw, db), torch.autograd.grad(ref, leaves, dy.double())):
        _close(got, exp, torch.float32, "grad", floor=1.0)


def test_compiled_functions_use_the_custom_ops():
    """Under torch.compile the functions route through the registered ops (fake impls, no graph
    break); eagerly they take the autograd.Function path. Both give the same result and gradients."""
    x, w, b = _rand(3, 9).requires_grad_(), _rand(9).requires_grad_(), _rand(9).requires_grad_()
    g = _rand(3, 9)
    logits, target = _rand(3, 9).requires_grad_(), torch.randint(0, 9, (3,)).to(DEVICE)

    def step(t, lg):
        return (
            layer_norm(t, w, b),
            rms_norm(t, w),
            bias_gelu(t, b, "tanh"),
            swiglu(t, t * 2) + geglu(t * 3, t, "tanh"),
            cross_entropy(lg, target),
        )

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for fn in (step, compiled):
        outs = fn(x, logits)
        loss = sum((o * g).sum() for o in outs[:4]) + outs[4]
        grads = torch.autograd.grad(loss, (x, w, b, logits))
        if fn is step:
            expected = [o.detach() for o in outs], [gr.detach() for gr in grads]
        else:
            for a, e in zip(outs, expected[0]):
                assert_rel_close(a, e, 1e-5)
            for a, e in zip(grads, expected[1]):
                assert_rel_close(a, e, 1e-5)
    torch._dynamo.reset()


def test_norm_rejects_a_mismatched_weight():
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(_rand(2, 8), _rand(7))


# -- cross-entropy --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("V", [7, 301, 4097 + 2, 2 * 8192 + 5])  # the last spans three 8K chunks
def test_cross_entropy_all_reductions_with_ignored_rows(dtype, reduction, smoothing, V):
    N = 7
    logits = _rand(N, V, dtype=dtype, scale=4.0)
    target = torch.randint(0, V, (N,)).to(DEVICE)
    target[[1, 4]] = -100  # ignored rows: zero loss and zero gradient, not counted by the mean
    losses, grad = cross_entropy_forward(
        logits,
        target,
        reduction,
        -100,
        smoothing,
        grad_out=_nan_like(logits),
        losses_out=torch.full((N,), float("nan"), device=DEVICE),
    )
    leaf = logits.double().requires_grad_()
    ref = F.cross_entropy(leaf, target, reduction=reduction, ignore_index=-100, label_smoothing=smoothing)
    (ref_grad,) = torch.autograd.grad(ref.sum() if reduction == "none" else ref, leaf)
    per_row = F.cross_entropy(logits.double(), target, reduction="none", ignore_index=-100, label_smoothing=smoothing)
    assert_rel_close(losses, per_row, 1e-5, "per-row losses (fp32 math on any dtype)")
    assert torch.equal(grad[[1, 4]], torch.zeros_like(grad[[1, 4]]))
    _close(grad, ref_grad, dtype, "gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_function_matches_pytorch_with_nonuniform_upstream(dtype, reduction):
    N, V = 9, 257
    logits = _rand(N, V, dtype=dtype, scale=3.0).requires_grad_()
    target = torch.randint(0, V, (N,)).to(DEVICE)
    target[0] = 5
    target[3] = -1
    loss = cross_entropy(logits, target, reduction=reduction, ignore_index=-1, label_smoothing=0.05)
    assert loss.dtype == torch.float32
    upstream = _rand(N) if reduction == "none" else torch.tensor(0.37, device=DEVICE)
    (grad,) = torch.autograd.grad(loss, logits, upstream)
    leaf = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(leaf, target, reduction=reduction, ignore_index=-1, label_smoothing=0.05)
    (ref_grad,) = torch.autograd.grad(ref, leaf, upstream.double())
    assert_rel_close(loss, ref, 1e-5, "loss")
    _close(grad, ref_grad, dtype, "grad")
    assert grad.dtype == dtype


def test_cross_entropy_never_writes_into_the_logits_and_refuses_a_second_backward():
    logits = _rand(4, 33).requires_grad_()
    before = logits.detach().clone()
    target = torch.randint(0, 33, (4,)).to(DEVICE)
    loss = cross_entropy(logits, target) * 2.0
    loss.backward(retain_graph=True)
    assert torch.equal(logits.detach(), before)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_cross_entropy_mean_with_every_row_ignored_is_nan_like_pytorch():
    logits = _rand(3, 11)
    target = torch.full((3,), -100, device=DEVICE)
    assert torch.isnan(cross_entropy(logits, target)) and torch.isnan(F.cross_entropy(logits, target))


# -- bias + GELU, SwiGLU ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("N", [1, 7, 123, 1029])
def test_bias_gelu_launchers(dtype, approximate, N):
    M = 5
    x = _rand(M, N, dtype=dtype, scale=2.0)
    b = _rand(N, dtype=dtype)
    y = bias_gelu_forward(x, b, approximate == "tanh", out=_nan_like(x))
    dy = _rand(M, N, dtype=dtype)
    dx, db = bias_gelu_backward(dy, x, b, approximate == "tanh", dx_out=_nan_like(x))
    xl, bl = x.double().requires_grad_(), b.double().requires_grad_()
    ref = F.gelu(xl + bl, approximate=approximate)
    rdx, rdb = torch.autograd.grad(ref, (xl, bl), dy.double())
    _close(y, ref, dtype, "y")
    _close(dx, rdx, dtype, "dx")
    # db sums dz over rows: judged against the terms it sums (a sum of few rows can cancel)
    _close(db, rdb, dtype, "db", floor=rdx.norm().item())
    assert db.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_launchers(dtype):
    g, u = _rand(3, 5, 123, dtype=dtype, scale=2.0), _rand(3, 5, 123, dtype=dtype)
    y = swiglu_forward(g, u, out=_nan_like(g))
    dy = _rand(3, 5, 123, dtype=dtype)
    dg, du = swiglu_backward(dy, g, u, dg_out=_nan_like(g), du_out=_nan_like(u))
    gl, ul = g.double().requires_grad_(), u.double().requires_grad_()
    ref = F.silu(gl) * ul
    rdg, rdu = torch.autograd.grad(ref, (gl, ul), dy.double())
    _close(y, ref, dtype, "y")
    _close(dg, rdg, dtype, "dg")
    _close(du, rdu, dtype, "du")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_launchers(dtype, approximate):
    g, u = _rand(3, 5, 123, dtype=dtype, scale=3.0), _rand(3, 5, 123, dtype=dtype)
    tanh = approximate == "tanh"
    y = geglu_forward(g, u, tanh, out=_nan_like(g))
    dy = _rand(3, 5, 123, dtype=dtype)
    dg, du = geglu_backward(dy, g, u, tanh, dg_out=_nan_like(g), du_out=_nan_like(u))
    gl, ul = g.double().requires_grad_(), u.double().requires_grad_()
    ref = F.gelu(gl, approximate=approximate) * ul
    rdg, rdu = torch.autograd.grad(ref, (gl, ul), dy.double())
    _close(y, ref, dtype, "y")
    _close(dg, rdg, dtype, "dg")
    _close(du, rdu, dtype, "du")


def test_geglu_takes_only_the_two_gelus():
    with pytest.raises(ValueError, match="approximate"):
        geglu(_rand(2, 3), _rand(2, 3), "sigmoid")


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("table_dtype", ["same", "fp32"])
@pytest.mark.parametrize("layout", ["heads-first", "tokens-first"])
def test_rotary_forward_and_backward(dtype, table_dtype, layout):
    """A projection viewed as heads and transposed (strided, read in place), odd sizes, the tables
    broadcast over the heads; bf16/fp16 inputs with fp32 tables give what PyTorch's promotion gives."""
    B, T, H, Dh = 2, 7, 3, 22
    tables = torch.float32 if table_dtype == "fp32" else dtype
    x = _rand(B, T, H, Dh, dtype=dtype)
    if layout == "heads-first":
        x, unsqueeze = x.transpose(1, 2), 1  # (B, H, T, Dh), strided
    else:
        unsqueeze = 2
    x.requires_grad_()
    cos, sin = _rand(B, T, Dh, dtype=tables), _rand(B, T, Dh, dtype=tables)
    c, s = cos.unsqueeze(unsqueeze), sin.unsqueeze(unsqueeze)
    y = rotary(x, c, s)
    assert y.dtype == torch.promote_types(dtype, tables) and y.shape == x.shape and y.stride() == x.stride()
    dy = _rand(*y.shape, dtype=y.dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == dtype
    xl = x.detach().double().requires_grad_()
    ref = xl * c.double() + _rotate_half(xl) * s.double()
    (rdx,) = torch.autograd.grad(ref, xl, dy.double())
    _close(y, ref, dtype, "y")
    _close(dx, rdx, dtype, "dx")


def test_rotary_takes_only_what_it_computes():
    with pytest.raises(ValueError, match="even last dim"):
        rotary(_rand(2, 3, 4, 5), _rand(2, 1, 4, 5), _rand(2, 1, 4, 5))
    with pytest.raises(ValueError, match="one dtype"):
        rotary(_rand(2, 3, 4, 6), _rand(2, 1, 4, 6), _rand(2, 1, 4, 6, dtype=torch.bfloat16))


def test_the_rotary_call_runs_the_models_function_where_the_kernel_does_not_apply():
    """Tables that need a gradient, a 3-D q, an unknown keyword, an odd head dim: the model's function as written."""
    from speedkit.kernels import layers

    calls = []

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **other):
        calls.append(other)
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s

    q, k, cos, sin = _rand(2, 3, 5, 8), _rand(2, 1, 5, 8), _rand(2, 5, 8), _rand(2, 5, 8)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    calls.clear()
    for args, kwargs in (
        ((q, k, cos.requires_grad_(), sin), {}),
        ((q[0], k[0], cos.detach(), sin), {}),
        ((q, k, cos.detach(), sin), {"position_ids": None}),
        ((q, _rand(2, 1, 5, 7), _rand(2, 5, 1), _rand(2, 5, 1)), {}),  # an odd k under tables that broadcast
    ):
        layers.rotary_pos_emb(apply_rotary_pos_emb, *args, **kwargs)
    assert len(calls) == 4
    got = layers.rotary_pos_emb(apply_rotary_pos_emb, q, k, cos.detach(), sin, 1)  # the kernel: not called
    assert len(calls) == 4
    for a, e in zip(got, want):
        assert_rel_close(a, e, 1e-6)


def test_activation_functions_with_autograd_on_3d_inputs():
    x = _rand(3, 5, 33).requires_grad_()
    b = _rand(33).requires_grad_()
    gate, up = _rand(3, 5, 33).requires_grad_(), _rand(3, 5, 33).requires_grad_()
    out = bias_gelu(x, b, "tanh") + swiglu(gate, up) + geglu(up, gate) + geglu(gate, up, "tanh")
    g = _rand(3, 5, 33)
    grads = torch.autograd.grad(out, (x, b, gate, up), g)
    leaves = [t.detach().double().requires_grad_() for t in (x, b, gate, up)]
    ref = F.gelu(leaves[0] + leaves[1], approximate="tanh") + F.silu(leaves[2]) * leaves[3]
    ref = ref + F.gelu(leaves[3]) * leaves[2] + F.gelu(leaves[2], approximate="tanh") * leaves[3]
    for a, e in zip(grads, torch.autograd.grad(ref, leaves, g.double())):
        assert_rel_close(a, e, 1e-5)


def test_custom_ops_have_fake_implementations():
    """What torch.compile needs: every op runs on meta tensors with the right output shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(6, 10), torch.empty(10)
        y, mean, rstd = torch.ops.speedkit.norm_fwd(x, w, w, 1e-5, False)
        assert y.shape == (6, 10) and mean.shape == rstd.shape == (6,)
        dx, dw, db = torch.ops.speedkit.norm_bwd(x, x, w, mean, rstd, False, True)
        assert dx.shape == (6, 10) and dw.shape == db.shape == (10,)
        t = torch.empty(6, dtype=torch.long)
        loss, lse = torch.ops.speedkit.cross_entropy_fwd(x, t, "none", -100, 0.0)
        assert loss.shape == lse.shape == (6,)
        assert torch.ops.speedkit.cross_entropy_bwd(x, t, lse, loss, "none", -100, 0.0).shape == (6, 10)
        assert torch.ops.speedkit.bias_gelu(x, w, True).shape == (6, 10)
        assert torch.ops.speedkit.swiglu(x, x).shape == (6, 10)
        assert torch.ops.speedkit.geglu(x, x, True).shape == (6, 10)
        assert [t.shape for t in torch.ops.speedkit.geglu_bwd(x, x, x, False)] == [(6, 10), (6, 10)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("V", [7, 4097 + 2, 2 * 8192 + 5])
def test_cross_entropy_lse_and_gradient_launchers_of_the_compiled_path(dtype, reduction, smoothing, V):
    """The split torch.compile uses: losses + log-sum-exp in one read, then the gradient from them,
    scaled by a non-uniform upstream gradient, into a poisoned buffer; ignored rows give zeros."""
    from speedkit.kernels.cross_entropy import cross_entropy_grad, cross_entropy_lse

    N = 7
    logits = _rand(N, V, dtype=dtype, scale=4.0)
    logits[1, 0] = 200.0  # an ignored row whose exp(x - lse) would overflow: its gradient is still 0
    target = torch.randint(0, V, (N,)).to(DEVICE)
    target[[1, 4]] = -100
    losses, lse = cross_entropy_lse(logits, target, -100, smoothing)
    leaf = logits.double().requires_grad_()
    ref = F.cross_entropy(leaf, target, reduction=reduction, ignore_index=-100, label_smoothing=smoothing)
    gout = _rand(N) if reduction == "none" else torch.tensor(0.37, device=DEVICE)
    (ref_grad,) = torch.autograd.grad(ref, leaf, gout.double())
    per_row = F.cross_entropy(logits.double(), target, reduction="none", ignore_index=-100, label_smoothing=smoothing)
    assert_rel_close(losses, per_row, 1e-5, "per-row losses")
    valid = target != -100
    assert_rel_close(lse[valid], torch.logsumexp(logits.double(), -1)[valid], 1e-5, "log-sum-exp")
    grad = cross_entropy_grad(logits, target, lse, gout, reduction, -100, smoothing, grad_out=_nan_like(logits))
    assert torch.equal(grad[[1, 4]], torch.zeros_like(grad[[1, 4]]))
    _close(grad, ref_grad, dtype, "gradient")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_custom_op_autograd_matches_float64(reduction):
    """The op torch.compile traces, run through its registered autograd (forward op + backward op)."""
    N, V = 9, 301
    logits = _rand(N, V, scale=3.0).requires_grad_()
    target = torch.randint(0, V, (N,)).to(DEVICE)
    target[2] = -100
    loss, _ = torch.ops.speedkit.cross_entropy_fwd(logits, target, reduction, -100, 0.1)
    gout = _rand(N) if reduction == "none" else torch.tensor(1.7, device=DEVICE)
    (grad,) = torch.autograd.grad(loss, logits, gout)
    leaf = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(leaf, target, reduction=reduction, ignore_index=-100, label_smoothing=0.1)
    (ref_grad,) = torch.autograd.grad(ref, leaf, gout.double())
    assert_rel_close(loss, ref, 1e-5, "loss")
    assert_rel_close(grad, ref_grad, 1e-5, "gradient")


def test_cross_entropy_under_compile_traces_a_functional_backward():
    """Tracing runs the op's registered backward on fake tensors: it must not launch a kernel or
    mutate the saved gradient (seen failing on an H200 under Inductor before this was fixed)."""
    logits = _rand(6, 29).requires_grad_()
    target = torch.randint(0, 29, (6,)).to(DEVICE)
    torch._dynamo.reset()
    fn = torch.compile(lambda lg: cross_entropy(lg, target) * 0.5, backend="aot_eager", fullgraph=True)
    (grad,) = torch.autograd.grad(fn(logits), logits)
    leaf = logits.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(F.cross_entropy(leaf, target) * 0.5, leaf)
    assert_rel_close(grad, ref, 1e-5)
    torch._dynamo.reset()
