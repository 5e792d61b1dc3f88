"""ddp_bucket_size: DDP's gradient buckets at another size (``bucket_cap_mb``: 100 MiB, DDP's default 25).

Speeds up: steps whose gradients DDP all-reduces in many buckets over a fast link (NVLink), where each
all-reduce's fixed cost adds up: fewer, larger buckets. Any size may be given: a smaller one starts
all-reducing earlier in the backward.
Does not help: gradients that fit in one bucket at either size (the rung says so); a slow link, where
overlapping the backward matters more (a larger bucket starts its all-reduce later).
Needs: DDP on several processes, the strategy's ``bucket_cap_mb`` (and ``bucket_cap_mb_list``) left
unset, gradients larger than the smaller of the two sizes.
Numerics: unchanged. Sums over ranks at most reordered (NCCL picks its algorithm by message size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from speedkit.errors import ConfigError
from speedkit.rungs.ddp_knob import DDPKnobRung
from speedkit.training.state import TrainState

#: DistributedDataParallel's bucket size where none is given (``torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB``)
DDP_DEFAULT_BUCKET_MB = 25.0


@dataclass
class DDPBucketSizeOptions:
    """bucket_cap_mb: the size of DDP's gradient buckets, in MiB (DDP's default is 25)."""

    bucket_cap_mb: float = 100.0

    def __post_init__(self) -> None:
        size = self.bucket_cap_mb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ConfigError("ddp_bucket_size.bucket_cap_mb", f"expected a size in MiB > 0, found {size!r}")


class DDPBucketSizeRung(DDPKnobRung):
    name = "ddp_bucket_size"
    # how the all-reduces are cut and overlapped with the backward
    targets = ("communication",)
    Options = DDPBucketSizeOptions
    knob = "bucket_cap_mb"

    def value(self) -> Any:
        return self.options.bucket_cap_mb

    def why_not(self, options: dict[str, Any], state: TrainState) -> str | None:
        if options.get("bucket_cap_mb_list"):
            return f"the strategy already sets bucket_cap_mb_list={options['bucket_cap_mb_list']!r}"
        size = float(self.options.bucket_cap_mb)
        if size == DDP_DEFAULT_BUCKET_MB:
            return f"bucket_cap_mb={size:g} is DDP's default"
        gradients_mb = sum(p.numel() * p.element_size() for p in state.model.parameters() if p.requires_grad) / 2**20
        if gradients_mb <= min(size, DDP_DEFAULT_BUCKET_MB):
            return (
                f"the model's gradients ({gradients_mb:.3g} MiB) fit in one bucket at DDP's default "
                f"{DDP_DEFAULT_BUCKET_MB:g} MiB and at {size:g} MiB: the same all-reduces"
            )
        return None
