"""Softmax cross-entropy over logits (N, V), with the gradient computed in the forward pass.

Per row i with target t (math in fp32 whatever the logits' dtype; ε = label smoothing)::

    lse_i  = log Σ_j exp(x_ij)                              (online max / sum over chunks)
    loss_i = lse_i - (1-ε)·x_it - (ε/V)·Σ_j x_ij            (0 for rows with t == ignore_index)
    dx_ij  = s · (softmax_ij - (ε/V) - (1-ε)·[j == t])      (0 for ignored rows)

with s = 1/n_valid for ``reduction="mean"`` (n_valid counted on the device: no host sync) and 1
otherwise. The forward reads each row twice (the second read mostly from L2) and writes the
gradient once, into a buffer the op allocates itself: the user's logits are never written to, and
the only memory beyond the logits is the gradient that backward needs anyway.

Eager backward multiplies that stored gradient by the incoming gradient in place — the buffer
is the op's own and nothing else holds it — and a row whose incoming gradient is exactly 1 (the
usual ``loss.backward()``) is skipped on the device, so the common backward moves no data at all.
A second eager backward through the same loss (``retain_graph=True``) is refused with an error
rather than silently scaling twice.

Under torch.compile (the custom ops, which Inductor cannot look into) the split is different: a
traced backward may not mutate a tensor saved by the forward, so scaling a stored gradient would
cost a whole extra pass. There the forward reads each row once and keeps only its log-sum-exp,
and the backward op reads the saved logits once and writes their gradient, scaled by the incoming
gradient, once: the same three passes over the data, none of them wasted, and no more memory
than Inductor's own loss (the logits, saved for backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from speedkit.kernels.support import runs_triton

#: the largest chunk of a row one program handles at a time (elements)
BLOCK_V = 8192
_REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _grad_chunk(x_row, g_row, cols, V, lse, target, smoothing, scale, SMOOTH: tl.constexpr):
    """One chunk of a row's gradient: scale · (softmax - ε/V - (1-ε)·[col == target]). The load is
    the logits' last use (evict_first); the store streams (.cs): the gradient is not read again
    soon, and must not push logits that are still to be read out of L2."""
    ok = cols < V
    x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
    g = tl.exp(x - lse)
    if SMOOTH:
        g = g - smoothing / V
        g = tl.where(cols == target, g - (1.0 - smoothing), g)
    else:
        g = tl.where(cols == target, g - 1.0, g)
    tl.store(g_row + cols, (g * scale).to(g_row.dtype.element_ty), mask=ok, cache_modifier=".cs")


@triton.jit
def _ce_fwd_kernel(
    LOGITS,
    TARGET,
    GRAD,
    LOSS,
    LSE,
    NVALID,
    stride_l,
    stride_g,
    V,
    ignore_index,
    smoothing,
    MEAN: tl.constexpr,
    SMOOTH: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per row: the loss and, with WRITE_GRAD, the gradient (pass 2); without it, the row's
    log-sum-exp for :func:`_ce_grad_kernel` (one read of the row, nothing written but scalars)."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGET + row).to(tl.int64)
    x_row = LOGITS + row * stride_l
    g_row = GRAD + row * stride_g
    cols0 = tl.arange(0, BLOCK)
    if target == ignore_index:
        if WRITE_GRAD:
            zero = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + cols0
                tl.store(g_row + cols, zero.to(GRAD.dtype.element_ty), mask=cols < V, cache_modifier=".cs")
        else:
            tl.store(LSE + row, 0.0)
        tl.store(LOSS + row, 0.0)
        return
    # pass 1: online max and sum of exp over the chunks (scalar state: few registers, so several
    # programs share an SM and keep many loads in flight)
    m = float("-inf")
    s = 0.0
    sx = 0.0
    for start in range(0, V, BLOCK):
        cols = start + cols0
        ok = cols < V
        # evict_last: pass 2 reads this chunk again, from L2 if it is still there
        x = tl.load(x_row + cols, mask=ok, other=float("-inf"), eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        if SMOOTH:
            sx += tl.sum(tl.where(ok, x, 0.0), axis=0)
    lse = m + tl.log(s)
    x_t = tl.load(x_row + target).to(tl.float32)
    if SMOOTH:
        loss = lse - (1.0 - smoothing) * x_t - smoothing / V * sx
    else:
        loss = lse - x_t
    tl.store(LOSS + row, loss)
    if not WRITE_GRAD:
        tl.store(LSE + row, lse)
        return
    scale = 1.0
    if MEAN:
        scale = 1.0 / tl.load(NVALID).to(tl.float32)
    # pass 2: the gradient, last chunk first: the chunks pass 1 read last are likeliest still in L2
    n_chunks = tl.cdiv(V, BLOCK)
    for i in range(n_chunks):
        _grad_chunk(x_row, g_row, (n_chunks - 1 - i) * BLOCK + cols0, V, lse, target, smoothing, scale, SMOOTH)


@triton.jit
def _ce_bwd_kernel(GRAD, GOUT, stride_g, V, PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """grad_row *= grad_output (in place, on the op's own buffer); rows scaled by exactly 1 are skipped."""
    row = tl.program_id(0).to(tl.int64)
    if PER_ROW:
        scale = tl.load(GOUT + row).to(tl.float32)
    else:
        scale = tl.load(GOUT).to(tl.float32)
    if scale != 1.0:
        g_row = GRAD + row * stride_g
        cols0 = tl.arange(0, BLOCK)
        for start in range(0, V, BLOCK):
            cols = start + cols0
            ok = cols < V
            g = tl.load(g_row + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(g_row + cols, (g * scale).to(GRAD.dtype.element_ty), mask=ok)


@triton.jit
def _ce_grad_kernel(
    LOGITS,
    TARGET,
    LSE,
    GOUT,
    NVALID,
    GRAD,
    stride_l,
    stride_g,
    V,
    ignore_index,
    smoothing,
    MEAN: tl.constexpr,
    SMOOTH: tl.constexpr,
    PER_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The gradient from the saved log-sum-exp, scaled by the incoming gradient: one read of the
    logits, one write of the gradient (the backward of the op that torch.compile traces)."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGET + row).to(tl.int64)
    g_row = GRAD + row * stride_g
    x_row = LOGITS + row * stride_l
    cols0 = tl.arange(0, BLOCK)
    if PER_ROW:
        scale = tl.load(GOUT + row).to(tl.float32)
    else:
        scale = tl.load(GOUT).to(tl.float32)
    if MEAN:
        scale = scale / tl.load(NVALID).to(tl.float32)
    if target == ignore_index:  # zeros, written rather than scaled: exp(x - lse) may be inf here
        zero = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + cols0
            tl.store(g_row + cols, zero.to(GRAD.dtype.element_ty), mask=cols < V, cache_modifier=".cs")
        return
    lse = tl.load(LSE + row)
    for start in range(0, V, BLOCK):
        _grad_chunk(x_row, g_row, start + cols0, V, lse, target, smoothing, scale, SMOOTH)


def _block(V: int) -> tuple[int, int]:
    """(chunk, num_warps): rows in chunks of up to 8K elements, 8 warps (32 elements per thread).

    From a sweep on an H200 (bench/profile_kernels.py --ce, bf16 16384×50304 and 8192×128256):
    8K-element chunks with 8 warps, loads hinted evict_last in pass 1 and evict_first in pass 2,
    and streaming stores of the gradient were fastest or within 1% (1.10 ms and 1.49 ms for the
    forward); 32K chunks with 32 warps and no hints took 1.56 ms and 1.67 ms.
    """
    block = min(BLOCK_V, triton.next_power_of_2(V))
    return block, (4 if block <= 2048 else 8)


def cross_entropy_forward(
    logits: Tensor,
    target: Tensor,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    grad_out: Tensor | None = None,
    losses_out: Tensor | None = None,
    n_valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(per-row losses (N,) fp32, gradient (N, V) in the logits' dtype)`` for ``dL/dloss = 1``.

    ``grad_out`` may be ``logits`` itself (each element is read before its gradient is written);
    ``n_valid`` (a device scalar) is the mean's divisor where these rows are a chunk of a larger batch."""
    N, V = logits.shape
    grad = grad_out if grad_out is not None else torch.empty_like(logits)
    losses = losses_out if losses_out is not None else torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return losses, grad
    # counted on the device: the kernel reads it, the host never does
    if n_valid is None:
        n_valid = (target != ignore_index).sum() if reduction == "mean" else losses
    block, warps = _block(V)
    _ce_fwd_kernel[(N,)](
        logits,
        target,
        grad,
        losses,
        losses,
        n_valid,
        logits.stride(0),
        grad.stride(0),
        V,
        ignore_index,
        float(label_smoothing),
        MEAN=reduction == "mean",
        SMOOTH=label_smoothing > 0,
        WRITE_GRAD=True,
        BLOCK=block,
        num_warps=warps,
    )
    return losses, grad


def cross_entropy_lse(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """``(per-row losses, per-row log-sum-exp)``, both (N,) fp32: one read of the logits, no gradient."""
    N, V = logits.shape
    losses = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return losses, lse
    block, warps = _block(V)
    _ce_fwd_kernel[(N,)](
        logits,
        target,
        logits,
        losses,
        lse,
        losses,
        logits.stride(0),
        0,
        V,
        ignore_index,
        float(label_smoothing),
        MEAN=False,
        SMOOTH=label_smoothing > 0,
        WRITE_GRAD=False,
        BLOCK=block,
        num_warps=warps,
    )
    return losses, lse


def cross_entropy_grad(
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    grad_loss: Tensor,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    grad_out: Tensor | None = None,
) -> Tensor:
    """dL/dlogits from the saved log-sum-exp, scaled by ``grad_loss`` (a scalar, or (N,) for "none")."""
    N, V = logits.shape
    grad = grad_out if grad_out is not None else torch.empty_like(logits)
    if N == 0:
        return grad
    n_valid = (target != ignore_index).sum() if reduction == "mean" else lse
    gout = grad_loss.reshape(-1)
    block, warps = _block(V)
    _ce_grad_kernel[(N,)](
        logits,
        target,
        lse,
        gout,
        n_valid,
        grad,
        logits.stride(0),
        grad.stride(0),
        V,
        ignore_index,
        float(label_smoothing),
        MEAN=reduction == "mean",
        SMOOTH=label_smoothing > 0,
        PER_ROW=gout.numel() > 1,
        BLOCK=block,
        num_warps=warps,
    )
    return grad


def _reduce(losses: Tensor, target: Tensor, reduction: str, ignore_index: int) -> Tensor:
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()


# -- custom ops --------------------------------------------------------------------------------------


@torch.library.custom_op("speedkit::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(
    logits: Tensor, target: Tensor, reduction: str, ignore_index: int, label_smoothing: float
) -> tuple[Tensor, Tensor]:
    losses, lse = cross_entropy_lse(logits, target, ignore_index, label_smoothing)
    return _reduce(losses, target, reduction, ignore_index), lse


@_ce_fwd_op.register_fake
def _(logits, target, reduction, ignore_index, label_smoothing):
    N = logits.shape[0]
    loss = logits.new_empty((N,) if reduction == "none" else (), dtype=torch.float32)
    return loss, logits.new_empty(N, dtype=torch.float32)


@torch.library.custom_op("speedkit::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(
    logits: Tensor, target: Tensor, lse: Tensor, grad_loss: Tensor, reduction: str, ignore_index: int, label_smoothing: float
) -> Tensor:
    return cross_entropy_grad(logits, target, lse, grad_loss, reduction, ignore_index, label_smoothing)


@_ce_bwd_op.register_fake
def _(logits, target, lse, grad_loss, reduction, ignore_index, label_smoothing):
    return torch.empty_like(logits)


def _setup(ctx, inputs, output):
    logits, target, reduction, ignore_index, label_smoothing = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, target, lse)
    ctx.args = (reduction, ignore_index, label_smoothing)


def _backward(ctx, grad_loss, _grad_lse):
    """The custom op's backward — what torch.compile traces: one more op, which reads the saved
    logits once and writes their gradient once (no tensor saved by the forward is mutated)."""
    logits, target, lse = ctx.saved_tensors
    grad = torch.ops.speedkit.cross_entropy_bwd(logits, target, lse, grad_loss.float(), *ctx.args)
    return grad, None, None, None, None


_ce_fwd_op.register_autograd(_backward, setup_context=_setup)


def scale_gradient_(grad: Tensor, grad_output: Tensor) -> None:
    """``grad *= grad_output`` in place (per row for reduction="none"), skipping rows scaled by 1."""
    N, V = grad.shape
    if N == 0:
        return
    block, warps = _block(V)
    gout = grad_output.reshape(-1)
    _ce_bwd_kernel[(N,)](grad, gout, grad.stride(0), V, PER_ROW=gout.numel() > 1, BLOCK=block, num_warps=warps)


class _CrossEntropyFunction(torch.autograd.Function):
    """The eager path: the same launchers as the custom ops, without the op dispatcher's overhead."""

    @staticmethod
    def forward(ctx, logits, target, reduction, ignore_index, label_smoothing):
        losses, grad = cross_entropy_forward(logits, target, reduction, ignore_index, label_smoothing)
        ctx.save_for_backward(grad)
        ctx.consumed = False
        return _reduce(losses, target, reduction, ignore_index)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.consumed:
            raise RuntimeError(
                "speedkit cross_entropy: backward ran twice through the same loss (retain_graph=True); "
                "its gradient buffer is scaled in place, so recompute the loss for a second backward"
            )
        ctx.consumed = True
        (grad,) = ctx.saved_tensors
        scale_gradient_(grad, grad_loss)  # in place on the op's own buffer; rows scaled by 1 are skipped
        return grad, None, None, None, None


# -- public function ------------------------------------------------------------------------------------


def cross_entropy(
    logits: Tensor, target: Tensor, reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0
) -> Tensor:
    """``F.cross_entropy(logits.float(), target, …)`` for 2-D logits, fused (see the module doc)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, found {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], found {label_smoothing}")
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(f"expected logits (N, V) and target (N,), found {tuple(logits.shape)} and {tuple(target.shape)}")
    if not runs_triton(logits):
        return torch.nn.functional.cross_entropy(
            logits.float(), target, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing
        )
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if torch.compiler.is_compiling():  # traced: the custom op, with its fake implementation
        loss, _ = torch.ops.speedkit.cross_entropy_fwd(logits, target, reduction, int(ignore_index), float(label_smoothing))
        return loss
    return _CrossEntropyFunction.apply(logits, target, reduction, int(ignore_index), float(label_smoothing))
