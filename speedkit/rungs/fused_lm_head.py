"""fused_lm_head: a causal LM's output projection and cross-entropy in one op over chunks of tokens, the logits never held whole.

Speeds up: language models whose vocabulary is large beside their width (GPT-2: 50257 over 768), where
the LM head's logits (tokens × vocabulary, in bf16 and again in fp32 for the loss) are a large share
of the step's memory traffic and most of its activation memory. The head's three GEMMs run on chunks
of tokens, the softmax and its gradient in place on each chunk (speedkit's fused cross-entropy kernel on
CUDA), so what was gigabytes of logits is one chunk's; the memory freed can buy a larger micro-batch
(``micro_batch``, tried with it where it does not pay alone).
Does not help: small vocabularies, short sequences, models whose step reads the logits themselves.
Needs: a Hugging Face causal LM trained through its own loss (``model(input_ids, labels=…).loss``; its
``loss_function`` the library's ``ForCausalLMLoss``, its output embeddings an ``nn.Linear``), and a
``training_step`` (or loss function) that does not read the output's ``logits``, which it returns as
None while training on labels, as Liger-Kernel's fused forward does.
Numerics: the same function; the loss and its gradient in fp32 from the head's logits in the
compute dtype, as the model's own loss computes them, and the head's weight gradient summed in fp32 over the
chunks (bf16 autocast sums it in one bf16 GEMM): equal to fp32 rounding without autocast, to bf16's with it.

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

from speedkit.rewrite import lm_head
from speedkit.rewrite.source import is_user_function
from speedkit.rungs.base import Handle, Rung, set_attr
from speedkit.training.state import TrainState

NOTHING_FOUND = "no Hugging Face causal LM trained through its own loss (model(input_ids, labels=...).loss) found"


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
        ("the loss function", getattr(state.step, "loss_fn", None)),
    ]
    readers = []
    for name, function in candidates:
        if function is None or not is_user_function(function):
            continue
        if _reads_logits(function):
            readers.append(name)
    return readers


class FusedLMHeadRung(Rung):
    """Fuses the LM head and cross-entropy of the Hugging Face causal LMs in the model (see the module doc)."""

    name = "fused_lm_head"
    # the head's GEMMs, the loss over the logits, and the memory they hold
    targets = ("gemm", "loss", "memory")
    recompiles = True  # the model's forward changes: beneath a kept compile its trial compiles anew
    judged_at_full_precision = True  # the same function: its parity is judged without the precision rungs too
    partners = ("micro_batch",)  # the memory it frees pays as a larger micro-batch where the run accumulates

    def check(self, state: TrainState) -> str | None:
        readers = logits_readers(state)
        if readers:
            return (
                f"{', '.join(readers)} reads the model's logits, which the fused head does not compute "
                "(it returns logits=None while training on labels)"
            )
        sites, left_alone = lm_head.find(state.model)
        if not sites:
            return NOTHING_FOUND + (f" (left alone: {'; '.join(left_alone)})" if left_alone else "")
        return None

    def apply(self, state: TrainState) -> Handle:
        sites, left_alone = lm_head.find(state.model)
        handle = Handle(self.name)
        for site in sites:
            set_attr(handle, site.model, "forward", lm_head.FusedHeadForward(site.model.forward, site), site.description)
        for note in left_alone:
            handle.record(f"left alone: {note}")
        return handle
