"""explicit_mask: nn.Transformer applies the mask it is given, without reading it on the host first.

Speeds up: models built on ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` (``nn.Transformer``,
Lightning's demo Transformer, the PyTorch tutorials' models) called with an attention mask and no
``is_causal`` hint. Their ``forward`` then asks whether the mask is the causal one
(``torch.nn.modules.transformer._detect_is_causal_mask``: ``bool((mask == causal).all())``), which
reads a device tensor on the host: a sync every step, a graph break under ``torch.compile``, and a
step a CUDA graph cannot capture. Passing ``is_causal=False`` where the caller left it ``None`` skips
the question: the mask is applied as given (an additive or boolean mask in scaled-dot-product
attention), the same function, with no sync (Lightning's demo Transformer on the H200: 1.26× beneath
compile, and with both its step can be captured by ``cuda_graph``).
Does not help: callers that pass the hint already, or no mask; steps where a sync costs nothing (a
device-bound step, whose host waits anyway). A causal mask applied as a mask rather than as
``is_causal=True`` does the masked half of the attention too: on long sequences that can cost more
than the sync saved, which the ladder's timing decides.
Needs: a CUDA device (on a CPU no sync to remove); stacks running torch's own ``forward`` (a subclass's is
left alone).
Numerics: the same function; the mask added rather than the causal kernel's own masking. A kernel
choice, judged as a rewrite.

Only instances whose class runs torch's own ``forward`` are wrapped (a subclass's override may not
take the hint); ``undo`` puts each instance's ``forward`` back.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from speedkit.rungs.base import AttributeWrapper, Handle, Rung, set_attr
from speedkit.training.state import TrainState

#: the classes whose forward sniffs its mask, with (the mask's parameter, the hint's parameter)
_SNIFFERS: dict[type[nn.Module], tuple[str, str]] = {
    nn.TransformerEncoder: ("mask", "is_causal"),
    nn.TransformerDecoder: ("tgt_mask", "tgt_is_causal"),
}


def _position(cls: type[nn.Module], name: str) -> int:
    """Index of ``name`` among the positional arguments of ``cls.forward`` after ``self``."""
    return list(inspect.signature(cls.forward).parameters).index(name) - 1


class MaskAsGiven(AttributeWrapper):
    """A transformer stack's ``forward`` (of class ``cls``, one of ``_SNIFFERS``) that passes the hint
    ``False`` (the mask as given) when its caller gave a mask and left the hint ``None``; every other
    call goes through unchanged."""

    def __init__(self, wrapped: Any, cls: type[nn.Module]) -> None:
        super().__init__(wrapped)
        self.mask, self.hint = _SNIFFERS[cls]
        self.mask_at, self.hint_at = _position(cls, self.mask), _position(cls, self.hint)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mask = args[self.mask_at] if len(args) > self.mask_at else kwargs.get(self.mask)
        hinted = len(args) > self.hint_at or kwargs.get(self.hint) is not None
        if mask is not None and not hinted:
            kwargs[self.hint] = False
        return self.wrapped(*args, **kwargs)


def sniffing_stacks(model: nn.Module) -> list[tuple[nn.Module, type[nn.Module]]]:
    """The model's transformer stacks that run torch's own mask-sniffing ``forward``, each with the
    class of ``_SNIFFERS`` whose forward it runs."""
    return [
        (module, cls)
        for module in model.modules()
        for cls in _SNIFFERS
        if isinstance(module, cls) and type(module).forward is cls.forward and "forward" not in vars(module)
    ]


class ExplicitMaskRung(Rung):
    name = "explicit_mask"
    recompiles = True  # beneath a kept compile its trial compiles anew
    # the mask check's sync; the causal mask built and compared every step (elementwise kernels, host work)
    targets = ("syncs", "host", "elementwise")
    cuts_host_work = True  # a host sync per step: on a host-bound step it is tried first, with compile
    judged_at_full_precision = True  # a kernel choice: its parity is also judged without bf16's rounding

    def check(self, state: TrainState) -> str | None:
        if state.device.type != "cuda":
            return f"on {state.device.type} the mask is read where it lives: no device sync to remove"
        if not sniffing_stacks(state.model):
            return (
                "no nn.TransformerEncoder / nn.TransformerDecoder running torch's own forward (the ones "
                "that read a mask on the host to find out whether it is causal)"
            )
        return None

    def apply(self, state: TrainState) -> Handle:
        handle = Handle(self.name)
        names = {id(m): n for n, m in state.model.named_modules()}
        for module, cls in sniffing_stacks(state.model):
            wrapper = MaskAsGiven(module.forward, cls)
            set_attr(
                handle,
                module,
                "forward",
                wrapper,
                f"{names.get(id(module)) or type(module).__name__} ({type(module).__name__}): called with a "
                f"{wrapper.mask} and no hint, {wrapper.hint}=False (the mask applied as given, not read on the host "
                "to find out whether it is causal)",
            )
        return handle


__all__ = ["ExplicitMaskRung", "MaskAsGiven", "sniffing_stacks"]
