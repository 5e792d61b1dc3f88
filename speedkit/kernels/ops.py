"""Runtime of rewritten forwards: the functions that code rewritten by speedkit rungs calls.

Every function here computes exactly what the user's original code computed; where a fast path
does not apply to the tensors it is given at run time, it falls back to replaying the original
operations in their original order. They are plain PyTorch, so ``torch.compile`` traces them.

Attention (``sdpa`` rung). The rewritten code records the hand-written attention as a *pattern*,
an ordered list of steps evaluated where the user's statements stood:

    ("mm", q, kT) | ("einsum", eq, q, k)        the scores: q @ kT, or einsum(eq, q, k)
    ("mul", c) | ("div", c)                     scale
    ("fill", M) | ("add", A)                    masked_fill(M, -inf) | + A
    ("float",) | ("softmax", dtype)             upcast | softmax over the last dim
    ("to", arg) | ("type_as", t)                cast back
    ("dropout", p) | ("dropout_module", m)      F.dropout(p) (p already 0 when not training) | nn.Dropout m

and :func:`attention` turns it into one ``scaled_dot_product_attention`` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speedkit import compat

Pattern = list[tuple[Any, ...]]


# -- attention --------------------------------------------------------------------------------


class Deferred:
    """Attention weights that were never materialized; :func:`materialize` computes them on demand."""

    __slots__ = ("pattern",)

    def __init__(self, pattern: Pattern) -> None:
        self.pattern = pattern


def materialize(value: Any) -> Any:
    """The attention weights the original code would hold here (``value`` itself if not deferred)."""
    if isinstance(value, Deferred):
        return replay(value.pattern)
    return value


def replay(pattern: Pattern) -> Tensor:
    """The original computation of the attention weights, op by op, in the original order."""
    head = pattern[0]
    s = head[1] @ head[2] if head[0] == "mm" else torch.einsum(head[1], head[2], head[3])
    for op in pattern[1:]:
        kind = op[0]
        if kind == "mul":
            s = s * op[1]
        elif kind == "div":
            s = s / op[1]
        elif kind == "fill":
            s = s.masked_fill(op[1], float("-inf"))
        elif kind == "add":
            s = s + op[1]
        elif kind == "float":
            s = s.float()
        elif kind == "softmax":
            s = F.softmax(s, dim=-1, dtype=op[1])
        elif kind == "to":
            s = s.to(op[1])
        elif kind == "type_as":
            s = s.type_as(op[1])
        elif kind == "dropout":
            s = F.dropout(s, p=op[1], training=op[1] > 0)
        elif kind == "dropout_module":
            s = op[1](s)
        else:  # pragma: no cover - the rewriter only emits the kinds above
            raise ValueError(f"unknown attention step {kind!r}")
    return s


def _finish(probs: Tensor, v: Tensor, final_eq: str | None) -> Tensor:
    return probs @ v if final_eq is None else torch.einsum(final_eq, probs, v)


def attention(
    pattern: Pattern, v: Tensor, *, final_eq: str | None = None, is_causal: bool = False, exact_float_masks: bool = False
) -> Tensor:
    """``softmax(scale * q kᵀ + mask) @ v`` as one ``F.scaled_dot_product_attention`` call.

    ``is_causal`` is set by the rewriter only where the sole mask is a verified causal buffer
    sliced to a square; the mask step is then left out of the pattern.

    With an additive float mask, a query row whose every key carries a huge negative value (e.g.
    ``finfo.min`` on a left-padded row under a causal mask) is where fused kernels and the
    hand-written softmax part: both give uniform weights, but the fused kernels' log-sum-exp
    backward scales that row's gradient. ``exact_float_masks`` runs such attention on SDPA's math
    backend, which matches the hand-written code there too (at the hand-written code's speed).
    """
    head = pattern[0]
    q = head[1] if head[0] == "mm" else head[2]
    k = head[2].mT if head[0] == "mm" else head[3]
    if (
        not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor))
        or q.dim() < 3
        or not (q.dtype == k.dtype == v.dtype)
        or q.shape[:-2] != v.shape[:-2]
    ):
        return _finish(replay(pattern), v, final_eq)
    scale: Any = 1.0
    adds: list[Tensor] = []
    fills: list[Tensor] = []
    dropout_p = 0.0
    for op in pattern[1:]:
        kind = op[0]
        if kind == "mul":
            scale = scale * op[1]
        elif kind == "div":
            scale = scale / op[1]
        elif kind == "fill":
            fills.append(op[1])
        elif kind == "add":
            adds.append(op[1])
        elif kind == "dropout":
            dropout_p = op[1]
        elif kind == "dropout_module":
            dropout_p = op[1].p if op[1].training else 0.0
        # "float", "softmax", "to", "type_as": SDPA accumulates the softmax in fp32 and returns q's dtype
    if isinstance(scale, Tensor):
        q, scale = q * scale.to(q.dtype), 1.0
    if is_causal:  # the rewriter verified the fills are exactly the causal buffer, sliced square
        fills = []
    mask: Tensor | None = None
    if adds:
        mask = adds[0]
        for a in adds[1:]:
            mask = mask + a
        for m in fills:
            mask = torch.where(m, float("-inf"), mask)
        mask = mask.to(q.dtype)
    elif fills:
        keep = ~fills[0]
        for m in fills[1:]:
            keep = keep & ~m
        mask = keep
    # the rewriter emits final_eq only for the canonical '...ij,...jd->...id': SDPA's own contraction
    if exact_float_masks and adds:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=float(dropout_p), scale=float(scale))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=float(dropout_p), is_causal=is_causal and mask is None, scale=float(scale)
    )


# -- batched ops ----------------------------------------------------------------------------------
#
# Each function is checked at run time too: a Linear that gained a hook, a list of tensors of
# different shapes, a 1-D slice (where matmul of a stack means something else) all take the
# original loop, so a rewrite decided at apply time can never change what the code computes.


def _same_linears(linears: Sequence[Any], same_out: bool) -> bool:
    """Plain ``nn.Linear`` modules, no hooks, one in_features/dtype/device, all with a bias or none."""
    first = linears[0]
    if type(first) is not nn.Linear:
        return False
    for lin in linears:
        if (
            type(lin) is not nn.Linear
            or compat.has_hooks(lin)
            or lin.in_features != first.in_features
            or (same_out and lin.out_features != first.out_features)
            or lin.weight.dtype != first.weight.dtype
            or lin.weight.device != first.weight.device
            or (lin.bias is None) != (first.bias is None)
        ):
            return False
    return True


def fused_linear(x: Tensor, linears: Sequence[nn.Linear]) -> tuple[Tensor, ...]:
    """``tuple(l(x) for l in linears)`` as one GEMM over the concatenated weights, split after.

    The weights are concatenated on every call (differentiably), so gradients reach each Linear's
    own parameters and nothing about the user's layout changes. The outputs are views of one
    tensor (``split``): modifying one in place under autograd raises, so the rewriter leaves
    alone sites whose results it sees modified in place.
    """
    linears = tuple(linears)
    if not isinstance(x, Tensor) or not _same_linears(linears, same_out=False):
        return tuple(lin(x) for lin in linears)
    weight = torch.cat([lin.weight for lin in linears], dim=0)  # (sum out, in)
    bias = torch.cat([lin.bias for lin in linears], dim=0) if linears[0].bias is not None else None
    return F.linear(x, weight, bias).split([lin.out_features for lin in linears], dim=-1)


def _loop_results(outs: list[Any]) -> Tensor | list[Any]:
    """The per-slice results of a replayed loop: stacked when they stack, else the list itself.

    A list (ragged slices, or no slice at all) is what :func:`unstack` and :func:`store_slices`
    take as it is, and what :func:`stack` hands to ``torch.stack`` to fail as the user's code would.
    """
    if outs and all(isinstance(o, Tensor) for o in outs) and len({(o.shape, o.dtype, o.device) for o in outs}) == 1:
        return torch.stack(outs)
    return outs


def unstack(value: Tensor | list[Any]) -> Sequence[Any]:
    """The slices of a batched result, for ``outs.extend(...)``."""
    return value.unbind(0) if isinstance(value, Tensor) else value


def stack(value: Tensor | list[Any]) -> Tensor:
    """A batched result where the user's code had ``torch.stack(outs)`` after the loop."""
    return value if isinstance(value, Tensor) else torch.stack(value)


def _batch_operand(t: Any, n: int, indexed: bool) -> Tensor | None:
    """``t`` with the loop's dim in front (n slices, or one shared), or None where stacking changes matmul."""
    if indexed:
        if isinstance(t, (list, tuple)):
            items = t[:n]
            if (
                len(items) < n
                or not all(isinstance(s, Tensor) for s in items)
                or len({(s.shape, s.dtype, s.device) for s in items}) != 1
            ):
                return None
            t = torch.stack(list(items))
        if not isinstance(t, Tensor) or t.dim() < 3 or t.shape[0] < n:  # 1-D slices: matmul is a dot/mv
            return None
        return t if t.shape[0] == n else t[:n]
    if not isinstance(t, Tensor) or t.dim() < 2:
        return None
    return t


def loop_matmul(a: Any, b: Any, n: int, a_indexed: bool, b_indexed: bool) -> Tensor | list[Any]:
    """``torch.stack([a[i] @ b[i] for i in range(n)])`` (an operand not indexed is shared) as one matmul.

    Per slice, ``a_i (*ba, m, k) @ b_i (*bb, k, p)`` broadcasts ``ba`` against ``bb`` from the right;
    stacked, the loop's dim goes in front of both and the shorter batch is padded with 1s after it,
    so the same dims meet. A shared 2-D operand needs no loop dim (matmul folds it into one GEMM).
    """
    a2 = _batch_operand(a, n, a_indexed) if n > 0 else None
    b2 = _batch_operand(b, n, b_indexed) if n > 0 else None
    if a2 is None or b2 is None:  # do what the loop did
        return _loop_results([(a[i] if a_indexed else a) @ (b[i] if b_indexed else b) for i in range(n)])
    # a shared operand with batch dims gets a loop dim of 1 to broadcast over
    if not a_indexed and a2.dim() > 2:
        a2 = a2.unsqueeze(0)
    if not b_indexed and b2.dim() > 2:
        b2 = b2.unsqueeze(0)
    if a2.dim() > 2 and b2.dim() > 2 and a2.dim() != b2.dim():
        rank = max(a2.dim(), b2.dim())
        a2 = a2.reshape(a2.shape[0], *([1] * (rank - a2.dim())), *a2.shape[1:])
        b2 = b2.reshape(b2.shape[0], *([1] * (rank - b2.dim())), *b2.shape[1:])
    return torch.matmul(a2, b2)


def loop_linear(linears: Sequence[nn.Linear], x: Any, n: int, x_indexed: bool) -> Tensor | list[Any]:
    """``torch.stack([linears[i](x[i] if x_indexed else x) for i in range(n)])`` as one batched GEMM.

    The slices are flattened to ``(n, M, in)`` (a shared x is expanded, not copied) and multiplied
    by the stacked, transposed weights ``(n, in, out)`` with the biases added in the same call.
    """

    def loop() -> Tensor | list[Any]:
        return _loop_results([linears[i](x[i] if x_indexed else x) for i in range(n)])

    if n <= 0 or len(linears) < n or not isinstance(x, Tensor):
        return loop()
    mods = [linears[i] for i in range(n)]
    if (
        not _same_linears(mods, same_out=True)
        or x.dim() < (2 if x_indexed else 1)
        or (x_indexed and x.shape[0] < n)
        or x.shape[-1] != mods[0].in_features
    ):
        return loop()
    d_in, d_out = mods[0].in_features, mods[0].out_features
    weight = torch.stack([m.weight for m in mods]).transpose(1, 2)  # (n, in, out)
    if x_indexed:
        xs = x if x.shape[0] == n else x[:n]
        lead = xs.shape[1:-1]
        x3 = xs.reshape(n, _numel(lead), d_in)  # (n, M, in)
    else:
        lead = x.shape[:-1]
        x3 = x.reshape(1, _numel(lead), d_in).expand(n, -1, -1)  # (n, M, in), stride 0 over n
    if mods[0].bias is not None:
        bias = torch.stack([m.bias for m in mods]).unsqueeze(1)  # (n, 1, out)
        y = torch.baddbmm(bias, x3, weight)
    else:
        y = torch.bmm(x3, weight)
    return y.reshape(n, *lead, d_out)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def store_slices(target: Any, n: int, value: Tensor | list[Any]) -> None:
    """``for i in range(n): target[i] = value[i]``, as one slice assignment where that is the same."""
    if n <= 0:
        return
    if (
        isinstance(target, Tensor)
        and isinstance(value, Tensor)
        and value.dim() == target.dim()
        and value.shape[0] == n
        and target.shape[0] >= n
    ):
        target[:n] = value
        return
    for i in range(n):
        target[i] = value[i]


def _identical_members(modules: Sequence[nn.Module]) -> bool:
    base = modules[0]
    for m in modules:
        if type(m) is not type(base) or m.training != base.training or compat.has_hooks(m):
            return False
    return True


def ensemble(modules: Sequence[nn.Module], *args: Any) -> list[Any]:
    """``[m(*args) for m in modules]`` for identical modules, as one vmapped call over stacked weights.

    Parameters are stacked on every call (differentiably), so gradients reach each member's own
    parameters. Falls back to the loop if vmap cannot run the members' forward (random ops
    included: vmap's randomness="error" refuses them rather than draw different numbers).
    """
    from torch.func import functional_call, vmap

    modules = list(modules)
    if len(modules) < 2 or not _identical_members(modules):
        return [m(*args) for m in modules]
    base = modules[0]
    try:
        members = [dict(m.named_parameters()) for m in modules]
        mbuffers = [dict(m.named_buffers()) for m in modules]
        params = {n: torch.stack([p[n] for p in members]) for n in members[0]}
        buffers = {n: torch.stack([b[n] for b in mbuffers]) for n in mbuffers[0]}

        def call(p: dict[str, Tensor], b: dict[str, Tensor], *a: Any) -> Any:
            return functional_call(base, {**p, **b}, a)

        out = vmap(call, in_dims=(0, 0, *([None] * len(args))), randomness="error")(params, buffers, *args)
    except Exception:  # members that differ, or a forward vmap cannot run: the loop it was
        return [m(*args) for m in modules]
    if isinstance(out, Tensor):
        return list(out.unbind(0))
    return [compat.tree_map(lambda t, i=i: t[i], out) for i in range(len(modules))]


# -- fused layers (the triton_layers rung) ------------------------------------------------------
# Entry points for rewritten code; checks and fallbacks live in speedkit.kernels.layers, imported on first
# call (it imports Triton).


def cross_entropy(input: Any, target: Any, **kwargs: Any) -> Tensor:
    """``F.cross_entropy(input.float() if upcast else input, target, …)``, fused where it applies."""
    from speedkit.kernels import layers

    return layers.cross_entropy(input, target, **kwargs)


def linear_gelu(linear: nn.Module, act: nn.Module | None, x: Any, approximate: str = "none") -> Tensor:
    """``act(linear(x))`` / ``F.gelu(linear(x), approximate=…)`` with the bias added in the GELU kernel."""
    from speedkit.kernels import layers

    return layers.linear_gelu(linear, act, x, approximate)


def gelu_mlp(proj: nn.Module, act: nn.Module | None, fc: nn.Module, x: Any, approximate: str = "none") -> Tensor:
    """``proj(act(fc(x)))`` / ``proj(F.gelu(fc(x), approximate=…))``, the tanh-GELU in cuBLASLt's epilogues."""
    from speedkit.kernels import layers

    return layers.gelu_mlp(proj, act, fc, x, approximate)


def silu_mul(gate: Any, up: Any, act: nn.Module | None = None) -> Tensor:
    """``F.silu(gate) * up`` (or ``act(gate) * up`` for an ``nn.SiLU``) in one kernel."""
    from speedkit.kernels import layers

    return layers.silu_mul(gate, up, act)


def gelu_mul(gate: Any, up: Any, act: nn.Module | None = None, approximate: str = "none") -> Tensor:
    """``F.gelu(gate, approximate=…) * up`` (or ``act(gate) * up`` for an ``nn.GELU``) in one kernel."""
    from speedkit.kernels import layers

    return layers.gelu_mul(gate, up, act, approximate)


def rotary_pos_emb(fn: Any, q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(q, k, cos, sin, …)`` (a rotate-half rotary function) with both rotations in one kernel each."""
    from speedkit.kernels import layers

    return layers.rotary_pos_emb(fn, q, k, cos, sin, *args, **kwargs)


# -- the LM head and its loss (the fused_lm_head rung) ------------------------------------------


def lm_head_input(head: nn.Module, x: Any) -> tuple[Any, Any]:
    """``(x, None)`` where the head and its loss will run fused (the head training, gradients on), else
    ``(None, head(x))``: the logits as written."""
    if head.training and torch.is_grad_enabled() and isinstance(x, Tensor):
        return x, None
    return None, head(x)


def lm_head_loss(
    hidden: Tensor,
    head: nn.Linear,
    target: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy(head(hidden).view(-1, V).float(), target.view(-1), …)`` without the logits."""
    from speedkit.kernels.linear_cross_entropy import linear_cross_entropy

    width = hidden.shape[-1]
    if hidden.numel() // width != target.numel():
        raise ValueError(
            f"speedkit fused_lm_head: {target.numel()} targets for {hidden.numel() // width} tokens of hidden states "
            f"{tuple(hidden.shape)}; the cross-entropy as written would have failed too"
        )
    return linear_cross_entropy(
        hidden.reshape(-1, width),
        head.weight,
        target.reshape(-1),
        head.bias,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
