"""Activation modules recognised by what they compute, not by their class: a library's own SiLU module
(transformers' ``ACT2FN["silu"]`` is ``SiLUActivation``, an ``nn.Module`` that calls ``F.silu``, not an
``nn.SiLU``) is a SwiGLU's activation as much as ``nn.SiLU`` is.

:func:`computes_silu` says whether a module is one: ``nn.SiLU`` itself (not in place), or a leaf module
without parameters, buffers or hooks whose output on fixed probe inputs (fp32 and bf16, odd shapes,
values across the function's whole range) equals ``F.silu``'s bit for bit, in the same dtype, leaving
its input as it was. The probe runs once per module instance (remembered weakly), on the CPU, under
``no_grad`` with autocast off.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from speedkit import compat

_SEEN: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def computes_silu(module: nn.Module) -> bool:
    """``module`` computes exactly ``F.silu(x)`` of its one input (see the module doc)."""
    if type(module) is nn.SiLU:
        return not module.inplace
    if isinstance(module, nn.SiLU) or compat.has_hooks(module):  # a subclass of nn.SiLU is user code
        return False
    if next(module.parameters(), None) is not None or next(module.buffers(), None) is not None:
        return False
    if next(module.children(), None) is not None:
        return False
    known = _SEEN.get(module)
    if known is None:
        known = _probe(module)
        _SEEN[module] = known
    return known


def _probe(module: nn.Module) -> bool:
    gen = torch.Generator().manual_seed(0)
    wide = torch.linspace(-30.0, 30.0, 61)  # the tails, where a cheaper approximation shows
    inputs = [torch.randn(3, 5, 7, generator=gen) * 4, wide]
    inputs += [x.to(torch.bfloat16) for x in inputs]
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for x in inputs:
                before = x.clone()
                out = module(x)
                if not (
                    isinstance(out, torch.Tensor)
                    and out.dtype == x.dtype
                    and torch.equal(out, F.silu(before))
                    and torch.equal(x, before)
                ):
                    return False
    except Exception:  # a module that cannot take the probe is not one
        return False
    return True
