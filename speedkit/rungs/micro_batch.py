"""micro_batch: fewer, larger micro-batches per accumulation step: the same samples, order and effective batch.

Speeds up: runs that accumulate gradients over micro-batches that leave the device partly idle
(``accumulate_grad_batches=4`` at a micro-batch of 8 on a GPU that runs 32 as fast per sample), or whose
step is host-bound (each micro-batch pays the host's time again): ``factor`` consecutive loader batches
go through one forward and one backward as one micro-batch, so an optimizer step makes
``accumulate / factor`` passes instead of ``accumulate``. Where that leaves one micro-batch per step,
a CUDA graph can take the step (it captures steps without accumulation). Lightning's demo Transformer
at accumulation 4 on the H200: 2.59×.
Does not help: a step that keeps the device busy at the user's micro-batch already.
Needs: gradient accumulation (2 or more micro-batches per optimizer step; without it a larger
micro-batch changes the effective batch, which ``speedkit sweep --change-effective-batch`` does on
request); no batch-statistics layer in training mode (a BatchNorm would take its statistics over the
merged micro-batch); batches that concatenate (the same shapes apart from the batch dimension).

Numerics: the same function where the loss is a mean over samples. A mean over something else (padded
tokens) is weighted by the merged micro-batch instead (parity measures it); dropout draws other masks.

The loss of the merged micro-batch, divided by ``accumulate / factor``, is the mean of the
``factor`` micro-batches' losses divided by ``accumulate`` where the loss is a mean over samples and
the micro-batches are equally large: the same function, reductions reordered. A loss that is a mean
over something else (the tokens of padded sequences) weights them by the merged micro-batch instead;
the ladder's parity check measures the difference. Dropout draws its masks over the merged
micro-batch (other random numbers, the same function: parity is judged with dropout off). A step whose batches do not merge (their shapes
differ) runs them as they are, and the report counts it.

``factor``: a divisor of the accumulation (default: the largest whose predicted memory fits, the
activations growing with the micro-batch: on a GPU, the peak so far less the weights, gradients and
optimizer state, times ``factor``, under 90% (``1 - margin``) of the device's memory; every divisor on a
CPU). The ladder then measures it against the step without; ``speedkit sweep`` measures every size.

In a Lightning fit the kept rung binds itself (:meth:`MergedStep.bind_fit`): the fit loop takes the
loader's batches ``factor`` at a time, merged (the epoch's live iterator wrapped where it is, later
epochs through a merging loader), with ``accumulate_grad_batches``, the epoch's batch count and limit
and a validation interval counted in batches divided by ``factor``; the undo puts them back.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from speedkit import compat
from speedkit.distributed import smallest
from speedkit.errors import ConfigError
from speedkit.handle import Handle, set_attr
from speedkit.rungs.base import Rung, active_dropouts
from speedkit.training.accumulate import merge_batches
from speedkit.training.state import TrainState
from speedkit.training.step import Step, StepWrapper

#: memory left free by the default factor's prediction (the sweep's margin)
MARGIN = 0.10


@dataclasses.dataclass
class MicroBatchOptions:
    """factor: loader batches per micro-batch, a divisor of the accumulation (None: the largest that
    fits, see the module docstring)."""

    factor: int | None = None

    def __post_init__(self) -> None:
        f = self.factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 2):
            raise ConfigError("micro_batch.factor", f"expected a whole number >= 2 or null (the largest that fits), found {f!r}")


class MergedStep(StepWrapper):
    """Runs each group of ``factor`` micro-batches of a step as one (see the module docstring)."""

    def __init__(self, inner: Step, factor: int) -> None:
        super().__init__(inner)
        self.factor = factor
        self.merged_steps = 0
        self.unmerged_steps = 0
        self.why_unmerged: str | None = None
        self.fit_unmerged = 0
        #: in a Lightning fit the loop feeds merged batches (bind_fit): steps pass them on as they are
        self.fit_bound = False

    @property
    def passes_per_step(self) -> int:
        a = self.inner.passes_per_step
        return a if self.fit_bound else max(1, a // self.factor)  # in a fit the loop's accumulation is divided already

    def __call__(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        return self.inner(self.group(batches), batch_idx)

    def compute(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        return self.inner.compute(self.group(batches), batch_idx)

    def group(self, batches: Sequence[Any]) -> list[Any]:
        """The step's micro-batches merged ``factor`` by ``factor`` (as they are where they do not merge,
        where they are merged already, and in a fit, whose loop merges them)."""
        k = self.factor
        if self.fit_bound or len(batches) < k or len(batches) % k:
            return self.inner.group(batches)
        merged = []
        for i in range(0, len(batches), k):
            batch, why = merge_batches(batches[i : i + k])
            if why is not None:
                self.unmerged_steps += 1
                self.why_unmerged = self.why_unmerged or why
                return self.inner.group(batches)
            merged.append(batch)
        self.merged_steps += 1
        return self.inner.group(merged)

    def report(self) -> list[str]:
        # bound into a Lightning fit, the steps counted here are the trials' (a fit of 80 optimizer steps
        # said 1409): the fit's loop merges its own batches, counted apart (fit_unmerged)
        where = "steps of the trials" if self.fit_bound else "steps"
        lines = [f"{where} with merged micro-batches: {self.merged_steps}"]
        if self.unmerged_steps:
            lines.append(f"steps run unmerged: {self.unmerged_steps} ({self.why_unmerged})")
        if self.fit_unmerged:
            lines.append(f"fit: {self.fit_unmerged} groups of batches did not merge and went to the step one by one")
        return lines

    # -- a Lightning fit -------------------------------------------------------------------------
    def bind_fit(self, trainer: Any, module: Any) -> Handle | None:
        inner = self.inner.bind_fit(trainer, module)
        handle = Handle("micro_batch")
        if inner is not None:
            handle.record("", inner.undo)
        k = self.factor
        before = int(trainer.accumulate_grad_batches)
        undo = compat.lightning_group_train_batches(trainer, k, self._fit_groups, lambda loader: _MergingLoader(loader, self))

        def unbind() -> None:
            undo()
            self.fit_bound = False

        self.fit_bound = True
        handle.record(
            f"fit: the train loop takes the loader's batches {k} at a time, merged into one micro-batch "
            f"(accumulate_grad_batches {before} -> {before // k}, the epoch's batch count and a validation "
            f"interval in batches divided by {k})",
            unbind,
        )
        handle.report = lambda: [line for line in self.report() if line.startswith("fit:")]
        return handle

    def _fit_groups(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The fit's batches ``factor`` at a time, merged; a group that does not merge goes one by one
        (its step then takes other batches than without the rung: warned once, counted)."""
        k = self.factor
        while True:
            group = []
            for _ in range(k):
                try:
                    group.append(next(iterator))
                except StopIteration:
                    break
            if not group:
                return
            batch, why = merge_batches(group)
            if why is None:
                yield batch
                continue
            if not self.fit_unmerged:
                warnings.warn(
                    f"speedkit micro_batch: {k} train batches did not merge ({why}); they go to the step one "
                    "by one, so the optimizer steps from here on group other batches than without speedkit",
                    UserWarning,
                    stacklevel=2,
                )
            self.fit_unmerged += 1
            yield from group


class _MergingLoader:
    """A train loader whose epochs are the user's loader's, ``factor`` batches merged at a time."""

    def __init__(self, loader: Any, step: MergedStep) -> None:
        self.loader, self.step = loader, step

    def __iter__(self) -> Iterator[Any]:
        return self.step._fit_groups(iter(self.loader))

    def __len__(self) -> int:
        return -(-len(self.loader) // self.step.factor)

    def __getattr__(self, name: str) -> Any:  # the loader's own attributes (sampler, batch_size, dataset...)
        if name in ("loader", "step"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """Names of the layers in training mode whose output depends on the other samples of the batch."""
    return [
        name or type(m).__name__
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the weights, their gradients and the optimizer's state: what a larger micro-batch
    leaves as it is."""
    total = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    if optimizer is not None:
        for s in optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return total


def largest_fitting_factor(
    accumulate: int, peak_bytes: int | None, state_bytes: int, total_bytes: int | None, margin: float = MARGIN
) -> tuple[int, str]:
    """The largest divisor of ``accumulate`` (2 or more) whose predicted peak fits, and how it was
    chosen. Without device memory figures (a CPU): ``accumulate`` itself."""
    divisors = [d for d in range(2, accumulate + 1) if accumulate % d == 0]
    if peak_bytes is None or total_bytes is None:
        return divisors[-1], f"{divisors[-1]}: all of the accumulation (no device memory limit known)"
    activations = max(0, peak_bytes - state_bytes)
    budget = (1 - margin) * total_bytes
    fitting = [d for d in divisors if state_bytes + d * activations <= budget]
    if not fitting:
        return 1, (
            f"none: even 2 micro-batches merged would need about {(state_bytes + 2 * activations) / 2**30:.1f} GiB, "
            f"over {1 - margin:.0%} of the device's {total_bytes / 2**30:.1f} GiB"
        )
    k = fitting[-1]
    return k, (
        f"{k}: the largest divisor of {accumulate} whose predicted peak ({(state_bytes + k * activations) / 2**30:.1f} GiB: "
        f"{state_bytes / 2**30:.2f} of weights, gradients and optimizer state, {activations / 2**30:.2f} a micro-batch "
        f"times {k}) fits {1 - margin:.0%} of the device's {total_bytes / 2**30:.1f} GiB"
    )


class MicroBatchRung(Rung):
    name = "micro_batch"
    recompiles = True  # beneath a kept compile its trial compiles anew
    # every kernel of the pass runs on a larger micro-batch (a partly idle device fills: GEMMs, norms,
    # elementwise alike), and the host issues a pass less per merged micro-batch: no one category bounds it
    targets = ("*",)
    Options = MicroBatchOptions
    lightning_stage = "fit_start"  # before cuda_graph wraps the step (it captures a step of one merged micro-batch)
    cuts_host_work = True  # fewer passes per step: a host-bound step issues fewer kernels per sample
    new_shape_cost = True  # the merged micro-batch is a new shape to a compiled model

    def check(self, state: TrainState) -> str | None:
        held = state.step.optimizer_step_blocker()  # merging micro-batches changes when the optimizer steps
        if held is not None:
            return held
        a = state.step.accumulate
        if a < 2:
            return (
                "the run accumulates no gradients (one micro-batch per optimizer step): a larger micro-batch would change "
                "the effective batch (`speedkit sweep --change-effective-batch` does that on request)"
            )
        f = self.options.factor
        if f is not None and a % f:
            return f"factor {f} does not divide the accumulation ({a} micro-batches per optimizer step)"
        layers = batch_statistics_layers(state.model)
        if layers:
            more = f" and {len(layers) - 1} more" if len(layers) > 1 else ""
            return (
                f"{layers[0]}{more} take statistics over the batch (BatchNorm in training): merged micro-batches would "
                "change them"
            )
        if state.data is not None:  # two batches, the loader's generators put back (the fit's data order is not touched)
            saved = state.data.state_dict()
            try:
                sample = state.data.parity_batches(2)
            finally:
                state.data.load_state_dict(saved)
            _, why = merge_batches(sample)
            if why is not None:
                return f"the loader's batches do not merge: {why}"
        return None

    def factor(self, state: TrainState) -> tuple[int, str]:
        a = state.step.accumulate
        if self.options.factor is not None:
            return self.options.factor, f"{self.options.factor} (given)"
        if state.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(state.device)
            total = torch.cuda.get_device_properties(state.device).total_memory
            return largest_fitting_factor(a, peak, _state_bytes(state.model, state.optimizer), total)
        return largest_fitting_factor(a, None, 0, None)

    def apply(self, state: TrainState) -> Handle:
        handle = Handle(self.name)
        k, why = self.factor(state)
        agreed = smallest(k)  # under DDP every rank merges as many (a rank with less memory free predicts fewer)
        if agreed != k:
            k, why = agreed, f"{agreed}: the smallest any rank predicted to fit (this rank's: {why})"
        if k < 2:
            raise RuntimeError(f"no larger micro-batch is predicted to fit: {why}")
        a = state.step.accumulate
        merged = MergedStep(state.step, k)
        set_attr(
            handle,
            state,
            "step",
            merged,
            f"{k} micro-batches merged into one: {a // k} forward and backward passes per optimizer step instead of {a}, "
            f"the same samples in the same order (factor {why})",
        )
        handle.report = merged.report
        # dropout draws its masks over the merged micro-batch in one call, not micro-batch by micro-batch:
        # the same function, other random numbers; parity is judged with dropout off
        handle.draws_differently = bool(active_dropouts(state.model))
        return handle
