"""Rotary position embedding (the rotate-half form of Llama, Mistral, Qwen, Gemma), forward and backward.

    x = (x₁, x₂) split at half the head dim;  rotate_half(x) = (-x₂, x₁)
    y = x·cos + rotate_half(x)·sin:   y₁ = x₁c₁ - x₂s₁,  y₂ = x₂c₂ + x₁s₂
    dx₁ = dy₁c₁ + dy₂s₂,  dx₂ = dy₂c₂ - dy₁s₁

One pass over a 4-D ``x`` (any strides: the usual ``view(B, T, H, D).transpose(1, 2)`` of a projection
is read in place) with ``cos``/``sin`` broadcast to it (stride 0 over the heads), math in fp32, the
result in ``x``'s dtype and layout. PyTorch's version reads ``x`` three times and writes four
intermediates. The tables get no gradient: Hugging Face computes them under ``no_grad``, and the
caller (:func:`speedkit.kernels.layers.rotary_pos_emb`) runs PyTorch's code where they need one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speedkit.kernels.support import next_power_of_2


@triton.jit
def _rotary_kernel(
    X,
    C,
    S,
    Y,
    R,
    N1,
    N2,
    HALF,
    sx0,
    sx1,
    sx2,
    sx3,
    sc0,
    sc1,
    sc2,
    sc3,
    sy0,
    sy1,
    sy2,
    sy3,
    BACKWARD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.arange(0, BLOCK_H).to(tl.int64)
    mask = (rows < R)[:, None] & (cols < HALF)[None, :]
    i0 = rows // (N1 * N2)
    i1 = (rows // N2) % N1
    i2 = rows % N2
    xb = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    cb = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
    yb = (i0 * sy0 + i1 * sy1 + i2 * sy2)[:, None]
    lo, hi = cols[None, :], cols[None, :] + HALF
    x1 = tl.load(X + xb + lo * sx3, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + xb + hi * sx3, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(C + cb + lo * sc3, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(C + cb + hi * sc3, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(S + cb + lo * sc3, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(S + cb + hi * sc3, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + yb + lo * sy3, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + yb + hi * sy3, y2.to(Y.dtype.element_ty), mask=mask)


def rotary_apply(x: Tensor, cos: Tensor, sin: Tensor, backward: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    """The rotation of 4-D ``x`` by ``cos``/``sin`` already broadcast to its shape (``expand``: stride 0
    where they repeat), in ``dtype`` (default: ``x``'s) and ``x``'s layout; ``backward``: its transpose
    (the gradient of ``x``)."""
    y = torch.empty_like(x, dtype=dtype)
    n0, n1, n2, d = x.shape
    rows = n0 * n1 * n2
    if rows == 0:
        return y
    half = d // 2
    block_h = next_power_of_2(half)
    block_r = max(1, min(64, 2048 // block_h))
    _rotary_kernel[(triton.cdiv(rows, block_r),)](
        x,
        cos,
        sin,
        y,
        rows,
        n1,
        n2,
        half,
        *x.stride(),
        *cos.stride(),
        *y.stride(),
        BACKWARD=backward,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return rotary_apply(x, cos, sin, dtype=torch.promote_types(x.dtype, cos.dtype))

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return rotary_apply(dy, cos, sin, backward=True, dtype=ctx.x_dtype), None, None


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` for a 4-D ``x`` with an even last dim and ``cos``/``sin`` of one
    dtype that broadcast to it (no gradient to them), in one pass; the result in the dtype PyTorch's
    arithmetic promotes to (bf16 ``x`` and fp32 tables, as transformers' under autocast: fp32)."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must be 4-D with an even last dim, found shape {tuple(x.shape)}")
    if cos.dtype != sin.dtype:
        raise ValueError(f"cos and sin must have one dtype, found {cos.dtype} and {sin.dtype}")
    cos, sin = cos.expand(x.shape), sin.expand(x.shape)
    return _Rotary.apply(x, cos, sin)
