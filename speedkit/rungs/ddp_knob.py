"""The base of the rungs that set one of DistributedDataParallel's knobs (``ddp_bucket_view``,
``ddp_static_graph``, ``ddp_bucket_size``, ``ddp_bf16_compress``): whether the run trains under DDP on
several processes and leaves the knob to speedkit, and setting it through the step
(:meth:`speedkit.training.step.Step.set_ddp`), which knows when and how its trainer wraps the model."""

from __future__ import annotations

from typing import Any, ClassVar

from speedkit.handle import Handle
from speedkit.rungs.base import Rung
from speedkit.training.state import TrainState


class DDPKnobRung(Rung):
    """Sets ``knob`` (a DDP keyword argument, or "comm_hook") to :meth:`value`."""

    knob: ClassVar[str] = ""

    def value(self) -> Any:
        raise NotImplementedError

    def check(self, state: TrainState) -> str | None:
        world = state.step.world_size()
        if world <= 1:
            return f"DDP knobs need several processes: world size {world}"
        options = state.step.ddp_options()
        if options is None:
            return "the run's strategy does not wrap the model in DistributedDataParallel (DDP knobs need strategy='ddp')"
        if self.knob == "comm_hook":
            if options["comm_hook"] is not None:
                return f"the strategy already registers the communication hook {options['comm_hook']}"
        elif self.knob in options:
            return f"the strategy already sets {self.knob}={options[self.knob]!r}"
        return self.why_not(options, state)

    def why_not(self, options: dict[str, Any], state: TrainState) -> str | None:
        """Why the knob would change nothing in this run (None: it applies); ``options`` as
        :meth:`~speedkit.training.step.Step.ddp_options` says."""
        return None

    def apply(self, state: TrainState) -> Handle:
        handle = Handle(self.name)
        inner = state.step.set_ddp(**{self.knob: self.value()})
        handle.changes.extend(inner.changes)
        handle.record("", inner.undo, persistent=True)  # on undo only, after the suspend below: the change is gone for good
        handle.record("", inner.suspend, inner.resume)
        return handle
