"""sdpa: replace hand-written attention with ``F.scaled_dot_product_attention``.

Speeds up: models that compute attention by hand (``softmax(q @ kᵀ * scale + mask) @ v``), which
materialize the (B, H, T, T) score matrix several times per layer. SDPA runs flash or
memory-efficient kernels that never store it: less memory traffic, less memory, and — with a
causal mask recognised as such — half the work.
Does not help: models already on SDPA / ``nn.MultiheadAttention``; very short sequences.
Needs: nothing beyond PyTorch (flash kernels need a recent GPU and fp16/bf16; SDPA picks).
Numerics: the same function; attention dropout draws other masks. The kernel SDPA picks (flash,
memory-efficient) orders the softmax's reductions its own way. With ``float_masks="fused"``, a query
row whose keys an additive mask all sets to a huge finite negative (left padding under a causal mask)
differs, as in Hugging Face's own SDPA attention; ``"exact"`` runs such attention on SDPA's math
backend, as written, without the speed-up.

The libraries' own switches come first: a Hugging Face model's ``attn_implementation`` ``"eager"``
becomes ``"sdpa"`` through ``set_attn_implementation`` (``hf_implementation``), timm's ``fused_attn``
is set (``libraries``; :mod:`speedkit.rewrite.library_switches`); the source rewrite below takes the
hand-written attention that is left.

Detection works on the computation, not on names: in every user module's ``forward`` source,
a statement computing ``q @ kᵀ`` (``@``, ``torch.matmul``, ``torch.bmm``, or a canonical
``einsum``), optionally scaled (multiply or divide, inline or in later statements), then masked
(``masked_fill(M, -inf)`` and/or ``+ mask``, possibly under an ``if``), then ``softmax`` over the
last dim (also in fp32 and cast back), optionally dropped out, then multiplied by ``v``. Each step
is recorded where the user's statement stood (so evaluation order is unchanged) and the final
``@ v`` becomes one :func:`speedkit.kernels.ops.attention` call. A mask that is exactly a causal buffer
sliced to a square (checked on the buffer's values at apply time) becomes ``is_causal=True``.

Left alone, with the reason in the report: weights used between the steps, pre-softmax scores
used afterwards, weights returned or stored while attention dropout is on (they could not match),
a softmax over another dim, a mask fill value other than -inf, a scale after an additive mask.
Weights returned or stored *without* dropout stay exact: they are computed on demand only where
the code reads them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from torch import nn

from speedkit.rewrite.attention_emit import ATTENTION, decide
from speedkit.rewrite.library_switches import SwitchPlan, apply_switches, plan_switches
from speedkit.rewrite.pipeline import MethodRewrite, RewritePlan, RewriteReport, apply_plan, plan_rewrites
from speedkit.rewrite.source import is_user_module
from speedkit.rungs.base import Handle, RewriteRung, nested


@dataclass
class SdpaOptions:
    """Options of the sdpa rung."""

    #: "fused": additive float masks go to SDPA's fused kernels (fast). A query row whose every key
    #: is masked by a huge finite negative (left padding under a causal mask) then differs from the
    #: hand-written code: its gradient on CPU, its output too on CUDA — as with Hugging Face's own
    #: SDPA attention; everywhere else, and for any loss that ignores padded positions, the
    #: function is the same. "exact": such attention runs on SDPA's math backend, the hand-written
    #: function everywhere, without the speed-up. Causal and boolean masks are always fused.
    float_masks: Literal["fused", "exact"] = "fused"
    #: flip the model libraries' own switches (Hugging Face attn_implementation, timm fused_attn)
    libraries: bool = True
    #: the Hugging Face attention implementation switched to ("flash_attention_2" needs flash-attn)
    hf_implementation: Literal["sdpa", "flash_attention_2", "flex_attention"] = "sdpa"


def plan_sdpa(model: nn.Module, options: SdpaOptions) -> RewritePlan:
    """Which instances get which attention sites rewritten (with their causal decision), and what is
    left alone; the libraries' switches (``plan.extra``) come first, and the modules they move to
    SDPA are not rewritten."""
    switches = plan_switches(model, options.hf_implementation) if options.libraries else SwitchPlan()
    switched = {id(m) for m in [*switches.timm, *switches.timm_fused]}
    targets = ((m, "forward") for m in model.modules() if is_user_module(m) and id(m) not in switched)
    exact = options.float_masks == "exact"
    rewrites, left_alone = plan_rewrites(ATTENTION, targets, lambda m, parsed, found: decide(m, parsed, found, exact))
    return RewritePlan(rewrites=rewrites, left_alone=left_alone, extra=switches)


def _describe(rewrite: MethodRewrite) -> str:
    causal = rewrite.done.count("causal")
    return f"{type(rewrite.module).__name__}.forward: {len(rewrite.done)} attention site(s) -> scaled_dot_product_attention" + (
        f" (is_causal=True: {causal})" if causal else ""
    )


def apply_sdpa(model: nn.Module, options: SdpaOptions, plan: RewritePlan | None = None) -> Handle:
    """Flip the libraries' switches and bind the rewritten forwards; ``handle.undo()`` puts them back."""
    plan = plan if plan is not None else plan_sdpa(model, options)
    switches: SwitchPlan = plan.extra
    handle, bound = Handle("sdpa"), Handle("sdpa")
    apply_switches(handle, switches, options.hf_implementation)
    # a kernel draws attention dropout from its own random stream: parity is judged with dropout off
    handle.draws_differently = bool(switches)
    switched = list(handle.changes)
    apply_plan(bound, ATTENTION, plan, _describe)
    nested(handle, bound, "")
    per_class: dict[str, Counter[str]] = {}
    for rewrite in plan.rewrites:
        per_class.setdefault(type(rewrite.module).__name__, Counter()).update(rewrite.done)
    sites = sum(c.total() for c in per_class.values())
    summary = ", ".join(
        f"{name} x{c.total()}" + (f" ({c['causal']} causal)" if c["causal"] else "") for name, c in per_class.items()
    )
    # the per-instance lines say the same thing many times over: keep one summary line
    handle.changes = switched + (
        [f"sdpa: rewrote {sites} attention site(s) in {len(plan.rewrites)} module(s): {summary}"] if plan.rewrites else []
    )
    handle.changes += [f"left alone: {note}" for note in [*switches.left_alone, *plan.left_alone]]
    handle.rewrite = RewriteReport("sdpa", {"rewritten": sites, "modules": len(plan.rewrites)}, tuple(plan.left_alone))
    return handle


class SdpaRung(RewriteRung):
    """Rewrites hand-written attention to SDPA (and flips the model libraries' own switches to it).

    ``check`` makes the plan and says why nothing applies; ``apply`` applies that plan (made again
    only if the model changed since) and returns a handle whose ``rewrite`` report counts the sites."""

    name = "sdpa"
    # hand-written attention shows in a profile as batched GEMMs (q @ kᵀ, @ v) and softmax/masking/dropout
    # (elementwise), not as attention kernels, which only SDPA's own are; no (B, H, T, T) scores kept
    targets = ("attention", "gemm", "elementwise", "memory")
    Options = SdpaOptions

    def make_plan(self, model: nn.Module) -> RewritePlan:
        return plan_sdpa(model, self.options)

    def why_not(self, plan: RewritePlan) -> str | None:
        switches: SwitchPlan = plan.extra
        if plan.rewrites or switches:
            return None
        if plan.left_alone:
            return "hand-written attention found but none could be rewritten exactly: " + "; ".join(plan.left_alone[:3])
        return "no hand-written attention (q @ kᵀ → softmax → @ v) found in the model's forward methods" + "".join(
            f"; {note}" for note in switches.left_alone
        )

    def apply_plan(self, model: nn.Module, plan: RewritePlan) -> Handle:
        return apply_sdpa(model, self.options, plan)


__all__ = ["SdpaOptions", "SdpaRung", "apply_sdpa", "plan_sdpa"]
