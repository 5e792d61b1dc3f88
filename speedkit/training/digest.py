"""A digest of a training run's starting point: the same digest in two processes means their trajectories
from it are the same computation (the same weights, optimizer state, schedules, random states and
batches), so a loss trajectory recorded in one stands for the other's (:func:`state_digest`).

Tensors are summed on their own devices (their bits as integers, plain and position-weighted, in
chunks: a few kernels per tensor and one copy to the host per device, no host copy of the weights);
everything else goes in by value. Not a cryptographic hash: it tells apart runs that differ, not
adversaries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch

#: elements summed per kernel: bounds the transient int64 copies (a 32k x 4k embedding in 8 chunks)
_CHUNK = 1 << 24
#: the position weights' modulus (prime): every position within a chunk weighs differently
_MODULUS = 1_000_003
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_sums(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bits on its device (plain, and each element weighted by its position):
    the same values bit for bit give the same sums."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]) if flat.dtype != torch.bool else flat.to(torch.uint8)
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=flat.device, dtype=torch.int64) % _MODULUS + 1
        total[0] += chunk.sum()
        total[1] += (chunk * weights).sum()
    return total


def _plain(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` as JSON-able data, each tensor replaced by its shape, dtype and index in ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ["tensor", list(value.shape), str(value.dtype), len(tensors) - 1]
    if isinstance(value, Mapping):  # a dict, or a library's batch (transformers' BatchEncoding)
        return {repr(k): _plain(v, tensors) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v, tensors) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [type(value).__qualname__, {f.name: _plain(getattr(value, f.name), tensors) for f in dataclasses.fields(value)}]
    if hasattr(value, "tobytes"):  # a NumPy array (NumPy's RNG state)
        return ["array", hashlib.sha256(value.tobytes()).hexdigest()]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def state_digest(parts: Iterable[Any]) -> str:
    """A digest of ``parts`` (tensors, numbers, strings, and dicts, lists and tuples of them; NumPy arrays;
    anything else by its ``repr``): tensors by their shape, dtype and bits, read on their own devices."""
    tensors: list[torch.Tensor] = []
    plain = _plain(list(parts), tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    sums: list[Any] = [None] * len(tensors)
    for indices in by_device.values():
        values = torch.stack([_tensor_sums(tensors[i]) for i in indices]).tolist()  # one copy per device
        for i, v in zip(indices, values):
            sums[i] = v
    text = json.dumps([plain, sums], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:24]
