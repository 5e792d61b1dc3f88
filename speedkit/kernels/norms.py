"""LayerNorm and RMSNorm: Triton forward and backward, one custom op each.

Forward, per row of ``x`` (M, N) — statistics always in fp32::

    LayerNorm: mean = Σx/N,  rstd = 1/sqrt(Σ(x-mean)²/N + eps),  y = (x-mean)·rstd·w + b
    RMSNorm:                 rstd = 1/sqrt(Σx²/N + eps),           y = x·rstd·w

Backward, with x̂ = (x-mean)·rstd (RMS: x·rstd) and g = dy·w (dy when there is no weight)::

    LayerNorm: dx = rstd·(g - x̂·mean(x̂·g) - mean(g))
    RMSNorm:   dx = rstd·(g - x̂·mean(x̂·g))
    dw = Σ_rows dy·x̂,  db = Σ_rows dy

Rows up to ``MAX_FUSED`` wide are held in registers (one read of x per pass); wider rows are
walked in chunks, with Chan's parallel update for the statistics (still one read for them). The
backward runs a persistent grid: each program walks a strided set of rows and keeps its share of
dw/db in fp32 registers (narrow rows) or in its own row of a partial buffer (wide rows), so the
weight gradients cost one small (programs × N) sum at the end, not a second pass over dy.
Row offsets are computed in int64.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

from speedkit.kernels.norm_kernels import (
    _norm_bwd_kernel,
    _norm_bwd_looped_kernel,
    _norm_fwd_kernel,
    _norm_fwd_looped_kernel,
    _sum_partials_kernel,
)
from speedkit.kernels.support import next_power_of_2, num_sms, runs_triton

#: widest row kept in registers; wider rows loop over chunks of CHUNK
MAX_FUSED = 16384
CHUNK = 4096


# -- launch configuration --------------------------------------------------------------------------


@functools.cache
def _fwd_config(N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the forward for rows that fit in registers.

    From a sweep on an H200 (bench/tune_kernels.py, bf16, 16384×768 / 16384×4096 / 8192×8192):
    ~8K elements per program and ~8 elements per thread were best or within 2% of it.
    """
    block_n = next_power_of_2(N)
    block_m = max(1, min(16, 8192 // block_n))
    num_warps = max(4, min(16, block_m * block_n // 1024))
    return block_m, block_n, num_warps


@functools.cache
def _bwd_config(N: int, M: int, device: torch.device, rms: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, programs) of the persistent backward.

    From sweeps on an H200 of the backward's GPU time (bench/profile_kernels.py --sweep, bf16):
    LayerNorm 16384×4096 took 118 µs with 4 rows × 16 warps × 1 program per SM against 150 µs
    with 2 × 8 × 2; 8192×8192 took 142 µs with 2 × 8 × 1 against 154 µs with 2 × 16 × 1; for
    RMSNorm 16384×4096, 2 × 8 × 2 stayed best (101 µs). Narrow rows: few warps, several
    programs per SM (LayerNorm has two row reductions per row, each a barrier).
    """
    block_n = next_power_of_2(N)
    if block_n <= 1024:
        block_m, num_warps, per_sm = (1, 8, 4) if rms else (4, 4, 2)
    elif block_n <= 2048:
        block_m, num_warps, per_sm = 2, (8 if rms else 4), 2
    elif block_n <= 4096:
        block_m, num_warps, per_sm = (2, 8, 2) if rms else (4, 16, 1)
    elif block_n <= 8192:
        block_m, num_warps, per_sm = (2, 16, 1) if rms else (2, 8, 1)
    else:
        block_m, num_warps, per_sm = 1, 16, 1
    programs = min(triton.cdiv(M, block_m), num_sms(device) * per_sm)
    return block_m, block_n, num_warps, programs


@functools.cache
def _partials_block(N: int, device: torch.device) -> int:
    """Columns per program of the partials' sum: narrow blocks, so that N/block programs (at least
    two per SM where N allows) share the read of the (P, N) partials, which are still in L2."""
    per = 1 << max(0, (N // (2 * num_sms(device))).bit_length() - 1)  # largest power of 2 <= N / (2·SMs)
    return max(16, min(64, per, next_power_of_2(N)))


def norm_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    out: Tensor | None = None,
    separate_stats: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` for ``x`` of shape (M, N) with a contiguous last dim.

    ``mean`` and ``rstd`` are two views of one allocation (small problems are host-bound: every
    allocation counts) unless ``separate_stats`` (custom-op outputs may not alias each other).
    """
    M, N = x.shape
    y = out if out is not None else torch.empty_like(x)
    if separate_stats:
        mean = torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    else:
        stats = torch.empty((2, M), dtype=torch.float32, device=x.device)
        mean, rstd = stats[0], stats[1]
    if M == 0:
        return y, mean, rstd
    w = weight if weight is not None else x  # placeholders: never read when HAS_W/HAS_B are False
    b = bias if bias is not None else x
    if N <= MAX_FUSED:
        block_m, block_n, warps = _fwd_config(N)
        grid = (triton.cdiv(M, block_m),)
        _norm_fwd_kernel[grid](
            x,
            w,
            b,
            y,
            mean,
            rstd,
            x.stride(0),
            y.stride(0),
            M,
            N,
            eps,
            IS_RMS=rms,
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
        )
    else:
        _norm_fwd_looped_kernel[(M,)](
            x,
            w,
            b,
            y,
            mean,
            rstd,
            x.stride(0),
            y.stride(0),
            N,
            eps,
            IS_RMS=rms,
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            BLOCK_N=CHUNK,
            num_warps=16,
        )
    return y, mean, rstd


def norm_backward(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    rms: bool,
    has_bias: bool,
    dx_out: Tensor | None = None,
    separate_grads: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(dx, dw, db)``; dw/db are None when there is no weight/bias.

    dw and db are two views of one allocation unless ``separate_grads`` (custom-op outputs may
    not alias each other)."""
    M, N = x.shape
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dx = dx_out if dx_out is not None else torch.empty_like(x)
    has_w = weight is not None
    if M == 0:
        zero = lambda: torch.zeros(N, dtype=torch.float32, device=x.device)  # noqa: E731
        return (
            dx,
            (zero().to(weight.dtype) if has_w else None),
            (zero().to(weight.dtype if has_w else x.dtype) if has_bias else None),
        )
    w = weight if has_w else x
    wide = N > MAX_FUSED
    if wide:
        programs = min(M, num_sms(x.device) * 2)
    else:
        block_m, block_n, warps, programs = _bwd_config(N, M, x.device, rms)
    # partials: one fp32 row per program (plane 0: dw, last plane: db); the wide kernel
    # accumulates into them, so they start at 0
    planes = int(has_w) + int(has_bias)
    part = (torch.zeros if wide else torch.empty)((max(planes, 1), programs, N), dtype=torch.float32, device=x.device)
    dw_part = part[0] if has_w else x
    db_part = part[planes - 1] if has_bias else x
    if wide:
        _norm_bwd_looped_kernel[(programs,)](
            dy,
            x,
            w,
            mean,
            rstd,
            dx,
            dw_part,
            db_part,
            dy.stride(0),
            x.stride(0),
            dx.stride(0),
            M,
            N,
            IS_RMS=rms,
            HAS_W=has_w,
            HAS_B=has_bias,
            BLOCK_N=CHUNK,
            num_warps=16,
        )
    else:
        _norm_bwd_kernel[(programs,)](
            dy,
            x,
            w,
            mean,
            rstd,
            dx,
            dw_part,
            db_part,
            dy.stride(0),
            x.stride(0),
            dx.stride(0),
            M,
            N,
            IS_RMS=rms,
            HAS_W=has_w,
            HAS_B=has_bias,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
        )
    if not planes:
        return dx, None, None
    param_dtype = weight.dtype if has_w else x.dtype
    if separate_grads:
        dw = torch.empty(N, dtype=param_dtype, device=x.device) if has_w else None
        db = torch.empty(N, dtype=param_dtype, device=x.device) if has_bias else None
        grads = dw if dw is not None else db
    else:
        grads = torch.empty((planes, N), dtype=param_dtype, device=x.device)
        dw = grads[0] if has_w else None
        db = grads[planes - 1] if has_bias else None
    block = _partials_block(N, x.device)
    _sum_partials_kernel[(triton.cdiv(N, block),)](
        part,
        dw if has_w else grads,
        db if has_bias else grads,
        programs,
        N,
        HAS_W=has_w,
        HAS_B=has_bias,
        BLOCK_P=32,
        BLOCK_N=block,
        num_warps=4,
    )
    return dx, dw, db


# -- custom ops ------------------------------------------------------------------------------------------


@torch.library.custom_op("speedkit::norm_fwd", mutates_args=())
def _norm_fwd_op(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    return norm_forward(x, weight, bias, eps, rms, separate_stats=True)


@_norm_fwd_op.register_fake
def _(x, weight, bias, eps, rms):
    M = x.shape[0]
    return torch.empty_like(x), x.new_empty(M, dtype=torch.float32), x.new_empty(M, dtype=torch.float32)


@torch.library.custom_op("speedkit::norm_bwd", mutates_args=())
def _norm_bwd_op(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, rms: bool, has_bias: bool
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = norm_backward(dy, x, weight, mean, rstd, rms, has_bias, separate_grads=True)
    # custom ops return tensors: absent gradients travel as empty ones (distinct: outputs may not alias)
    return dx, dw if dw is not None else x.new_empty(0), db if db is not None else x.new_empty(0)


@_norm_bwd_op.register_fake
def _(dy, x, weight, mean, rstd, rms, has_bias):
    N = x.shape[1]
    pdt = weight.dtype if weight is not None else x.dtype
    return (
        torch.empty_like(x),
        x.new_empty(N if weight is not None else 0, dtype=pdt),
        x.new_empty(N if has_bias else 0, dtype=pdt),
    )


def _setup(ctx, inputs, output):
    x, weight, bias, eps, rms = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.rms, ctx.has_bias = rms, bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.speedkit.norm_bwd(dy, x, weight, mean, rstd, ctx.rms, ctx.has_bias)
    return dx, (dw if weight is not None else None), (db if ctx.has_bias else None), None, None


_norm_fwd_op.register_autograd(_backward, setup_context=_setup)


class _NormFunction(torch.autograd.Function):
    """The eager path: the same launchers as the custom ops, without the op dispatcher's overhead
    (tens of microseconds a call, as much as the kernel itself at 16384×768)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        y, mean, rstd = norm_forward(x, weight, bias, eps, rms)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.has_bias = rms, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = norm_backward(dy, x, weight, mean, rstd, ctx.rms, ctx.has_bias)
        return dx, dw, db, None, None


# -- public functions ------------------------------------------------------------------------------


def _norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
    N = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (N,):
            raise ValueError(f"{name} must have shape ({N},) for normalization over the last dim, found {tuple(p.shape)}")
    if not runs_triton(x):
        return _reference(x, weight, bias, eps, rms)
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if torch.compiler.is_compiling():  # traced: the custom op, with its fake implementation
        y, _, _ = torch.ops.speedkit.norm_fwd(x2, weight, bias, float(eps), rms)
    else:
        y = _NormFunction.apply(x2, weight, bias, float(eps), rms)
    return y.view(x.shape)


def _reference(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
    """The same function in PyTorch (fp32 statistics), where the kernels cannot run."""
    xf = x.float()
    if rms:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    else:
        mean = xf.mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim, output in ``x``'s dtype, statistics in fp32."""
    return _norm(x, weight, bias, eps, rms=False)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x²) + eps) * weight``, output in ``x``'s dtype."""
    return _norm(x, weight, None, eps, rms=True)
