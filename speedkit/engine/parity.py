"""Parity: the loss trajectories of the parity steps from the snapshot, and the envelope they must
stay within (:class:`ParityCheck`), calibrated once per precision on the model under rounding-level
noise (:class:`RoundingNoise`); dropout switched off where a configuration draws its masks from
another random stream (:func:`dropout_off`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from speedkit import compat, config, distributed
from speedkit.engine.stack import Stack
from speedkit.handle import changed_in_place
from speedkit.results import Parity
from speedkit.rungs.base import active_dropouts
from speedkit.training.snapshot import Snapshot
from speedkit.training.state import TrainState

#: the most steps a parity trajectory runs first for changes that need them to act (DDP's first
#: iterations before a CUDA graph's capture: 10); a change that still needs more is reported by its handle
_READY_STEPS_AT_MOST = 32


def rel_diff(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


class ParityCheck:
    """Judges configurations of ``stack`` on ``state`` by their loss trajectories over ``steps``
    parity steps (the ladder's: the configured ones, or more where a rung needs more to be in effect).

    The ladder sets, for its run, ``snapshot`` (every trajectory starts from it) and ``batches`` (the
    host-kept parity batches); ``reference`` is the baseline's trajectory (the calibration's), run on
    first need; ``calibration`` holds each precision's envelope, the report's ``parity_calibration``.
    """

    def __init__(self, state: TrainState, stack: Stack, steps: int) -> None:
        self.state, self.stack, self.steps = state, stack, steps
        self.snapshot: Snapshot | None = None
        self.batches: list[Any] = []
        self._reference: list[float] | None = None
        #: seconds per step of the baseline's reference where it ran (an upper bound on the step: its
        #: first steps include first calls), on ``host_clock``
        self.reference_pace_s: float | None = None
        self.host_clock: Callable[[], float] = time.perf_counter
        self.calibration: dict[str, dict[str, float]] = {}
        #: draws per precision's calibration (None: ``configs/tolerances.yaml``'s ``seeds``; one for a slow step)
        self.seeds: int | None = None
        #: called before each parity step: raises where the trials must stop (a signal came)
        self.poll: Callable[[], None] = lambda: None

    @property
    def reference(self) -> list[float]:
        """The baseline's trajectory: every kept rung off (switched back after), run on first need. A
        cached decision whose rungs draw their dropout masks from another stream is judged on
        trajectories with dropout off, and never needs it (GPT-2 on an H100: 1.5 s of a 17.8-s re-check)."""
        if self._reference is None:
            mask = [s.on for s in self.stack.slots]
            self.stack.configure([False] * len(mask))
            try:
                t0 = self.host_clock()
                self._reference = self.trajectory()
                self.reference_pace_s = (self.host_clock() - t0) / max(1, len(self._reference))
            finally:
                self.stack.configure(mask)
        return self._reference

    @property
    def has_reference(self) -> bool:
        """Whether the baseline's trajectory has run (:attr:`reference`)."""
        return self._reference is not None

    def judge(self, losses: list[float], reference: list[float]) -> Parity:
        """The loss trajectory against the reference, step by step within the envelope of the numerics
        in effect (a change of the function shows at the first steps, where rounding has moved the
        trajectory least)."""
        state = self.state
        per_step = self.tolerance(state.precision)
        moves = [rel_diff(a, b) for a, b in zip(losses, reference)]
        worst = max(moves, default=0.0)
        passed = all(m <= t for m, t in zip(moves, per_step))
        return Parity(
            len(losses),
            max(per_step, default=0.0),
            state.precision,
            reference,
            losses,
            worst,
            passed,
            envelope=per_step[: len(losses)],
        )

    def tolerance(self, precision: str) -> list[float]:
        """The parity tolerance of ``precision`` on this model, per parity step: ``safety`` times how
        far the baseline trajectory moves, at that step or before, under rounding of that precision
        (see :class:`RoundingNoise`: every weight, every leaf module's output at its kernels' own
        precision, every gradient), the worst of ``seeds`` draws, never under the configured floor.
        The envelope of a change's class: a precision rung is judged against its precision's own
        rounding; a rung that keeps the precision (a layout, compile, a kernel) against the reduction
        order and kernel choice of the precision in effect. Measured once per precision at the
        baseline, kept in the report's ``parity_calibration``."""
        if precision not in self.calibration:
            floor = config.tolerance(precision, self.state.device.type)
            calibration = config.parity_calibration()
            epsilon = float(calibration["epsilon"][precision])
            safety = float(calibration["safety"])
            seeds = self.seeds or int(calibration.get("seeds", 1))
            envelope = [0.0] * self.steps
            kernels: list[str] = []
            for seed in range(seeds):
                noise = RoundingNoise(self.state.model, epsilon, seed=seed, epsilons=calibration["epsilon"])
                perturbed = self.trajectory(noise=noise)
                kernels = noise.kernels
                moves = [rel_diff(a, b) for a, b in zip(perturbed, self.reference)]
                envelope = [max(e, m if math.isfinite(m) else 0.0) for e, m in zip(envelope, moves)]
            # rounding differences, once in the weights, stay: a step's envelope is the worst so far
            envelope = list(itertools.accumulate(envelope, max))
            sensitivity = max(envelope, default=0.0)
            self.calibration[precision] = {
                "epsilon": epsilon,
                "sensitivity": sensitivity,
                "safety": safety,
                "floor": floor,
                "seeds": seeds,
                "envelope": envelope,
                "tolerance": max(floor, safety * sensitivity),
                "per_step": [max(floor, safety * e) for e in envelope],
                "kernels": kernels,
            }
        return list(self.calibration[precision]["per_step"])

    def trajectory(self, noise: RoundingNoise | None = None) -> list[float]:
        """Losses of the parity steps from the snapshot (weights, schedule, RNG); one sync at the end;
        with ``noise`` on the model where given (the calibration's)."""
        assert self.snapshot is not None
        self._ready_changes()
        self.snapshot.restore()
        losses = []
        # across several processes: a step that fails on one rank fails on every rank, and the losses
        # judged are the ranks' mean (DDP's loss), so every rank judges the same trajectory
        with distributed.together(), self.state.step.guarded(), noise if noise is not None else contextlib.nullcontext():
            for i in range(self.steps):
                losses.append(self._step(i))
            local = [float(x) for x in torch.stack(losses).float().cpu()]
        return distributed.mean(local)

    def _step(self, i: int) -> torch.Tensor:
        """Parity step ``i`` on its host-kept batches (its micro-batches), moved to the device; its loss."""
        n, data = self.state.step.accumulate, self.state.data
        assert data is not None
        self.poll()
        return self.state.step([data.to_device(b) for b in self.batches[i * n : (i + 1) * n]], i)

    def _ready_changes(self) -> None:
        """Run the steps the changes switched on still need before they act in a step
        (``Handle.steps_before_effect``: a CUDA graph on a DDP wrapper made in the trials waits out the
        wrapper's first iterations), so that the trajectory after them, from the snapshot, judges the
        changes themselves. On the parity batches, guarded as the trajectory is. The need is asked again
        after each step (DDP logs its iterations one behind), and agreed as the most any rank needs, so
        every rank runs as many steps; at most ``_READY_STEPS_AT_MOST``."""
        for i in range(_READY_STEPS_AT_MOST):
            need = max((s.handle.steps_before_effect() for s in self.stack.slots if s.on), default=0)
            if distributed.largest([need])[0] <= 0:
                return
            with distributed.together(), self.state.step.guarded():
                self._step(i % self.steps)

    def of(
        self, on: list[bool], off: list[bool], reference: list[float] | None = None, own_trajectory: bool = True
    ) -> tuple[list[float], Parity]:
        """The configuration ``on`` (switched to, and left on) judged against ``reference``, the
        trajectory of the configuration ``off``; returns its own trajectory and the parity. Where a
        rung on in it draws its dropout masks from another stream (compile, a fused attention), both
        configurations are run again with dropout off and judged on those; then its own trajectory
        (dropout on) is run only where ``own_trajectory`` asks for it (else the list returned is empty:
        a cached decision's re-check needs the judgement alone, not a compile of the graph with dropout on).
        ``reference`` None: the baseline's (:attr:`reference`, run where needed and not run yet)."""
        self.stack.configure(on)
        drawing = any(s.on and s.handle.draws_differently for s in self.stack.slots) and active_dropouts(self.state.model)
        if not drawing:
            if reference is None:
                reference = self.reference
            losses = self.trajectory()
            return losses, self.judge(losses, reference)
        losses = self.trajectory() if own_trajectory else []
        with dropout_off(self.state.model):
            candidate = self.trajectory()
            self.stack.configure(off)
            try:
                before = self.trajectory()
            finally:
                self.stack.configure(on)
        return losses, self.judge(candidate, before)

    def draws_differently(self, place: int, on: list[bool] | None = None) -> bool:
        """Whether the configuration with the rung at ``place`` draws its dropout masks from another
        random stream than the one without it, so that trajectories with dropout on differ by design:
        the rung itself draws differently (a fused attention), or a rung on above it does, rebuilt on
        top of it (compile: the mask applied as given beneath it is another compiled graph, which
        consumes Inductor's random offsets in another order; a Transformer's loss moved by 1.9e-3
        in fp32 with dropout on, by rounding with it off). ``on``: the slots on (default: all)."""
        on = on if on is not None else [True] * len(self.stack.slots)
        drawing = self.stack.slots[place].handle.draws_differently or any(
            on[i] and self.stack.slots[i].handle.draws_differently for i in range(place + 1, len(self.stack.slots))
        )
        return bool(drawing and active_dropouts(self.state.model))

    def at_full_precision(self, place: int) -> Parity | None:
        """The parity of the candidate at ``place`` with the kept precision rungs switched off (None
        when none is on), and those that compile or replay the step (``off_at_full_precision``): a
        rewrite of the model's code is the same function at any precision, and only at the precision
        the run started in is the envelope narrow enough to show a defect smaller than bf16's rounding
        (a dropped attention scale, a wrong gradient)."""
        slots = self.stack.slots
        if all(s.rung.precision is None for i, s in enumerate(slots) if i != place):
            return None
        # the precision rungs off, and those that only compile or replay the arithmetic (each configuration
        # of this check would be compiled anew): the rewrite judged on its arithmetic alone, in eager
        precise = [i == place or (s.rung.precision is None and not s.rung.off_at_full_precision) for i, s in enumerate(slots)]
        dropout = self.draws_differently(place, precise)
        try:
            with dropout_off(self.state.model) if dropout else contextlib.nullcontext():
                self.stack.configure(precise)
                with_it = self.trajectory()
                self.stack.configure([p and i != place for i, p in enumerate(precise)])
                without = self.trajectory()
                return self.judge(with_it, without)
        finally:
            self.stack.all_on()


class RoundingNoise:
    """Rounding-level noise on a model, for calibrating parity: every floating-point weight, every
    leaf module's floating-point output and every weight's gradient multiplied by 1 ± ``relative``
    (as if each were rounded once more), signs from private generators (the global RNG is not
    touched).

    A leaf whose kernels compute in a coarser precision than ``relative`` stands for gets that
    precision's noise on its output (``epsilons``, by precision): on CUDA, convolutions while
    ``torch.backends.cudnn.allow_tf32`` is on and Linear layers while float32 matmuls may use TF32
    compute in TF32 — a run "in fp32" is that precise there, and another kernel or layout for them
    (channels_last, compile) moves the loss by their rounding, not by fp32's. ``kernels`` names them.
    """

    def __init__(self, model: torch.nn.Module, relative: float, seed: int = 0, epsilons: dict[str, float] | None = None) -> None:
        self.model, self.relative, self.seed = model, relative, seed
        self.epsilons = {k: float(v) for k, v in (epsilons or {}).items()}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._hooks: list[Any] = []
        #: the leaf kinds given their kernels' coarser precision, e.g. "Conv2d at tf32 (cudnn.allow_tf32)"
        self.kernels: list[str] = []

    def _noisy(self, t: torch.Tensor, relative: float) -> torch.Tensor:
        local = distributed.local_shard(t)  # a sharded (FSDP2) weight or gradient: this rank's shard
        if local.device not in self._generators:
            self._generators[local.device] = torch.Generator(device=local.device).manual_seed(self.seed)
        signs = torch.randint(0, 2, local.shape, generator=self._generators[local.device], device=local.device, dtype=local.dtype)
        return distributed.shard_like(local * signs.mul_(2 * relative).add_(1 - relative), t)

    def _kernel_precision(self, module: torch.nn.Module) -> tuple[float, str | None]:
        """The relative rounding of ``module``'s kernels, and why where coarser than ``relative``."""
        tf32 = self.epsilons.get("tf32", 0.0)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cuda":
            return self.relative, None
        if tf32 > self.relative:
            if isinstance(module, torch.nn.modules.conv._ConvNd) and torch.backends.cudnn.allow_tf32:
                return tf32, f"{type(module).__name__} at tf32 (torch.backends.cudnn.allow_tf32)"
            if isinstance(module, torch.nn.Linear) and torch.backends.cuda.matmul.allow_tf32:
                return tf32, f"{type(module).__name__} at tf32 (float32 matmul precision)"
        # a CUDA kernel's reduction order is its own choice (tiles, split-K, atomics, Welford or two
        # passes): another kernel for the same K-long sums moves each by about sqrt(K) fp32 roundings
        k = reduction_length(module)
        order = self.epsilons.get("fp32", 0.0) * math.sqrt(k)
        if k > 1 and order > self.relative:
            return order, f"{type(module).__name__} at its reduction order (sqrt(K) fp32 roundings for K-long sums)"
        return self.relative, None

    def __enter__(self) -> RoundingNoise:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.copy_(self._noisy(p, self.relative))
        kernels = set()
        for m in self.model.modules():
            if any(True for _ in m.children()):
                continue
            relative, why = self._kernel_precision(m)
            if why:
                kernels.add(why)
            self._hooks.append(m.register_forward_hook(functools.partial(self._output_hook, relative=relative)))
        self.kernels = sorted(kernels)
        for p in self.model.parameters():
            if p.requires_grad and p.is_floating_point():
                self._hooks.append(p.register_hook(lambda g: self._noisy(g, self.relative)))
        return self

    def _output_hook(self, module: torch.nn.Module, args: Any, output: Any, *, relative: float) -> Any:
        return compat.tree_map(
            lambda t: self._noisy(t, relative) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output
        )

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def reduction_length(module: torch.nn.Module) -> int:
    """How many terms each output of ``module`` sums: a Linear's inputs, a convolution's inputs per
    group times its kernel, a normalization's normalized elements (a custom norm's: its weight's);
    1 for a module that sums nothing (an embedding, an activation)."""
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear):
        return module.in_features
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return module.in_channels // module.groups * math.prod(module.kernel_size)
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return 1
    normalized = getattr(module, "normalized_shape", None)  # LayerNorm, RMSNorm, and their look-alikes
    if normalized:
        return math.prod(normalized)
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm | torch.nn.GroupNorm):
        return 1  # its sums run over the batch: the gradients' noise stands for them
    if "norm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return weight.numel()
    return 1


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """Every dropout rate of ``model`` at 0 inside the block (:func:`active_dropouts`: dropout modules,
    code reading ``dropout.p`` too, and the float rates a model passes to its kernels itself). Compiled
    inside the block, the rates are constants (:func:`speedkit.compat.floats_as_constants`): the change
    does not make them dynamic in the graphs compiled after it, with the rates put back."""
    saved = [(m, name, getattr(m, name)) for m, name in active_dropouts(model)]
    for m, name, _ in saved:
        setattr(m, name, 0.0)
    changed_in_place()  # a compiled forward guards on the rates (its graphs compile once for 0); a captured graph captures again
    try:
        with compat.floats_as_constants():
            yield
    finally:
        for m, name, rate in saved:
            setattr(m, name, rate)
        changed_in_place()
