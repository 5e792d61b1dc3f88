"""cuda_graph: capture the whole training step once and replay it (one launch per step).

Speeds up: steps made of many small kernels, where the host issuing them is the bottleneck (small
models, small batches, fused kernels called from Python, Lightning's per-step host work between
launches). Does not help: steps dominated by a few long kernels. Costs: the capture after a few
warm-up steps, and the graph's private memory pool.
Needs: a CUDA device; one process, or several under Lightning's DDP strategy over NCCL without
``find_unused_parameters`` (see below); one micro-batch per optimizer step; a step that replays the
same work (static shapes, no host syncs, no numbers drawn on the host); under fp16 loss scaling, an optimizer that takes the scale on the device
(``fused=True``, as ``fused_optimizer`` sets: otherwise ``GradScaler.step`` reads the inf check on the host).
Numerics: unchanged (capturable optimizer rounding). Capturable optimizers compute on device-side step
counters.

Before anything is captured, the step's own source is read for what would make a replay wrong
(:mod:`speedkit.cudagraph.safety`: host syncs, dynamic shapes, data-dependent branches, host work), and
the rung refuses with the first reason and its source line. The last warm-up step then runs under
CUDA's sync debug mode, which finds syncs in library code too, and with the host's random generators
(torch's CPU one, NumPy's, Python's ``random``) watched for numbers drawn on the host (timm's Mixup/CutMix,
Hugging Face's LayerDrop), which a graph would replay as drawn at capture (the call's line is named unless
compiled code runs; a generator the step makes itself is not seen). What the rung changes: the step is
wrapped in a :class:`~speedkit.cudagraph.graphed_step.GraphedStep`; optimizers that have a ``capturable`` option get
it (their step counters move to the device), and the graph reads their learning rate from a device
tensor filled from the param group's number before each replay; SGD, which has no capturable option,
does so through its fused implementation (switched on where a schedule moves its rate; its flags back on
undo and in checkpoints). Without a schedule, and for other optimizers without ``capturable``, the rate is a
number baked into the graph, captured again when it changes, stopped if it changes every step. Under fp16 loss scaling the
scaler's step and update are captured too, for an optimizer that unscales and skips an overflowed
step on the device (``fused=True``). In a Lightning fit, the graph binds into the loop's automatic
optimization and ``self.log`` calls are made after each replay; batches that do not fit the static buffers
(a short last batch) run Lightning's own step. The peak memory shown adds the graph's working set at
capture (replays allocate nothing), and the rung is never kept on memory alone. A failed capture is
reverted with its reason and leaves the device's random generator usable.

Under DDP the graph holds DDP's own step: its bucketed NCCL all-reduces are captured as graph nodes on
NCCL's stream, overlapping the backward as they do eagerly (NCCL's work is not handed to the process
group's watchdog while it is captured, so its async error handling stays on). Every rank warms up,
checks and captures at the same step: after DDP's first 11 iterations (its reducer times them with
events it syncs on; its later sampling is switched off on the wrapper), the warm-up steps and the
capture run DDP's step even inside guarded parity steps, and the ranks then agree: a check or capture
that failed on one rank stops the graph on every rank with that rank's reason (nothing ran on the
device; a capture executes nothing, so no rank waits inside an all-reduce). Every rank replays the
same steps: before each replay the ranks agree on the host (a gloo group, no wait for the GPU) that
every batch fits its buffers; where one does not (sequences padded per batch), every rank steps eagerly.
"""

from __future__ import annotations

import dataclasses

import torch

from speedkit import compat
from speedkit.cudagraph.graphed_step import GraphedStep
from speedkit.cudagraph.safety import scan_step
from speedkit.handle import Handle, set_attr
from speedkit.rungs.base import Rung
from speedkit.rungs.fused_optimizer import apply_fused_optimizer, choose_implementation
from speedkit.training.saved_optimizer import SavedAsUser
from speedkit.training.state import TrainState
from speedkit.training.step import Step

#: hooks of a LightningModule or callback that Lightning calls inside the step: their host code would run once, at capture
_IN_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


@dataclasses.dataclass
class CudaGraphOptions:
    """Options of the cuda_graph rung."""

    #: eager steps before the first capture: the first compiles and autotunes, the last is checked for host syncs
    warmup: int = 2
    #: eager steps before capturing again once the optimizer's state was replaced
    rewarm: int = 1

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.rewarm < 1:
            raise ValueError(f"warmup and rewarm must be >= 1, found warmup={self.warmup}, rewarm={self.rewarm}")


class CudaGraphRung(Rung):
    name = "cuda_graph"
    off_at_full_precision = True  # a rewrite is judged at full precision on its arithmetic alone
    # one launch per step: the host's issuing and the syncs' round trips go (the device's work is the same)
    targets = ("host", "syncs")
    # a step with a host sync cannot be captured (explicit_mask, async_progress_bar remove the two found
    # in training steps), nor one of several micro-batches (micro_batch merges them into one)
    needs = ("explicit_mask", "async_progress_bar", "micro_batch")
    requires = ("explicit_mask", "micro_batch")
    cuts_host_work = True
    host_side = True
    new_shape_cost = True  # a batch of another shape runs eagerly
    Options = CudaGraphOptions
    lightning_stage = "fit_start"
    memory_comparable = False
    memory_note = (
        "the graph's private memory pool is filled at capture and replays allocate nothing; the peak "
        "shown adds the graph's working set at capture to the allocator's peak during replays, an "
        "estimate, not the same measure as an eager step's allocator peak"
    )

    def check(self, state: TrainState) -> str | None:
        held = state.step.optimizer_step_blocker()  # the graph captures the whole step, its optimizer step too
        if held is not None:
            return held
        blockers = scan_step(state.model)
        if blockers:
            more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
            return f"{blockers[0]}{more}"
        reason = _distributed_blocker(state.step)
        if reason is not None:
            return reason
        if state.device.type != "cuda":
            return f"CUDA graphs need a CUDA device; this run is on {state.device.type}"
        step = state.step
        if step.passes_per_step != 1:
            return (
                f"gradient accumulation ({step.passes_per_step} micro-batches per optimizer step): the graph captures the step "
                "of one batch"
            )
        missing = state.why_no_optimizer()
        if missing is not None:
            return missing
        opt = state.optimizer
        assert opt is not None
        reason = optimizer_blocker(opt, step.has_schedule(), step.fused_optimizer_blocker(), state.model) or (
            scaler_blocker(opt) if step.numerics == "fp16" else None
        )
        if reason is not None:
            return reason
        return _hook_blocker(state)

    def parity_steps_needed(self) -> int:
        return self.options.warmup + 2  # the eager warm-up steps, the capture, and a replay after it

    def apply(self, state: TrainState) -> Handle:
        handle = Handle(self.name)
        opt = state.optimizer
        assert opt is not None
        graphed = GraphedStep(state.step, warmup=self.options.warmup, rewarm=self.options.rewarm)
        # undone for good (not suspended between comparisons), the graph and its private memory pool go: a
        # handle the ladder keeps in its results must not hold the pool through the rest of the fit
        handle.record("", graphed.reset, persistent=True)
        _set_capturable(handle, opt)
        if state.step.has_schedule() and needs_fused_for_schedule(opt) and not _all_fused(opt):
            fused = apply_fused_optimizer(opt, "fused")
            handle.record(
                f"{fused.changes[0]} (for the schedule: fused SGD reads its learning rate as a device tensor, "
                "which the graph's replays read)",
                fused.undo,
                persistent=True,
            )
        reads_device_rate = "capturable" in opt.defaults or _all_fused(opt)
        lr = (
            "learning rate read by the graph from a device tensor filled from the param group's number before each "
            "replay (the group, its schedule and checkpoints keep numbers)"
            if reads_device_rate
            else "learning rate baked into the graph as a number (it has no capturable mode); a change of it captures again"
        )
        handle.record(f"{type(opt).__name__}: {lr}", graphed.drop_rate_tensors, persistent=True)
        set_attr(
            handle,
            state,
            "step",
            graphed,
            f"the whole step (forward, backward, {type(opt).__name__} update, zero-grad) captured in one CUDA graph "
            f"after {self.options.warmup} warm-up steps, fed from static batch buffers",
        )

        def problem() -> str | None:
            if graphed.stopped:
                return graphed.stopped
            if graphed.replays == 0:
                machinery = graphed.inner.prepare_capture()
                if machinery > 0:
                    return (
                        "the step was never replayed from the graph: DDP's wrapper still had "
                        f"{machinery} of its first iterations (which sync with the host) to run before a capture"
                    )
                return "the step was never replayed from the graph"
            return None

        handle.problem = problem
        handle.report = graphed.report
        handle.counts = graphed.counts
        # a rung beneath switched while the graph was off: the graph holds the old kernels; capture
        # again (warm-up and sync check included) before any step of this configuration is timed
        handle.rebase = graphed.reset
        handle.settle_steps = graphed.warmup + 1
        handle.steps_before_effect = graphed.steps_before_effect  # a DDP wrapper made in the trials (ddp_*)
        return handle


def needs_fused_for_schedule(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` reads a scheduled learning rate from the device only through its fused
    implementation (SGD: no capturable option, but its fused kernel takes a tensor ``lr``;
    its foreach and for-loop paths read one on the host)."""
    return isinstance(opt, torch.optim.SGD) and "capturable" not in opt.defaults


def _all_fused(opt: torch.optim.Optimizer) -> bool:
    return all(g.get("fused") for g in opt.param_groups)


def optimizer_blocker(
    opt: torch.optim.Optimizer, scheduled: bool, fused_step_blocker: str | None = None, model: torch.nn.Module | None = None
) -> str | None:
    """Why ``opt``'s step cannot be captured (with a learning-rate schedule when ``scheduled``), if so.
    ``fused_step_blocker``: why the training step cannot run a fused optimizer (Lightning's mixed
    precision with gradient clipping), for SGD, whose schedule a graph follows only when fused."""
    name = type(opt).__name__
    if isinstance(opt, torch.optim.LBFGS):
        return "LBFGS re-evaluates the loss inside its step (a closure loop with host decisions)"
    if "capturable" in opt.defaults:
        return None
    if scheduled and needs_fused_for_schedule(opt):
        if _all_fused(opt):
            return None
        implementation, why_not = choose_implementation(opt, "fused", fused_step_blocker, model)
        return (
            None
            if implementation == "fused"
            else (f"{name} reads a scheduled learning rate from the device only when fused, and cannot be fused here: {why_not}")
        )
    if scheduled:
        return (
            f"{name} has no capturable option: it cannot read a scheduled learning rate from the device, so a graph "
            "would freeze the schedule at capture"
        )
    if isinstance(opt, torch.optim.SGD) or "foreach" in opt.defaults:
        return None
    return f"{name} has no capturable option"


def scaler_blocker(opt: torch.optim.Optimizer) -> str | None:
    """Why fp16 loss scaling stops ``opt``'s step from being captured, if it does. ``GradScaler.step``
    reads the inf check on the host (``.item()``) before an ordinary optimizer's step; an optimizer
    that takes the scale and the inf check as device tensors (``fused=True``) skips an overflowed step
    on the device, and the scaler's update is device work too: the whole step can be captured."""
    if getattr(opt, compat.AMP_SCALING_FLAG, False):
        return None
    return (
        f"fp16 loss scaling with {type(opt).__name__}: GradScaler.step reads the inf check on the host every step; "
        "an optimizer built with fused=True (the fused_optimizer rung) takes it on the device and can be captured, "
        "or use bf16, which needs no scaler"
    )


def _set_capturable(handle: Handle, opt: torch.optim.Optimizer) -> None:
    """``capturable=True`` on the param groups without it, their step counters moved to the device (and
    back). Checkpoints written meanwhile hold the groups' own flags; a checkpoint loaded meanwhile (a
    resumed fit) gets the flags again."""
    changed = [i for i, g in enumerate(opt.param_groups) if not g.get("capturable")] if "capturable" in opt.defaults else []
    previous = {i: opt.param_groups[i].get("capturable", False) for i in changed}

    def capturable(on: bool) -> None:
        for i in changed:
            if i < len(opt.param_groups):  # by position: loading a state dict replaces the group dicts
                group = opt.param_groups[i]
                group["capturable"] = True if on else previous[i]
                compat.place_step_counters(opt, group)

    def user_values(i: int, group: dict) -> dict:
        return {"capturable": previous[i]} if i in previous else {}

    saved = SavedAsUser(opt, user_values, lambda i: i in previous, lambda: capturable(True))

    def on() -> None:
        capturable(True)
        saved.on()

    def off() -> None:
        saved.off()
        capturable(False)

    on()
    for i in changed:
        handle.record(f"{type(opt).__name__} param group {i}: capturable=True (step counters on the device)")
    handle.record("", off, on, persistent=True)


def _distributed_blocker(step: Step) -> str | None:
    """Training across processes: only DDP's step over NCCL is captured (its bucketed all-reduces
    become graph nodes, overlapping the backward as they do eagerly)."""
    world = step.world_size()
    if world <= 1:
        return None
    options = step.ddp_options()
    if options is None:
        return (
            f"training across {world} processes without Lightning's DDP strategy (FSDP gathers and frees the "
            "parameters from the host around every block): only DistributedDataParallel's step, set up by the "
            "strategy, is captured"
        )
    backend = options.get("backend")
    if backend != "nccl":
        return f"the {backend} backend's collectives run on the host and cannot be captured in a CUDA graph (NCCL's can)"
    if options.get("find_unused_parameters"):
        return (
            "the strategy sets find_unused_parameters=True: DDP's search for unused parameters reads its map of them "
            "on the host every step"
        )
    return None


def _hook_blocker(state: TrainState) -> str | None:
    """A LightningModule or callback hook that Lightning calls inside the step, overridden: its host
    code would run once, at capture."""
    from speedkit.rewrite.source import is_user_code

    owners: list[object] = [state.model]
    trainer = state.step.trainer
    owners += list(getattr(trainer, "callbacks", []) or [])
    for owner in owners:
        for hook in _IN_STEP_HOOKS:
            fn = getattr(type(owner), hook, None)
            if fn is not None and is_user_code(getattr(fn, "__module__", "") or ""):
                return (
                    f"{type(owner).__name__}.{hook} is overridden: Lightning calls it inside the step, so its host "
                    "code would run once, at capture"
                )
    return None
