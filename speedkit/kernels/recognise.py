"""Modules and functions recognised by what they compute, not by their class or name.

Activation modules: a library's own SiLU or GELU
module (transformers' ``ACT2FN["silu"]`` is ``SiLUActivation``, ``ACT2FN["gelu_pytorch_tanh"]`` is
``GELUTanh``: ``nn.Module`` subclasses that call ``F.silu`` / ``F.gelu``, not ``nn.SiLU`` / ``nn.GELU``)
is a SwiGLU's or GeGLU's activation as much as PyTorch's classes are.

:func:`computes_silu` and :func:`computes_gelu` say whether a module is one: PyTorch's class itself (not
in place), or a leaf module without parameters, buffers or hooks whose output on fixed probe inputs
(fp32 and bf16, odd shapes, values across the function's whole range) equals ``F.silu``'s (``F.gelu``'s,
exact or tanh) bit for bit, in the same dtype, leaving its input as it was. A subclass of PyTorch's
class is user code and is not one. The probe runs once per module instance (remembered weakly), on the
CPU, under ``no_grad`` with autocast off, the global random state put back after it.

Rotary functions: :func:`computes_rotary` says whether a function called as ``f(q, k, cos, sin)`` (a
model's ``apply_rotary_pos_emb``: Llama, Mistral, Qwen and Gemma each copy it into their modeling file)
returns ``(q·cos + rotate_half(q)·sin, k·cos + rotate_half(k)·sin)`` with the tables unsqueezed at dim 1
(and at ``unsqueeze_dim`` where it takes one), on fp32 probes within fp32 rounding; once per function.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedkit import compat

#: what a probed module computes: "silu", "gelu" (exact), "gelu_tanh", or "" (none of them)
_SEEN: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def computes_silu(module: nn.Module) -> bool:
    """``module`` computes exactly ``F.silu(x)`` of its one input (see the module doc)."""
    if type(module) is nn.SiLU:
        return not module.inplace
    return _computes(module) == "silu"


def computes_gelu(module: nn.Module) -> str | None:
    """``"none"`` or ``"tanh"`` (the ``approximate`` of ``F.gelu``) when ``module`` computes exactly that
    GELU of its one input (see the module doc), else None."""
    if type(module) is nn.GELU:
        return module.approximate
    return {"gelu": "none", "gelu_tanh": "tanh"}.get(_computes(module))


def gates(module: nn.Module) -> bool:
    """``module`` is a SiLU or GELU (of either kind): a gated MLP's activation."""
    return computes_silu(module) or computes_gelu(module) is not None


def _computes(module: nn.Module) -> str:
    if isinstance(module, (nn.SiLU, nn.GELU)) or compat.has_hooks(module):  # a subclass: user code
        return ""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()) or any(True for _ in module.children()):
        return ""
    known = _SEEN.get(module)
    if known is None:
        known = _probe(module)
        _SEEN[module] = known
    return known


def _probe(module: nn.Module) -> str:
    gen = torch.Generator().manual_seed(0)
    wide = torch.linspace(-30.0, 30.0, 61)  # the tails, where a cheaper approximation shows
    inputs = [torch.randn(3, 5, 7, generator=gen) * 4, wide]
    inputs += [x.to(torch.bfloat16) for x in inputs]
    candidates = dict(_FUNCTIONS)
    try:  # a module that draws random numbers (a Dropout) must not move the user's generator
        with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.autocast("cpu", enabled=False):
            for x in inputs:
                before = x.clone()
                out = module(x)
                if not (isinstance(out, torch.Tensor) and out.dtype == x.dtype and torch.equal(x, before)):
                    return ""
                candidates = {name: fn for name, fn in candidates.items() if torch.equal(out, fn(before))}
                if not candidates:
                    return ""
    except Exception:  # a module that cannot take the probe is none of them
        return ""
    return next(iter(candidates))


_ROTARY: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def computes_rotary(fn: Any) -> bool:
    """``fn(q, k, cos, sin[, unsqueeze_dim=…])`` applies the rotate-half rotary embedding (module doc)."""
    try:
        known = _ROTARY.get(fn)
    except TypeError:  # not weak-referenceable: not a Python function
        return False
    if known is None:
        known = _probe_rotary(fn)
        _ROTARY[fn] = known
    return known


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _probe_rotary(fn: Any) -> bool:
    if not callable(fn):
        return False
    try:
        takes_dim = "unsqueeze_dim" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, tokens, dim = 2, 3, 1, 5, 8
    cos, sin = torch.randn(batch, tokens, dim, generator=gen), torch.randn(batch, tokens, dim, generator=gen)
    layouts = [(1, (batch, heads, tokens, dim), (batch, kv_heads, tokens, dim))]
    if takes_dim:
        layouts.append((2, (batch, tokens, heads, dim), (batch, tokens, kv_heads, dim)))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.autocast("cpu", enabled=False):
            for unsqueeze, q_shape, k_shape in layouts:
                q, k = torch.randn(q_shape, generator=gen), torch.randn(k_shape, generator=gen)
                out = fn(q, k, cos, sin, unsqueeze_dim=unsqueeze) if unsqueeze != 1 else fn(q, k, cos, sin)
                c, s = cos.unsqueeze(unsqueeze), sin.unsqueeze(unsqueeze)
                want = (q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s)
                if not (
                    isinstance(out, tuple)
                    and len(out) == 2
                    and all(isinstance(o, torch.Tensor) and o.shape == w.shape for o, w in zip(out, want))
                    and all(torch.allclose(o, w, rtol=1e-6, atol=1e-6) for o, w in zip(out, want))
                ):
                    return False
    except Exception:  # a function that cannot take the probe is not one
        return False
    return True
