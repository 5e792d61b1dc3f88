"""The loss Hugging Face models compute themselves (``model(input_ids, labels=labels).loss``),
through speedkit's fused cross-entropy kernel.

transformers' causal-LM models (and some masked-LM ones) compute their loss in ``forward`` by
``self.loss_function(logits, labels, vocab_size=…, **kwargs)``, which resolves to
``ForCausalLMLoss`` (labels shifted left by one with ``ignore_index`` appended, or ``shift_labels``
as given) or ``ForMaskedLMLoss`` (no shift). Both upcast the logits to fp32 (a whole copy of them),
then take the mean over the labels that are not ``ignore_index``, or the sum divided by
``num_items_in_batch`` when it is given; other keyword arguments are ignored.

:class:`FusedLMLoss` computes the same through :func:`speedkit.kernels.layers.cross_entropy`, the upcast
done inside the kernel. It is set on one model instance through transformers' own seam (the setter
behind ``model.loss_function = fn``; undo removes it again, and the property resolves the loss
as before). It is first checked against the installed transformers' function on a tiny input, so a
release that changes what that function computes leaves the model alone.

Left alone, with the reason: models whose ``forward`` does not call ``self.loss_function``
(transformers 5.x ``BertForMaskedLM`` builds an ``nn.CrossEntropyLoss`` inside it), other losses
(classification, a loss function the user set), and releases without the per-instance setter.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speedkit import compat
from speedkit.handle import Handle, set_attr
from speedkit.kernels import layers
from speedkit.rewrite import lm_head


class FusedLMLoss:
    """transformers' ``ForCausalLMLoss`` (``shift=True``) or ``ForMaskedLMLoss`` (``shift=False``),
    same signature and result, through the fused cross-entropy; ``original`` is the function it
    stands in for."""

    def __init__(self, original: Callable[..., Tensor], shift: bool) -> None:
        self.original, self.shift = original, shift

    def __call__(
        self,
        logits: Tensor,
        labels: Tensor,
        vocab_size: int,
        num_items_in_batch: Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        target = labels
        if self.shift:
            target = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        # contiguous: the kernel reads the targets as one dense row of indices
        target = target.reshape(-1).to(logits.device).contiguous()
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = layers.cross_entropy(
            logits.reshape(-1, vocab_size), target, upcast=True, reduction=reduction, ignore_index=ignore_index
        )
        if num_items_in_batch is None:
            return loss
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch

    def __repr__(self) -> str:
        return f"FusedLMLoss({self.original.__name__})"


@dataclass
class LossSite:
    """A model whose ``loss_function`` becomes ``loss``; ``description`` is its report line."""

    model: nn.Module
    loss: FusedLMLoss
    description: str


def _lm_losses() -> dict[Callable[..., Tensor], bool]:
    """transformers' LM cross-entropy loss functions, each with whether it shifts the labels."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss
    except ImportError:  # transformers before 4.46 had no loss functions
        return {}
    return {ForCausalLMLoss: True, ForMaskedLMLoss: False}


@functools.cache
def _differs(original: Callable[..., Tensor], shift: bool) -> str | None:
    """Why :class:`FusedLMLoss` does not compute what ``original`` does on a tiny input, or None.

    float64 logits: both run PyTorch's cross-entropy on the same fp32 upcast, so only the
    semantics (shift, ignore_index, reduction) can differ, and they must agree exactly."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 5), generator=gen)
    labels[0, 1] = labels[1, 3] = -100
    cases: list[tuple[Tensor, dict[str, Any]]] = [
        (labels, {}),
        (labels, {"num_items_in_batch": torch.tensor(6)}),
        (labels, {"num_items_in_batch": 4}),
        (labels.clamp_min(0), {"ignore_index": 3}),
    ]
    if shift:
        cases.append((labels, {"shift_labels": labels.flip(-1)}))
    fused = FusedLMLoss(original, shift)
    for target, kwargs in cases:
        try:
            expected = original(logits=logits, labels=target, vocab_size=7, **kwargs)
        except Exception as exc:  # its signature moved: the replacement's would not match
            return f"{original.__name__} does not take the arguments speedkit passes ({type(exc).__name__}: {exc})"
        if not torch.equal(fused(logits=logits, labels=target, vocab_size=7, **kwargs), expected):
            return (
                f"{original.__name__} of this transformers computes something else than speedkit's version "
                f"(with {', '.join(kwargs) or 'defaults'})"
            )
    return None


@functools.cache
def _forward_skips_loss_function(cls: type) -> str | None:
    """Why ``cls.forward`` is not known to compute its loss by ``self.loss_function``, or None."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return "the source of its forward is not available"
    return None if "self.loss_function" in source else "its forward computes the loss without self.loss_function"


def _takes_labels(model: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def find(root: nn.Module) -> tuple[list[LossSite], list[str]]:
    """The Hugging Face models in ``root`` (taking ``labels=``) whose loss :class:`FusedLMLoss`
    computes, and why the others are left alone."""
    transformers = sys.modules.get("transformers")  # a model of it means it was imported
    if transformers is None:
        return [], []
    lm_losses = _lm_losses()
    sites, left_alone = [], []
    for path, module in root.named_modules():
        if not isinstance(module, transformers.PreTrainedModel) or not _takes_labels(module):
            continue
        name = type(module).__name__ + (f" (self.{path})" if path else "")
        if not compat.hf_loss_function_settable(module):
            left_alone.append(f"{name}: transformers {transformers.__version__} has no per-model loss_function to set")
            continue
        if lm_head.fused(module):
            continue  # fused_lm_head computes its loss (speedkit.rewrite.lm_head)
        current = module.loss_function
        if isinstance(current, FusedLMLoss):
            continue  # already swapped
        shift = lm_losses.get(current)
        if shift is None:
            reason = (
                f"its loss_function is {getattr(current, '__name__', repr(current))}, not a causal- or masked-LM cross-entropy"
            )
        else:
            reason = _forward_skips_loss_function(type(module)) or _differs(current, shift)
        if reason:
            left_alone.append(f"{name}: {reason}")
            continue
        sites.append(
            LossSite(
                module,
                FusedLMLoss(current, shift),
                f"{name}.loss_function: transformers' {current.__name__} → speedkit fused cross-entropy",
            )
        )
    return sites, left_alone


def swap(handle: Handle, site: LossSite) -> None:
    """Set ``site.loss`` as the model's loss function, recorded on ``handle`` (undo and redo)."""
    set_attr(handle, site.model, compat.HF_LOSS_FUNCTION_ATTR, site.loss, site.description)
