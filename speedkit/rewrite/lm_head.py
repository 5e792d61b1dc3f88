"""Hugging Face causal LMs trained through their own loss (``model(input_ids, labels=…).loss``), their
LM head and cross-entropy computed by :func:`speedkit.kernels.linear_cross_entropy.linear_cross_entropy`,
which never holds the logits.

A causal LM's ``forward`` runs its backbone (``getattr(model, model.base_model_prefix)``), the head
(``model.get_output_embeddings()``, an ``nn.Linear``) on the last hidden states, and
``self.loss_function`` (``ForCausalLMLoss``: labels shifted left by one, ``ignore_index`` appended, the
mean over the labels kept, or the sum over ``num_items_in_batch``). :class:`FusedHeadForward`, set as
the instance's ``forward``, does the same while the model trains and is given labels: the backbone with
the arguments the model's forward was given (less ``labels`` and ``logits_to_keep``), then the head and
loss in one op; its output is the model's own output class with ``logits=None`` (the logits are what it
does not compute, as Liger-Kernel's fused forward returns them). Called otherwise (evaluation, no
labels, ``return_dict=False``) it runs the model's own forward.

What it stands in for is checked per model instance, not assumed from its family: :func:`find` runs
both forwards once in training mode on a few tokens, from the same random state (dropout draws the same
masks), and leaves the model alone unless the losses agree to fp32 rounding. A model whose head does
more than a Linear (a transform before it, Gemma-2's soft-capping or Cohere's logit scale after it),
whose loss adds an auxiliary term (mixture-of-experts router losses) or whose backbone takes other
arguments fails that check and says so.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speedkit.handle import AttributeWrapper
from speedkit.kernels.linear_cross_entropy import linear_cross_entropy

#: the probe's relative tolerance on the loss (fp32 on both sides: the chunks sum in another order)
PROBE_RTOL = 1e-4
#: arguments of the model's forward that its backbone is not given
_HEAD_ONLY = ("labels", "logits_to_keep", "num_logits_to_keep")


class FusedHeadForward(AttributeWrapper):
    """A causal LM's ``forward`` whose head and loss run fused while it trains on labels (see the
    module doc); ``wrapped`` is the model's own bound forward."""

    def __init__(self, wrapped: Callable[..., Any], site: HeadSite) -> None:
        super().__init__(wrapped)
        self.site = site

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        site = self.site
        labels = kwargs["labels"] if "labels" in kwargs else (args[site.labels_at] if len(args) > site.labels_at else None)
        if labels is None or not site.model.training or kwargs.get("return_dict") is False or len(args) > len(site.names):
            return self.wrapped(*args, **kwargs)
        named = dict(zip(site.names, args))
        named.update(kwargs)
        for name in _HEAD_ONLY:
            named.pop(name, None)
        out = site.backbone(**named)
        loss = site.loss(out[0], labels, named)
        return site.output_cls(loss=loss, logits=None, **{k: out[k] for k in site.carried if k in out})


@dataclass
class HeadSite:
    """One causal LM whose head and loss are fused: its backbone, its head, the names of its forward's
    positional parameters, and its output class with the fields taken over from the backbone's."""

    model: nn.Module
    backbone: nn.Module
    head: nn.Linear
    names: tuple[str, ...]
    labels_at: int
    output_cls: type
    carried: tuple[str, ...] = ()
    shift: bool = True
    description: str = ""

    def loss(self, hidden: Tensor, labels: Tensor, kwargs: dict[str, Any]) -> Tensor:
        """transformers' causal-LM loss over ``hidden`` (B, T, H) through the fused head."""
        ignore_index = kwargs.get("ignore_index", -100)
        target = labels
        if self.shift:
            shift_labels = kwargs.get("shift_labels")
            target = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = target.to(hidden.device).contiguous()
        num_items = kwargs.get("num_items_in_batch")
        loss = linear_cross_entropy(
            hidden,
            self.head.weight,
            target,
            self.head.bias,
            ignore_index=ignore_index,
            reduction="mean" if num_items is None else "sum",
        )
        if num_items is None:
            return loss
        if torch.is_tensor(num_items):
            num_items = num_items.to(loss.device)
        return loss / num_items


def _causal_loss(model: nn.Module) -> str | None:
    """Why ``model``'s loss is not transformers' causal-LM cross-entropy, or None."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "this transformers has no loss functions (before 4.46)"
    try:
        current = model.loss_function
    except Exception as exc:  # noqa: BLE001 (a property of the library's: whatever it raises, the model is left alone)
        return f"its loss_function could not be read ({type(exc).__name__})"
    if current is ForCausalLMLoss or getattr(current, "original", None) is ForCausalLMLoss:
        return None
    return f"its loss is {getattr(current, '__name__', type(current).__name__)}, not the causal-LM cross-entropy"


def _site(model: nn.Module) -> HeadSite | str:
    """The model's :class:`HeadSite`, or why it has none."""
    if isinstance(model.__dict__.get("forward"), FusedHeadForward):
        return "fused already"
    if "forward" in model.__dict__:
        return "it has an instance-level forward already (compiled or patched)"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"its output embeddings are {type(head).__name__}, not an nn.Linear"
    backbone = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    if not isinstance(backbone, nn.Module) or backbone is model:
        return "no backbone under its base_model_prefix"
    reason = _causal_loss(model)
    if reason:
        return reason
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return "its forward's signature cannot be read"
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    if "labels" not in names and not any(p.kind == p.VAR_KEYWORD for p in params):
        return "its forward takes no labels"
    # labels by keyword only where its forward takes **kwargs: positional arguments past ``names`` run its own forward
    return HeadSite(model, backbone, head, names, names.index("labels") if "labels" in names else len(names), object)


def _probe(site: HeadSite, fused: FusedHeadForward) -> str | None:
    """Run the model's forward and the fused one on a few tokens in training mode, from one random
    state; fill in the site's output class and carried fields; why they differ, or None."""
    model = site.model
    device = site.head.weight.device
    vocab = site.head.out_features
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 8), generator=gen).to(device)
    labels = ids.clone()
    labels[0, 3] = -100
    was_training = model.training
    devices = [device] if device.type == "cuda" else []
    try:
        model.train()
        with torch.no_grad(), torch.autocast(device.type, enabled=False), torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            expected = model.forward(input_ids=ids, labels=labels)
            if not dataclasses.is_dataclass(expected) or not hasattr(expected, "loss"):
                return f"its forward returns {type(expected).__name__}, not a model output with a loss"
            site.output_cls = type(expected)
            fields = {f.name for f in dataclasses.fields(expected)}
            torch.manual_seed(0)
            backbone_out = site.backbone(input_ids=ids)
            site.carried = tuple(
                f.name
                for f in dataclasses.fields(backbone_out)
                if f.name in fields and f.name not in ("loss", "logits", "last_hidden_state")
            )
            torch.manual_seed(0)
            got = fused(input_ids=ids, labels=labels)
    except Exception as exc:  # noqa: BLE001 (the model's code: whatever fails, it is left alone and the reason said)
        return f"the fused forward could not stand in for its own ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    finally:
        model.train(was_training)
    want, have = expected.loss.float(), got.loss.float()
    if not torch.isclose(have, want, rtol=PROBE_RTOL, atol=1e-6):
        return (
            f"its own forward computes another loss than its backbone, head and causal-LM cross-entropy "
            f"({want.item():.6g} against {have.item():.6g}: the head or loss does more)"
        )
    return None


def find(root: nn.Module) -> tuple[list[HeadSite], list[str]]:
    """The Hugging Face causal LMs in ``root`` whose head and loss can run fused (each probed), and why
    the others are left alone."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return [], []
    sites: list[HeadSite] = []
    left_alone: list[str] = []
    inner: set[int] = set()
    for path, module in root.named_modules():
        if not isinstance(module, transformers.PreTrainedModel) or id(module) in inner:
            continue
        inner.update(id(m) for m in module.modules())
        name = type(module).__name__ + (f" (self.{path})" if path else "")
        site = _site(module)
        if isinstance(site, str):
            if site != "fused already":
                left_alone.append(f"{name}: {site}")
            continue
        reason = _probe(site, FusedHeadForward(module.forward, site))
        if reason:
            left_alone.append(f"{name}: {reason}")
            continue
        vocab, hidden = site.head.out_features, site.head.in_features
        site.description = f"{name}: LM head ({hidden}→{vocab}) and cross-entropy fused, in chunks of tokens (no logits kept)"
        sites.append(site)
    return sites, left_alone


def fused(model: nn.Module) -> bool:
    """Whether ``model``'s forward is a :class:`FusedHeadForward` now."""
    return isinstance(model.__dict__.get("forward"), FusedHeadForward)
