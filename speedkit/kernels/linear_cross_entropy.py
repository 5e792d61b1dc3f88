"""An LM head and its cross-entropy in one op that never holds the whole logits:
``F.cross_entropy(F.linear(h, weight, bias).float(), target, …)`` computed in chunks of tokens.

For each chunk of ``C`` rows of ``h`` (N, H), in one pass and in the forward::

    logits = h_c · Wᵀ (+ b)                              (C, V) in the compute dtype (bf16 under autocast),
                                                          rows padded to a multiple of 64 (:data:`VOCAB_ALIGN`)
    loss_c, g = softmax cross-entropy and its gradient     in fp32 (the chunk's logits overwritten by g)
    dh_c   = g · W                                         (C, H)
    dW    += gᵀ · h_c                                      (V, H), accumulated in fp32
    db    += Σ_rows g

so the memory beyond the op's inputs is one chunk's logits, ``dh`` (N, H) and ``dW`` (V, H): for
GPT-2 small at 16 × 1024 tokens (V = 50257) about 0.4 GB against 4.9 GB for logits in bf16 plus
their fp32 copy. The gradient is scaled by ``1 / n_valid`` (the labels not ``ignore_index``, counted
on the device: no host sync) for ``reduction="mean"``; backward only multiplies the stored gradients
by the incoming one (a scalar).

The op is ``speedkit::linear_cross_entropy``, a custom op with a fake implementation and a registered
autograd formula: ``torch.compile`` traces it as one opaque call (no graph break) and a captured CUDA
graph replays it (the number of chunks depends on shapes only). On CUDA the chunk's loss and
gradient come from the fused cross-entropy kernel of :mod:`speedkit.kernels.cross_entropy`
(in place on the chunk's logits); elsewhere (the CPU) from PyTorch's ops, in fp32.

Numerics: the loss and its gradient in fp32 from logits in the compute dtype, as
``cross_entropy(lm_head(h).float(), …)`` computes them under autocast; ``dW`` is each chunk's bf16
GEMM summed in fp32 over the chunks (eager autocast rounds one bf16 GEMM over all the tokens), so the
two agree to bf16's rounding, and exactly (fp32, 1e-5 relative) without autocast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from speedkit.kernels.support import runs_triton

_REDUCTIONS = ("mean", "sum")
#: elements of one chunk's logits the op aims for (a quarter GB in bf16): chunks this large keep each
#: GEMM efficient and the fp32 accumulation of dW to a few passes
CHUNK_ELEMENTS = 1 << 27
#: the head's weight copy in the compute dtype has its rows padded with zeros to a multiple of this:
#: an odd vocabulary (GPT-2's 50257) gives each chunk's logits an odd row stride, and cuBLAS then runs
#: the three GEMMs on slow unaligned kernels (an H100 took 34.3 ms for GPT-2 small's head and loss,
#: 91% of it in sm75 "s1688" GEMMs, against 9.5 ms for the model's own code under torch.compile,
#: whose Inductor pads the logits' stride). The padded columns of the logits are exactly zero and
#: take no part in the loss: the cross-entropy reads the first ``V`` of each row
VOCAB_ALIGN = 64


def padded_vocab(vocab: int) -> int:
    """``vocab`` rounded up to a multiple of :data:`VOCAB_ALIGN`."""
    return -(-vocab // VOCAB_ALIGN) * VOCAB_ALIGN


def chunk_rows(n: int, vocab: int, chunk: int | None = None) -> int:
    """Rows per chunk: ``chunk`` if given, else the power of two nearest below ``CHUNK_ELEMENTS / vocab``
    (at least 64), never more than ``n``."""
    if chunk is None:
        chunk = max(64, 1 << max(0, (CHUNK_ELEMENTS // max(vocab, 1)).bit_length() - 1))
    return max(1, min(chunk, n))


def _accumulate(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a · b`` with ``acc`` in fp32 and ``a``, ``b`` in the compute dtype: the chunk's product
    from one GEMM in that dtype (fp32 accumulation inside it, rounded once on output, as autocast's one
    GEMM over all the tokens rounds), summed over the chunks in fp32.

    Not ``torch.mm(a, b, out_dtype=torch.float32)``: where that runs, it is not known to take the bf16
    tensor cores' path (the fused head ran at 0.663x the model's own on an H200 with it, unexplained yet)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


def _padded(t: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` with zero rows appended up to ``rows`` (``t`` itself where nothing changes)."""
    if t.shape[0] == rows:
        return t.to(dtype)
    out = t.new_zeros((rows, *t.shape[1:]), dtype=dtype)
    out[: t.shape[0]].copy_(t)
    return out


def _chunk_loss_and_grad(
    logits: Tensor, target: Tensor, n_valid: Tensor, scale_by_count: bool, ignore_index: int, smoothing: float, with_grad: bool
) -> Tensor:
    """Per-row fp32 losses of one chunk; with ``with_grad`` its logits are overwritten by
    dL/dlogits (scaled by ``1 / n_valid`` where ``scale_by_count``)."""
    if runs_triton(logits) and with_grad:
        from speedkit.kernels.cross_entropy import cross_entropy_forward

        losses, _ = cross_entropy_forward(
            logits,
            target,
            "mean" if scale_by_count else "sum",
            ignore_index,
            smoothing,
            grad_out=logits,
            n_valid=n_valid,
        )
        return losses
    x = logits.float()
    V = x.shape[1]
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).unsqueeze(1)
    lse = torch.logsumexp(x, dim=1)
    picked = x.gather(1, safe).squeeze(1)
    losses = lse - (1.0 - smoothing) * picked - (smoothing / V) * x.sum(1) if smoothing else lse - picked
    losses = torch.where(valid, losses, 0.0)
    if with_grad:
        g = torch.exp(x - lse.unsqueeze(1))
        if smoothing:
            g.sub_(smoothing / V)
        g.scatter_add_(1, safe, torch.full_like(picked, -(1.0 - smoothing)).unsqueeze(1))
        row_scale = valid.float()
        if scale_by_count:
            row_scale = row_scale / n_valid
        g.mul_(row_scale.unsqueeze(1))
        logits.copy_(g)
    return losses


@torch.library.custom_op("speedkit::linear_cross_entropy", mutates_args=())
def _lce_op(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    chunk: int,
    with_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, dh, dW, db) for ``dL/dloss = 1``; the gradients are empty without ``with_grad``. The op's
    own arguments: the caller (:func:`linear_cross_entropy`) has cast ``h`` to the compute dtype."""
    N, H = h.shape
    V = weight.shape[0]
    Vp = padded_vocab(V)
    dtype = h.dtype
    w, b = _padded(weight, Vp, dtype), _padded(bias, Vp, dtype) if bias is not None else None
    n_valid = (target != ignore_index).sum()
    mean = reduction == "mean"
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if with_grad else h.new_empty(0)
    dw = torch.zeros(Vp, H, dtype=torch.float32, device=h.device) if with_grad else h.new_empty(0)
    db = torch.zeros(Vp, dtype=torch.float32, device=h.device) if with_grad and bias is not None else h.new_empty(0)
    rows = chunk_rows(N, V, chunk or None)
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, N, rows):
            h_c = h[start : start + rows]
            logits = torch.addmm(b, h_c, w.t()) if b is not None else torch.mm(h_c, w.t())  # (C, Vp), aligned rows
            losses = _chunk_loss_and_grad(
                logits[:, :V], target[start : start + rows], n_valid, mean, ignore_index, label_smoothing, with_grad
            )
            total += losses.sum()
            if with_grad:  # the padded columns stay zero: no part in dh, zero rows of dW and db
                torch.mm(logits, w, out=dh[start : start + rows])
                _accumulate(dw, logits.t(), h_c)
                if bias is not None:
                    db += logits.float().sum(0)
    loss = total / n_valid if mean else total
    if with_grad:
        dw = dw[:V].to(weight.dtype)
        db = db[:V].to(bias.dtype) if bias is not None else db
    return loss, dh, dw, db


@_lce_op.register_fake
def _(h, weight, bias, target, ignore_index, reduction, label_smoothing, chunk, with_grad):
    loss = h.new_empty((), dtype=torch.float32)
    if not with_grad:
        return loss, h.new_empty(0), h.new_empty(0), h.new_empty(0)
    db = bias.new_empty(bias.shape) if bias is not None else h.new_empty(0)
    return loss, torch.empty_like(h), weight.new_empty(weight.shape), db


def _setup(ctx, inputs, output) -> None:
    h, weight, bias, *_ = inputs
    _, dh, dw, db = output
    ctx.mark_non_differentiable(dh, dw, db)
    ctx.save_for_backward(dh, dw, db)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_loss, *_unused):
    dh, dw, db = ctx.saved_tensors
    if dh.numel() == 0 and dw.numel() == 0:
        raise RuntimeError(
            "speedkit linear_cross_entropy: backward through a loss computed without gradients "
            "(grad mode was off, or neither the hidden states nor the weight required grad)"
        )
    g = grad_loss.float()
    grad_h = (dh * g).to(dh.dtype)
    grad_w = (dw * g).to(dw.dtype)
    grad_b = (db * g).to(db.dtype) if ctx.has_bias else None
    return grad_h, grad_w, grad_b, None, None, None, None, None, None


_lce_op.register_autograd(_backward, setup_context=_setup)


def compute_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the head's GEMMs run in: autocast's where it is on for ``h``'s device, else what
    ``F.linear(h, weight)`` would promote to."""
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(h.dtype, weight.dtype)


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk: int | None = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(h, weight, bias).float(), target, …)`` over ``h`` (..., H) and
    ``target`` (...), without the logits (see the module doc); an fp32 scalar."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, found {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], found {label_smoothing}")
    H = weight.shape[1]
    if h.shape[-1] != H or h.shape[:-1] != target.shape:
        raise ValueError(
            f"expected h (..., {H}) and target of h's leading shape, found {tuple(h.shape)} and {tuple(target.shape)}"
        )
    dtype = compute_dtype(h, weight)
    h2 = h.reshape(-1, H).to(dtype)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    t = target.reshape(-1).to(h.device)
    with_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    loss, *_ = torch.ops.speedkit.linear_cross_entropy(
        h2, weight, bias, t, int(ignore_index), reduction, float(label_smoothing), int(chunk or 0), with_grad
    )
    return loss


def reference(
    h: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """What :func:`linear_cross_entropy` computes, as PyTorch's ops compute it (the logits whole)."""
    logits = F.linear(h, weight, bias)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
