"""batched: many small GEMMs written one by one, run as one (batched) GEMM.

Speeds up: models that launch many small matrix products where one larger one would do: sibling
``nn.Linear`` layers reading the same input (separate q/k/v or gate/up projections, per-head
Linears in a ``ModuleList``), Python loops of per-slice matmuls, ensembles of identical members.
Each small GEMM leaves most of a GPU idle and costs a launch; one GEMM over the whole keeps it busy.
Does not help: models whose GEMMs are already large (a 4096-wide projection is compute-bound;
fusing it saves a launch, no more), or CPU runs bound by arithmetic.
Needs: nothing beyond PyTorch (``torch.func`` for ensembles).
Numerics: unchanged. Each output is the GEMM it was, computed in a larger one (summed in another order
at most).

Nothing is swapped: the rung rewrites the source of each user module's ``forward`` through
:mod:`speedkit.rewrite` and binds the new function to the instance, so parameters, state dicts and
optimizers are untouched; the runtime in :mod:`speedkit.kernels.ops` concatenates/stacks the live
parameters on every call, differentiably. Recognised, statically and conservatively:

1. ``self.A(x)``, ``self.B(x)``, … (same plain name ``x``, no keywords) in the values of statements
   of one block, ``x`` and ``self`` attributes not stored in between → one
   ``ops.fused_linear(x, (self.A, self.B, …))`` before the first, each call replaced by its output.
2. ``[h(x) for h in self.heads]`` → one fused Linear when the list holds Linears of one input
   width, else ``ops.ensemble`` (vmap over stacked weights) when its members are identical.
3. ``for i in range(N):`` with exactly one statement, ``out[i] = a[i] @ b[i]`` (or ``torch.matmul``,
   ``torch.bmm``, an operand shared by all slices, ``self.layers[i](x[i])``) or
   ``outs.append(…)`` → one ``ops.loop_matmul``/``ops.loop_linear``; ``outs = []`` … ``torch.stack(outs)``
   around the loop becomes the batched result itself.

What each instance gets is decided per instance, in the plan ``check`` makes (the Linears must be plain ``nn.Linear`` without
hooks, of one input width, dtype and device; ensemble members identical in structure, parameters
and attributes, with no running statistics or dropout). Everything else, and every near miss
(other loop forms, more statements, a loop variable read afterwards), is left as it was and named
in the report with its reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from speedkit.rewrite.gemms_emit import GEMMS, decide, source_has_candidates
from speedkit.rewrite.pipeline import MethodRewrite, RewritePlan, RewriteReport, apply_plan, plan_rewrites
from speedkit.rewrite.source import NotRewritable, is_user_module
from speedkit.rungs.base import Handle, RewriteRung, nested

NOTHING_FOUND = "no sibling Linears, per-slice GEMM loops or module ensembles found"


@dataclass
class BatchedOptions:
    """Options of the batched rung: which forms it may rewrite."""

    #: sibling Linears on one input, and ModuleLists of Linears (``fused_linear``)
    linears: bool = True
    #: ``for i in range(N)`` loops of per-slice matmuls / Linears (``loop_matmul``, ``loop_linear``)
    loops: bool = True
    #: ensembles of identical modules applied to one input (``ensemble``, vmap)
    ensembles: bool = True


def _refused(module: nn.Module, method: str, exc: NotRewritable) -> str | None:
    """A forward speedkit cannot rewrite is named only where its source would have offered something."""
    return f"{type(module).__name__}: {exc}" if source_has_candidates(type(module)) else None


def plan_batched(model: nn.Module, options: BatchedOptions) -> RewritePlan:
    """Which instances get which rewrites, and what is left alone (cheap: the parsing is cached per class)."""
    targets = ((m, "forward") for m in model.modules() if is_user_module(m))
    rewrites, left_alone = plan_rewrites(
        GEMMS,
        targets,
        lambda m, parsed, found: decide(m, parsed, found, options.linears, options.loops, options.ensembles),
        _refused,
    )
    plan = RewritePlan(rewrites=rewrites, left_alone=left_alone)
    plan.counts["rewritten"] = sum(len(r.done) for r in rewrites)
    plan.counts["found"] = plan.counts["rewritten"] + len(left_alone)
    return plan


def _describe(rewrite: MethodRewrite) -> str:
    return f"{type(rewrite.module).__name__}.forward rewritten: {'; '.join(rewrite.done)}"


def apply_batched(model: nn.Module, options: BatchedOptions, plan: RewritePlan | None = None) -> Handle:
    """Bind the rewritten forwards; ``handle.undo()`` puts them back."""
    plan = plan if plan is not None else plan_batched(model, options)
    handle, bound = Handle("batched"), Handle("batched")
    apply_plan(bound, GEMMS, plan, _describe)
    per_class: dict[str, Counter[str]] = {}
    for rewrite in plan.rewrites:
        per_class.setdefault(type(rewrite.module).__name__, Counter()).update(rewrite.done)
    summary = "; ".join(
        f"{cls}: " + ", ".join(f"{what} ×{count}" for what, count in counts.items()) for cls, counts in per_class.items()
    )
    rewritten = plan.counts["rewritten"]
    nested(handle, bound, f"batched: rewrote {rewritten} sites in {len(plan.rewrites)} modules ({summary or 'none'})")
    for note in plan.left_alone:
        handle.record(f"left alone: {note}")
    handle.rewrite = RewriteReport(
        "batched",
        {"found": plan.counts["found"], "rewritten": rewritten, "modules": len(plan.rewrites)},
        tuple(plan.left_alone),
        rewrites=tuple(f"{type(r.module).__name__}: {d}" for r in plan.rewrites for d in r.done),
    )
    return handle


class BatchedRung(RewriteRung):
    """Rewrites sibling Linears, ModuleList heads/ensembles and per-slice GEMM loops into batched calls.

    ``check`` makes the plan (the analysis is cached per class) and says why nothing applies; ``apply``
    binds the rewritten forwards of that plan (made again only if the model changed since) and returns a
    handle whose ``rewrite`` report holds found/rewritten/left-alone.
    """

    name = "batched"
    # many small GEMMs as one larger one: the GEMMs' time and the host's launches of each
    targets = ("gemm", "host")
    Options = BatchedOptions

    def make_plan(self, model: nn.Module) -> RewritePlan:
        return plan_batched(model, self.options)

    def why_not(self, plan: RewritePlan) -> str | None:
        if plan.counts["found"] == 0:
            return NOTHING_FOUND
        if plan.counts["rewritten"] == 0:
            return f"found {plan.counts['found']} candidate site(s), none rewritable: {'; '.join(plan.left_alone)}"
        return None

    def apply_plan(self, model: nn.Module, plan: RewritePlan) -> Handle:
        return apply_batched(model, self.options, plan)
