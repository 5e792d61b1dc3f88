"""Fused bias + GELU (exact and tanh), SwiGLU and GeGLU, forward and backward.

    bias_gelu: z = x + b;  y = gelu(z)
        exact: gelu(z) = z·Φ(z),                      gelu'(z) = Φ(z) + z·φ(z)
        tanh:  gelu(z) = ½z(1 + tanh(u)), u = k(z + 0.044715z³), k = √(2/π)
               gelu'(z) = ½(1 + t) + ½z(1 - t²)·k(1 + 3·0.044715z²), t = tanh(u)
    swiglu:    y = silu(g)·u = g·σ(g)·u
        dg = dy·u·σ(g)(1 + g(1 - σ(g))),  du = dy·silu(g)
    geglu:     y = gelu(g)·u (exact or tanh)
        dg = dy·u·gelu'(g),  du = dy·gelu(g)

Math in fp32, outputs in the input dtype. The bias gradient (Σ over rows of dz) is reduced in the
same persistent backward pass, per program in registers, then summed over the programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speedkit.kernels.support import next_power_of_2, num_sms, runs_triton


@triton.jit
def _half_one_plus_tanh(u):
    """(s, 1 - s) with s = ½(1 + tanh(u)) = sigmoid(2u), each without cancellation: from
    a = exp(-2|u|) in (0, 1], never overflowing, 1 - s computed directly rather than subtracted
    (at u = -4, 1 + tanh(u) computed as 1 + tanh loses 4 digits to rounding)."""
    a = tl.exp(-2.0 * tl.abs(u))
    big = 1.0 / (1.0 + a)
    small = a / (1.0 + a)
    pos = u >= 0
    return tl.where(pos, big, small), tl.where(pos, small, big)


@triton.jit
def _gelu_and_grad(z, TANH: tl.constexpr, NEED_GRAD: tl.constexpr):
    if TANH:
        k: tl.constexpr = 0.7978845608028654
        u = k * (z + 0.044715 * z * z * z)
        s, s_c = _half_one_plus_tanh(u)  # ½(1 + t) and ½(1 - t), t = tanh(u)
        y = z * s
        if NEED_GRAD:  # ½(1 + t) + ½z(1 - t²)·u', with 1 - t² = 4·s·(1 - s)
            d = s + 2.0 * z * s * s_c * k * (1.0 + 3.0 * 0.044715 * z * z)
        else:
            d = y
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        y = z * cdf
        if NEED_GRAD:
            d = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
        else:
            d = y
    return y, d


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, stride_x, stride_y, M, N, TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    z = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = z + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y, _ = _gelu_and_grad(z, TANH, False)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY, X, B, DX, DB_PART, stride_dy, stride_x, stride_dx, M, N, TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Persistent over row blocks of one column block: dz = dy·gelu'(x + b); db partials in registers."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, nprog * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        z = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32) + b[None, :]
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _, d = _gelu_and_grad(z, TANH, True)
        dz = tl.where(mask, dy * d, 0.0)
        db += tl.sum(dz, axis=0)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dz.to(DX.dtype.element_ty), mask=mask)
    tl.store(DB_PART + pid.to(tl.int64) * N + cols, db, mask=col_ok)


#: the gated kernels' activation (their ACT constexpr)
_SILU, _GELU, _GELU_TANH = 0, 1, 2


@triton.jit
def _gate_and_grad(g, ACT: tl.constexpr, NEED_GRAD: tl.constexpr):
    """(act(g), act'(g)) for SwiGLU's SiLU or GeGLU's GELU (the second is act(g) again unless NEED_GRAD)."""
    if ACT == 0:
        sig = tl.sigmoid(g)
        y = g * sig
        if NEED_GRAD:
            d = sig * (1.0 + g * (1.0 - sig))
        else:
            d = y
    else:
        y, d = _gelu_and_grad(g, ACT == 2, NEED_GRAD)
    return y, d


@triton.jit
def _gated_fwd_kernel(G, U, Y, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    a, _ = _gate_and_grad(g, ACT, False)
    tl.store(Y + offs, (a * u).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _gated_bwd_kernel(DY, G, U, DG, DU, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    a, d = _gate_and_grad(g, ACT, True)
    tl.store(DG + offs, (dy * u * d).to(DG.dtype.element_ty), mask=ok)
    tl.store(DU + offs, (dy * a).to(DU.dtype.element_ty), mask=ok)


# -- launchers ------------------------------------------------------------------------------------------------


def _tiles(N: int) -> tuple[int, int, int]:
    block_n = min(1024, next_power_of_2(N))
    block_m = max(1, 4096 // block_n)
    return block_m, block_n, 8 if block_m * block_n >= 4096 else 4


def bias_gelu_forward(x: Tensor, bias: Tensor, tanh: bool, out: Tensor | None = None) -> Tensor:
    M, N = x.shape
    y = out if out is not None else torch.empty_like(x)
    if M:
        bm, bn, warps = _tiles(N)
        _bias_gelu_fwd_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            x, bias, y, x.stride(0), y.stride(0), M, N, TANH=tanh, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps
        )
    return y


def bias_gelu_backward(dy: Tensor, x: Tensor, bias: Tensor, tanh: bool, dx_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    M, N = x.shape
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = dx_out if dx_out is not None else torch.empty_like(x)
    if M == 0:
        return dx, torch.zeros_like(bias)
    bm, bn, warps = _tiles(N)
    col_blocks = triton.cdiv(N, bn)
    programs = max(1, min(triton.cdiv(M, bm), num_sms(x.device) * 4 // col_blocks))
    db_part = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    _bias_gelu_bwd_kernel[(programs, col_blocks)](
        dy,
        x,
        bias,
        dx,
        db_part,
        dy.stride(0),
        x.stride(0),
        dx.stride(0),
        M,
        N,
        TANH=tanh,
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=warps,
    )
    return dx, db_part.sum(0).to(bias.dtype)


def _gated_forward(g: Tensor, u: Tensor, act: int, out: Tensor | None) -> Tensor:
    y = out if out is not None else torch.empty_like(g)
    n = g.numel()
    if n:
        _gated_fwd_kernel[(triton.cdiv(n, 2048),)](g, u, y, n, ACT=act, BLOCK=2048, num_warps=8)
    return y


def _gated_backward(
    dy: Tensor, g: Tensor, u: Tensor, act: int, dg_out: Tensor | None, du_out: Tensor | None
) -> tuple[Tensor, Tensor]:
    dy = dy.contiguous()
    dg = dg_out if dg_out is not None else torch.empty_like(g)
    du = du_out if du_out is not None else torch.empty_like(u)
    n = g.numel()
    if n:
        _gated_bwd_kernel[(triton.cdiv(n, 2048),)](dy, g, u, dg, du, n, ACT=act, BLOCK=2048, num_warps=8)
    return dg, du


def swiglu_forward(g: Tensor, u: Tensor, out: Tensor | None = None) -> Tensor:
    return _gated_forward(g, u, _SILU, out)


def swiglu_backward(
    dy: Tensor, g: Tensor, u: Tensor, dg_out: Tensor | None = None, du_out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    return _gated_backward(dy, g, u, _SILU, dg_out, du_out)


def geglu_forward(g: Tensor, u: Tensor, tanh: bool, out: Tensor | None = None) -> Tensor:
    return _gated_forward(g, u, _GELU_TANH if tanh else _GELU, out)


def geglu_backward(
    dy: Tensor, g: Tensor, u: Tensor, tanh: bool, dg_out: Tensor | None = None, du_out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    return _gated_backward(dy, g, u, _GELU_TANH if tanh else _GELU, dg_out, du_out)


# -- custom ops ------------------------------------------------------------------------------------------------


@torch.library.custom_op("speedkit::bias_gelu", mutates_args=())
def _bias_gelu_op(x: Tensor, bias: Tensor, tanh: bool) -> Tensor:
    return bias_gelu_forward(x, bias, tanh)


@_bias_gelu_op.register_fake
def _(x, bias, tanh):
    return torch.empty_like(x)


@torch.library.custom_op("speedkit::bias_gelu_bwd", mutates_args=())
def _bias_gelu_bwd_op(dy: Tensor, x: Tensor, bias: Tensor, tanh: bool) -> tuple[Tensor, Tensor]:
    return bias_gelu_backward(dy, x, bias, tanh)


@_bias_gelu_bwd_op.register_fake
def _(dy, x, bias, tanh):
    return torch.empty_like(x), torch.empty_like(bias)


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.save_for_backward(x, bias)
    ctx.tanh = tanh


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, db = torch.ops.speedkit.bias_gelu_bwd(dy, x, bias, ctx.tanh)
    return dx, db, None


_bias_gelu_op.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


@torch.library.custom_op("speedkit::swiglu", mutates_args=())
def _swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    return swiglu_forward(gate, up)


@_swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("speedkit::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return swiglu_backward(dy, gate, up)


@_swiglu_bwd_op.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.speedkit.swiglu_bwd(dy, gate, up)


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


@torch.library.custom_op("speedkit::geglu", mutates_args=())
def _geglu_op(gate: Tensor, up: Tensor, tanh: bool) -> Tensor:
    return geglu_forward(gate, up, tanh)


@_geglu_op.register_fake
def _(gate, up, tanh):
    return torch.empty_like(gate)


@torch.library.custom_op("speedkit::geglu_bwd", mutates_args=())
def _geglu_bwd_op(dy: Tensor, gate: Tensor, up: Tensor, tanh: bool) -> tuple[Tensor, Tensor]:
    return geglu_backward(dy, gate, up, tanh)


@_geglu_bwd_op.register_fake
def _(dy, gate, up, tanh):
    return torch.empty_like(gate), torch.empty_like(up)


def _geglu_setup(ctx, inputs, output):
    gate, up, tanh = inputs
    ctx.save_for_backward(gate, up)
    ctx.tanh = tanh


def _geglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = torch.ops.speedkit.geglu_bwd(dy, gate, up, ctx.tanh)
    return dg, du, None


_geglu_op.register_autograd(_geglu_backward, setup_context=_geglu_setup)


class _BiasGeluFunction(torch.autograd.Function):
    """The eager path: the launchers without the op dispatcher's overhead."""

    @staticmethod
    def forward(ctx, x, bias, tanh):
        ctx.save_for_backward(x, bias)
        ctx.tanh = tanh
        return bias_gelu_forward(x, bias, tanh)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, db = bias_gelu_backward(dy, x, bias, ctx.tanh)
        return dx, db, None


class _GatedFunction(torch.autograd.Function):
    """The eager path of SwiGLU and GeGLU (``act``: the kernels' ACT constant)."""

    @staticmethod
    def forward(ctx, gate, up, act):
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return _gated_forward(gate, up, act, None)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = _gated_backward(dy, gate, up, ctx.act, None, None)
        return dg, du, None


# -- public functions -----------------------------------------------------------------------------------------


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` in one pass (bias over the last dim)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', found {approximate!r}")
    N = x.shape[-1]
    if bias.shape != (N,):
        raise ValueError(f"bias must have shape ({N},), found {tuple(bias.shape)}")
    if not runs_triton(x):
        return torch.nn.functional.gelu(x + bias, approximate=approximate)
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if torch.compiler.is_compiling():  # traced: the custom op, with its fake implementation
        return torch.ops.speedkit.bias_gelu(x2, bias, approximate == "tanh").view(x.shape)
    return _BiasGeluFunction.apply(x2, bias, approximate == "tanh").view(x.shape)


def _same_shape(gate: Tensor, up: Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, found {tuple(gate.shape)} and {tuple(up.shape)}")


def _gated(gate: Tensor, up: Tensor, act: int) -> Tensor:
    """``act(gate) * up`` in one pass: the custom op where torch.compile traces, else the eager path."""
    if torch.compiler.is_compiling():
        if act == _SILU:
            return torch.ops.speedkit.swiglu(gate.contiguous(), up.contiguous())
        return torch.ops.speedkit.geglu(gate.contiguous(), up.contiguous(), act == _GELU_TANH)
    return _GatedFunction.apply(gate.contiguous(), up.contiguous(), act)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` in one pass (same shapes)."""
    _same_shape(gate, up)
    if not runs_triton(gate):
        return torch.nn.functional.silu(gate) * up
    return _gated(gate, up, _SILU)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` in one pass (same shapes)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', found {approximate!r}")
    _same_shape(gate, up)
    if not runs_triton(gate):
        return torch.nn.functional.gelu(gate, approximate=approximate) * up
    return _gated(gate, up, _GELU_TANH if approximate == "tanh" else _GELU)
