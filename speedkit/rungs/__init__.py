"""Rungs: one file per quick win, addressed by name.

>>> from speedkit import rungs
>>> rungs.names()
['tf32', 'autocast', 'fused_optimizer', 'compile', 'sdpa', 'batched', 'fused_lm_head', 'triton_layers', 'aligned_linear', 'float8', 'channels_last', 'cudnn_benchmark', 'cuda_graph', 'data_path', 'async_progress_bar', 'gc_freeze', 'explicit_mask', 'micro_batch', 'ddp_bucket_view', 'ddp_static_graph', 'ddp_bucket_size', 'ddp_bf16_compress', 'fsdp_mixed_precision', 'fsdp_reshard', 'fsdp_prefetch', 'activation_checkpointing']
>>> rung = rungs.make({"name": "compile", "options": {"mode": "max-autotune"}})
"""

from __future__ import annotations

from typing import Any

from speedkit.errors import ConfigError
from speedkit.handle import Handle
from speedkit.options import parse_options
from speedkit.rungs.activation_checkpointing import ActivationCheckpointingRung
from speedkit.rungs.aligned_linear import AlignedLinearRung
from speedkit.rungs.async_progress_bar import AsyncProgressBarRung
from speedkit.rungs.autocast import AutocastRung
from speedkit.rungs.base import NoOptions, Rung
from speedkit.rungs.batched import BatchedRung
from speedkit.rungs.channels_last import ChannelsLastRung
from speedkit.rungs.compile import CompileRung
from speedkit.rungs.cuda_graph import CudaGraphRung
from speedkit.rungs.cudnn_benchmark import CudnnBenchmarkRung
from speedkit.rungs.data_path import DataPathRung
from speedkit.rungs.ddp_bf16_compress import DDPBf16CompressRung
from speedkit.rungs.ddp_bucket_size import DDPBucketSizeRung
from speedkit.rungs.ddp_bucket_view import DDPBucketViewRung
from speedkit.rungs.ddp_static_graph import DDPStaticGraphRung
from speedkit.rungs.explicit_mask import ExplicitMaskRung
from speedkit.rungs.float8 import Float8Rung
from speedkit.rungs.fsdp_mixed_precision import FSDPMixedPrecisionRung
from speedkit.rungs.fsdp_prefetch import FSDPPrefetchRung
from speedkit.rungs.fsdp_reshard import FSDPReshardRung
from speedkit.rungs.fused_lm_head import FusedLMHeadRung
from speedkit.rungs.fused_optimizer import FusedOptimizerRung
from speedkit.rungs.gc_freeze import GcFreezeRung
from speedkit.rungs.micro_batch import MicroBatchRung
from speedkit.rungs.sdpa import SdpaRung
from speedkit.rungs.tf32 import TF32Rung
from speedkit.rungs.triton_layers import TritonLayersRung

_REGISTRY: dict[str, type[Rung]] = {}


def register(cls: type[Rung]) -> type[Rung]:
    """Add a rung class to the registry under ``cls.name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (
    TF32Rung,
    AutocastRung,
    FusedOptimizerRung,
    CompileRung,
    SdpaRung,
    BatchedRung,
    FusedLMHeadRung,
    TritonLayersRung,
    AlignedLinearRung,
    Float8Rung,
    ChannelsLastRung,
    CudnnBenchmarkRung,
    CudaGraphRung,
    DataPathRung,
    AsyncProgressBarRung,
    GcFreezeRung,
    ExplicitMaskRung,
    MicroBatchRung,
    DDPBucketViewRung,
    DDPStaticGraphRung,
    DDPBucketSizeRung,
    DDPBf16CompressRung,
    FSDPMixedPrecisionRung,
    FSDPReshardRung,
    FSDPPrefetchRung,
    ActivationCheckpointingRung,
):
    register(_cls)


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> type[Rung]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError("rung", f"unknown rung {name!r}; known rungs: {', '.join(_REGISTRY)}") from None


def make(spec: Any, where: str = "rung") -> Rung:
    """Build a rung from a name, a ``{name, options}`` mapping, or a Rung instance."""
    if isinstance(spec, Rung):
        return spec
    if isinstance(spec, str):
        name, raw_options = spec, {}
    elif isinstance(spec, dict):
        unknown = sorted(set(spec) - {"name", "options"})
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", "unknown key; a rung is a name or {name: ..., options: {...}}")
        if "name" not in spec:
            raise ConfigError(where, "missing 'name'; a rung is a name or {name: ..., options: {...}}")
        name, raw_options = spec["name"], spec.get("options")
        if not isinstance(name, str):
            raise ConfigError(f"{where}.name", f"expected a rung name (string), found {name!r}")
    else:
        raise ConfigError(where, f"expected a rung name or {{name, options}} mapping, found {type(spec).__name__} {spec!r}")
    if name not in _REGISTRY:
        raise ConfigError(where, f"unknown rung {name!r}; known rungs: {', '.join(_REGISTRY)}")
    cls = _REGISTRY[name]
    return cls(parse_options(cls.Options, raw_options, f"{where}.options"))


def make_all(specs: Any, where: str = "ladder") -> list[Rung]:
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(where, f"expected a list of rungs, found {type(specs).__name__} {specs!r}")
    built = [make(s, f"{where}[{i}]") for i, s in enumerate(specs)]
    seen: dict[str, int] = {}
    for i, rung in enumerate(built):
        if rung.name in seen:
            raise ConfigError(
                f"{where}[{i}]", f"rung {rung.name!r} is listed twice (first at {where}[{seen[rung.name]}]); list each rung once"
            )
        seen[rung.name] = i
    return built


__all__ = ["Handle", "NoOptions", "Rung", "get", "make", "make_all", "names", "parse_options", "register"]
