"""fused_lm_head: a causal LM's output projection and cross-entropy in one op over chunks of tokens, the logits never held whole.

Speeds up: language models whose vocabulary is large beside their width (GPT-2: 50257 over 768), where
the logits (tokens × vocabulary, in bf16 and again in fp32 for the loss) are a large share of the step's
memory traffic and most of its activation memory. The head's GEMMs run on chunks of tokens, the softmax
and its gradient in place on each chunk, so gigabytes of logits become one chunk's; the memory freed can
buy a larger micro-batch (``micro_batch``, tried with it where it does not pay alone).
Does not help: small vocabularies, short sequences.
Needs: a Hugging Face causal LM trained through its own loss (``model(input_ids, labels=…).loss``, the
library's ``ForCausalLMLoss``, an ``nn.Linear`` head), or a user's ``logits = self.head(x)`` followed by
``F.cross_entropy(logits.view(-1, V), targets.view(-1))``; a ``training_step`` that does not read the
logits, which are None while training with gradients on (as in Liger-Kernel's fused forward).
Numerics: the same function. The loss and its gradient in fp32 from logits in the compute dtype, as
the model's own loss computes them; the head's weight gradient summed in fp32 over the chunks.

Each model is probed before it is touched: its own forward and the fused one run once in training mode
on a few tokens from one random state, and a model whose loss differs (a head that is more than a
Linear, soft-capped or scaled logits, an auxiliary loss) is left alone with the two losses in the
reason (see :mod:`speedkit.rewrite.lm_head`). The model's ``forward`` becomes an instance attribute
(undo removes it); evaluation, a call without labels and ``return_dict=False`` run the model's own.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from torch import nn

from speedkit.rewrite import lm_head
from speedkit.rewrite.lm_head_source import LM_HEAD, decide
from speedkit.rewrite.pipeline import MethodRewrite, RewritePlan, RewriteReport, apply_plan, plan_rewrites
from speedkit.rewrite.source import is_user_function, is_user_module
from speedkit.rungs.base import Handle, RewriteRung, nested, set_attr
from speedkit.training.state import TrainState

NOTHING_FOUND = (
    "no LM head and loss found: no Hugging Face causal LM trained through its own loss (model(input_ids, labels=...).loss), "
    "no logits = self.head(x) followed by F.cross_entropy(logits.view(-1, V), targets.view(-1))"
)


def _reads_logits(function: Callable[..., Any]) -> bool:
    """Whether ``function``'s source reads something named ``logits`` (``out.logits``, ``out["logits"]``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "logits":
            return True
        if isinstance(node, ast.Constant) and node.value == "logits":
            return True
    return False


def logits_readers(state: TrainState) -> list[str]:
    """The user's code around the model that reads the output's logits: the LightningModule's
    ``training_step`` and ``forward``, and the step's loss function, where they are the user's."""
    model = state.model
    candidates: list[tuple[str, Any]] = [
        (f"{type(model).__name__}.training_step", getattr(type(model), "training_step", None)),
        (f"{type(model).__name__}.forward", getattr(type(model), "forward", None)),
        ("the loss function", state.step.loss_fn),
    ]
    readers = []
    for name, function in candidates:
        if function is None or not is_user_function(function):
            continue
        if _reads_logits(function):
            readers.append(name)
    return readers


def plan_fused_lm_head(model: nn.Module) -> RewritePlan:
    """The hand-written heads and losses the rewrite fuses (``plan.rewrites``), the Hugging Face causal
    LMs (``plan.extra``, each probed), and what is left alone."""
    plan = RewritePlan()
    targets = [(m, "forward") for m in model.modules() if is_user_module(m)]
    if callable(getattr(model, "training_step", None)):
        targets.append((model, "training_step"))
    plan.rewrites, plan.left_alone = plan_rewrites(LM_HEAD, targets, decide)
    for rewrite in plan.rewrites:
        plan.counts.update(rewrite.done)
    plan.extra, notes = lm_head.find(model)
    if plan.extra:
        plan.counts["hf_causal_lm"] = len(plan.extra)
    plan.left_alone = list(dict.fromkeys([*plan.left_alone, *notes]))
    return plan


def _describe(rewrite: MethodRewrite) -> str:
    return f"{type(rewrite.module).__name__}.{rewrite.method} rewritten: LM head and cross-entropy fused ×{len(rewrite.done)}"


class FusedLMHeadRung(RewriteRung):
    """Fuses the LM head and cross-entropy of the Hugging Face causal LMs in the model and of
    hand-written ``self.head(x)`` → ``F.cross_entropy`` pairs (see the module doc)."""

    name = "fused_lm_head"
    # the head's GEMMs, the loss over the logits, and the memory they hold
    targets = ("gemm", "loss", "memory")
    recompiles = True  # the model's forward changes: beneath a kept compile its trial compiles anew
    judged_at_full_precision = True  # the same function: its parity is judged without the precision rungs too
    partners = ("micro_batch",)  # the memory it frees pays as a larger micro-batch where the run accumulates

    def make_plan(self, model: nn.Module) -> RewritePlan:
        return plan_fused_lm_head(model)

    def check(self, state: TrainState) -> str | None:
        readers = logits_readers(state)
        if readers:
            return (
                f"{', '.join(readers)} reads the model's logits, which the fused head does not compute "
                "(they are None while training with gradients on)"
            )
        return super().check(state)

    def why_not(self, plan: RewritePlan) -> str | None:
        if plan.counts.total() == 0:
            return NOTHING_FOUND + (f" (left alone: {'; '.join(plan.left_alone)})" if plan.left_alone else "")
        return None

    def apply_plan(self, model: nn.Module, plan: RewritePlan) -> Handle:
        handle, inner = Handle(self.name), Handle(self.name)
        apply_plan(inner, LM_HEAD, plan, _describe)
        try:
            for site in plan.extra or []:
                set_attr(inner, site.model, "forward", lm_head.FusedHeadForward(site.model.forward, site), site.description)
        except Exception:
            inner.undo()
            raise
        nested(handle, inner, f"fused_lm_head: {', '.join(f'{k} ×{n}' for k, n in plan.counts.items())}")
        handle.changes += [c for c in inner.changes if c]
        for note in plan.left_alone:
            handle.record(f"left alone: {note}")
        handle.rewrite = RewriteReport(self.name, dict(plan.counts), tuple(plan.left_alone))
        return handle
