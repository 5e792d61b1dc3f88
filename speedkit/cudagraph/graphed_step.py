"""The whole training step as one CUDA graph: captured once after warm-up, replayed every step.

:class:`GraphedStep` wraps a :class:`~speedkit.training.step.Step`. Its first ``warmup`` steps run eagerly on
a side stream (compilation, autotuning, the optimizer's lazy state); the last of them runs under
CUDA's sync debug mode, and any synchronizing call it makes (``.item()``, ``bool(tensor)``, a
data-dependent size) stops the graph with its file and line. Then the step's device work — forward,
loss, backward, clipping, the optimizer's update, zero-grad (``Step.compute``) — is captured on
:class:`~speedkit.data.static.StaticBatch` buffers and replayed: each step copies its batch into the
buffers, replays, makes the step's recorded ``self.log`` calls with the replayed values, and runs
the host work of the step (learning-rate schedules, ``Step.after_step``) as usual. The optimizer's
learning rates stay the numbers schedules set and checkpoints save; a capturable optimizer's graph
reads each from a device tensor, in the param group only while the step is captured and filled from
the group's number before each replay, so a replay uses the current one.

What cannot be replayed runs eagerly and is said: a batch that does not fit the buffers (a short
last batch), a step after something replaced the optimizer's state (a restored snapshot: the
graph is captured again after one eager step), or everything once the graph is stopped (a host
sync, a failed capture, a hyper-parameter that changes every step). It never replays a step whose
inputs it cannot vouch for.

With an out-of-memory fallback (``OOMFallback``, ``speedkit.apply(oom_fallback=True)``) the graph
captures the fallback's split as it stands (a split made in a warm-up step is captured); a capture
that runs out of memory runs that step eagerly, where the fallback splits it, and captures the next
at the split then; out of memory again at the same split, the graph stops and the steps run
eagerly. The report says which.

:meth:`GraphedStep.bind_fit` binds the graph into a Lightning ``fit``: the training epoch loop's
automatic optimization runs the graphed step for each batch, and Lightning's own step for the
batches the graph does not take (warm-up included), so the fit's loop, hooks, logging,
schedulers and counters go on as they would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from speedkit import compat, distributed
from speedkit.cudagraph.safety_visitor import Blocker
from speedkit.cudagraph.step_watch import find_host_draws, find_syncs
from speedkit.data.static import StaticBatch
from speedkit.errors import first_line
from speedkit.handle import Handle, in_place_changes
from speedkit.training.accumulate import free_device_memory
from speedkit.training.step import LogCall, Step, StepWrapper

#: optimizer hyper-parameters a schedule may change, read by the graph from device tensors
TENSOR_HPARAMS = ("lr",)


class _Rate:
    """A number hyper-parameter of one param group that the graph reads from ``tensor``."""

    def __init__(self, group: dict[str, Any], key: str, tensor: torch.Tensor) -> None:
        self.group, self.key, self.tensor = group, key, tensor
        self.filled: Any = None  # the number last written into the tensor

    def fill(self) -> None:
        """The group's current value into the tensor (one small device write, no host sync; none
        while the value stays as it was)."""
        value = self.group.get(self.key)
        if isinstance(value, torch.Tensor):  # the user's own tensor rate
            self.tensor.copy_(value)
        elif value != self.filled:
            self.tensor.fill_(float(value))
            self.filled = value


class GraphedStep(StepWrapper):
    """A step replayed from a CUDA graph of its device work.

    Args:
        inner: the step to capture (its ``compute`` is captured, its ``after_step`` runs every step).
        warmup: eager steps before the (first) capture; the last one checks for host syncs.
        rewarm: eager steps before capturing again after the optimizer's state was replaced.
    """

    def __init__(self, inner: Step, *, warmup: int = 2, rewarm: int = 1) -> None:
        super().__init__(inner)
        self.warmup = max(1, warmup)
        self.rewarm = max(1, rewarm)
        self.static: StaticBatch | None = None
        self.graph: Any = None
        self.static_loss: torch.Tensor | None = None
        self.logs: list[LogCall] = []
        #: why the graph stopped (the step then runs eagerly), if it did
        self.stopped: str | None = None
        self.captures = 0
        #: what the captures met beside the graph (the out-of-memory fallback's split), for the report
        self.capture_notes: list[str] = []
        self._oom_capture_parts: int | None = None  # the split a capture last ran out of memory at
        self.replays = 0
        self.eager_steps = 0
        #: batches that fit here but ran eagerly because another rank's did not fit its buffers
        self.eager_for_other_ranks = 0
        self._eager_needed = self.warmup
        self._checked = False
        self._state_ids: list[tuple[Any, str, int]] = []
        self._baked: list[tuple[dict[str, Any], str, Any]] = []
        self._hparam_drops = 0
        self._rates: list[_Rate] = []  # the rates the captured graph reads from device tensors
        self._captured_at = -1  # in_place_changes() when the graph was captured
        self._stream: Any = None
        #: the graph's working set (activations, gradients, temporaries: its private pool's peak use),
        #: the allocator's peak during capture above what was allocated before it. Replays allocate
        #: nothing, so the allocator's peak during them leaves it out. (Not the pool's reserved size:
        #: ``torch.cuda.graph`` empties the cache on entry, so reserved memory does not tell it.)
        self.graph_bytes = 0

    # -- the step --------------------------------------------------------------------------------
    def __call__(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        batches = self.inner.group(batches)  # a step that merges its micro-batches into one is captured whole
        if self.stopped is not None or len(batches) != 1:
            return self._eager(batches, batch_idx)
        if not self._ready():
            return self._warm(batches, batch_idx)
        static = self._buffers(batches[0], batch_idx)
        if static is None:
            return self._eager(batches, batch_idx)
        return self._replay(static, batch_idx)

    def _ready(self) -> bool:
        """Whether the next step may be replayed (or captured): a graph whose optimizer state was
        replaced dropped, no warm-up step due (the step's own machinery's among them: DDP's first
        iterations, then one checked step after them)."""
        if self.graph is not None and not self._still_valid():
            self._drop()
        if self.graph is not None:
            return True
        return self.eager_steps_before_capture() <= 0

    def eager_steps_before_capture(self) -> int:
        """The eager warm-up steps still due before the graph is captured (0: captured, stopped, or
        the next step captures): the configured warm-up, or more where the step's own machinery needs
        them first (DDP: its wrapper's first iterations, then one checked step after them)."""
        if self.graph is not None or self.stopped is not None:
            return 0
        machinery = self.inner.prepare_capture()
        if machinery > 0:
            self._eager_needed = max(self._eager_needed, machinery + (0 if self._checked else 1))
        return max(0, self._eager_needed)

    def _checks_next(self) -> bool:
        """Whether the next warm-up step is the last before the first capture: the one checked for
        host syncs and draws (a fit's runs Lightning's step with its logs recorded, as captured)."""
        return self._eager_needed == 1 and not self._checked

    def steps_before_effect(self) -> int:
        """The eager steps due before the capture beyond the configured warm-up (which a parity
        trajectory holds, with the capture and a replay): a DDP wrapper's first iterations, where the
        wrapper was made in the trials; 0 otherwise (``Handle.steps_before_effect``)."""
        return max(0, self.eager_steps_before_capture() - self.warmup)

    def _buffers(self, batch: Any, batch_idx: int) -> Any | None:
        """The static buffers holding ``batch``, capturing the graph first if there is none; None when
        the batch must run another way (it does not fit, or the capture stopped the graph)."""
        if self.graph is None:
            return self._capture(batch, batch_idx)
        if self.static is None:
            return None
        reason = self.static.fits(batch)
        # across several processes every rank replays or none does (a rank replaying while another steps
        # eagerly would issue other collectives): a batch another rank cannot fit its buffers with
        # (sequences padded per batch) runs eagerly everywhere. Agreed on the host, without waiting for
        # the GPU; one process: this batch alone decides
        if distributed.all_ranks_on_host(reason is None):
            return self.static.copy_in(batch)
        if reason is None:
            self.eager_for_other_ranks += 1
        else:
            self.static.refuse(reason)
        return None

    def _eager(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        self.eager_steps += 1
        return self.inner(batches, batch_idx)

    def _warm(self, batches: Sequence[Any], batch_idx: int, run: Callable[[], Any] | None = None) -> Any:
        """One eager warm-up step on a side stream; the last before the first capture checks syncs.

        ``run``: the step as the caller's loop runs it (Lightning's own, in a fit). By default the
        wrapped step, its logging done after its device work, as a loop does it (Lightning computes
        the logged metrics, a host sync for progress-bar values, after the step, not inside it)."""
        if run is None:

            def run() -> torch.Tensor:
                with self.inner.capture() as logs:
                    loss = self.inner.compute(batches, batch_idx)
                after.append(logs)
                return loss

        after: list[list[LogCall]] = []
        checking = self._checks_next()
        self._eager_needed -= 1
        self.eager_steps += 1
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream), self._as_captured():
            if checking:
                self._checked = True
                draws: list[Blocker] = []

                def run_watched() -> Any:  # host draws located only where no compiled code runs
                    result, found = find_host_draws(run, locate=not compat.runs_compiled_code(self.inner.model))
                    draws.extend(found)
                    return result

                out, syncs = find_syncs(run_watched)
                if syncs:
                    more = f" (and {len(syncs) - 1} more)" if len(syncs) > 1 else ""
                    self.stop(f"the step syncs with the host: {syncs[0]}{more}")
                elif draws:
                    more = f" (and {len(draws) - 1} more)" if len(draws) > 1 else ""
                    self.stop(f"the step draws random numbers on the host: {draws[0]}{more}")
            else:
                out = run()
        torch.cuda.current_stream(stream.device).wait_stream(stream)
        if checking:
            self._stop_together()
        if after:  # the wrapped step's logging and schedule, outside the device work (and the sync check)
            self.inner.emit(after[0], batches[0] if len(batches) == 1 else batches)
            self.inner.after_step(batch_idx)
        return out

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.inner.device)
        return self._stream

    def _as_captured(self) -> Any:
        """Across several processes, the warm-up steps and the capture run DDP's own step (a guarded
        stretch's hand-averaged gradients and agreement are host syncs a capture refuses; DDP's
        iterations are what its reducer counts before a capture): the step the graph replays."""
        return self.inner.guarded(False) if self.inner.world_size() > 1 else contextlib.nullcontext()

    def _stop_together(self) -> None:
        """Across several processes: the graph stopped on any rank stops on every rank, with that rank's
        reason (a rank replaying while another steps eagerly would issue other collectives). One gather,
        at the same step on every rank (the warm-up's count is the same on each)."""
        if self.inner.world_size() <= 1:
            return
        said = distributed.first_said(self.stopped)
        if said is not None and self.stopped is None:
            self._clear_grads()  # a capture that succeeded here left its gradients in the graph's pool
            self.stop(said)

    def _capture(self, batch: Any, batch_idx: int) -> Any | None:
        """Capture the step's device work on static buffers filled from ``batch`` (across several
        processes, on every rank, replayed only where every rank captured); the buffers, or None when
        the graph had to stop (nothing ran on the device: the caller runs the step)."""
        with self._as_captured():
            static = self._capture_here(batch, batch_idx)
        self._stop_together()  # one process: nothing to agree on
        return static if self.stopped is None else None

    def _capture_here(self, batch: Any, batch_idx: int) -> Any | None:
        self.static = StaticBatch(batch)
        static = self.static.fill(batch)
        graph = torch.cuda.CUDAGraph()
        numbers = self._rates_into_tensors()
        torch.cuda.synchronize(self.inner.device)
        allocated_before = torch.cuda.memory_allocated(self.inner.device)
        torch.cuda.reset_peak_memory_stats(self.inner.device)  # captures happen in warm-up, not timed windows
        try:
            # thread_local: a loader's pin-memory thread may allocate pinned memory meanwhile (global
            # mode fails that thread's call and the capture); this thread's own unsafe calls still fail it
            with self.inner.capture() as logs, torch.cuda.graph(graph, capture_error_mode="thread_local"):
                loss = self.inner.compute([static], batch_idx)
            self._record_captured_state()  # the rates still tensors: not among the numbers baked in
        except Exception as exc:
            compat.end_failed_capture(self.inner.device, graph)  # else the run's next dropout or randn raises
            self._clear_grads()
            fallback = self.inner.oom_fallback()
            if isinstance(exc, torch.OutOfMemoryError) and fallback is not None and self.inner.world_size() <= 1:
                self._capture_out_of_memory(fallback, exc)
            else:
                self.stop(f"capture failed: {capture_failure(exc)}")
            return None
        finally:  # also when interrupted: the user's groups hold numbers
            self._rates_back(numbers)
        frozen = [
            (args, where)
            for args, kwargs, where in logs
            if len(args) > 1 and isinstance(args[1], (int, float)) and not isinstance(args[1], bool)
        ]
        if frozen:
            self._clear_grads()
            self.stop(
                f"the step logs a host value ({frozen[0][0][0]!r} at {frozen[0][1]}), computed once at capture; "
                "log a tensor instead"
            )
            return None
        self.graph, self.static_loss, self.logs = graph, loss, list(logs)
        self._captured_at = in_place_changes()
        self.graph_bytes = max(0, torch.cuda.max_memory_allocated(self.inner.device) - allocated_before)
        self.captures += 1
        fallback = self.inner.oom_fallback()
        if fallback is not None and fallback.parts > 1:
            self.capture_notes.append(
                f"capture {self.captures} took the out-of-memory fallback's split: {fallback.micro_batch_note}"
            )
        return static

    def _capture_out_of_memory(self, fallback: Any, exc: BaseException) -> None:
        """A capture ran out of memory where the step has an out-of-memory fallback: the step runs
        eagerly this once (the fallback splits it where it runs out) and the next step is captured
        at the split then; out of memory again at the same split, the graph stops (the graph's pool
        needs memory the eager step does not) and every step runs eagerly, split by the fallback."""
        free_device_memory()
        at = fallback.micro_batch_note
        if self._oom_capture_parts == fallback.parts:
            self.stop(
                f"out of memory while capturing at {at}, twice (the graph's private pool needs memory the "
                "eager step does not): the step runs eagerly, the out-of-memory fallback splitting it where it "
                f"runs out ({first_line(exc)[:120]})"
            )
            return
        self._oom_capture_parts = fallback.parts
        self.capture_notes.append(
            f"out of memory while capturing at {at}: that step ran eagerly (split by the "
            "fallback where it ran out) and the next was captured again"
        )

    def _replay_graph(self) -> None:
        assert self.graph is not None
        for rate in self._rates:
            rate.fill()
        self.graph.replay()
        self.replays += 1

    def _replay(self, static: Any, batch_idx: int) -> torch.Tensor:
        assert self.static_loss is not None
        self._replay_graph()
        loss = self.static_loss.clone()
        self.inner.emit(self.logs, static)
        self.inner.after_step(batch_idx)
        return loss

    # -- what a graph depends on ------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """Stop replaying: every later step runs eagerly; ``reason`` goes to the report."""
        if self.stopped is None:
            self.stopped = reason
        self._drop()

    def _drop(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.static_loss, self.logs = None, None, []
        self._rates = []
        self._eager_needed = self.rewarm

    def reset(self) -> None:
        """Forget the graph and warm up again: before binding into a fit (whose state is fresh), or
        when what it captured changed beneath it (a rung under it switched)."""
        self._drop()
        self._eager_needed = self.warmup
        self._checked = False

    def _clear_grads(self) -> None:
        opt = self.inner.optimizer
        if opt is not None:
            opt.zero_grad(set_to_none=True)

    def _record_captured_state(self) -> None:
        opt = self.inner.optimizer
        self._state_ids = []
        self._baked = []
        if opt is None:
            return
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    self._state_ids.append((p, k, id(v)))
        for group in opt.param_groups:
            for k, v in group.items():
                if k != "params" and not isinstance(v, torch.Tensor):  # a learning rate left a number too
                    self._baked.append((group, k, _frozen(v)))

    def _still_valid(self) -> bool:
        if in_place_changes() != self._captured_at:
            # what the step computes was changed in place beneath the graph (the ladder's parity checks
            # set dropout rates to 0): the capture holds the kernels from before. Handles switched
            # (this graph's own suspend and resume among them) are not such a change: a rung switched
            # beneath the graph rebases it (Handle.rebase), with settle steps before any timed one
            return False
        opt = self.inner.optimizer
        if opt is None:
            return True
        for p, k, ident in self._state_ids:
            if id(opt.state.get(p, {}).get(k)) != ident:
                return False  # a snapshot restored (or a checkpoint loaded) new state tensors
        if any(not any(rate.group is g for g in opt.param_groups) for rate in self._rates):
            return False  # a loaded state dict replaced the param groups whose rates the graph reads
        changed = [k for group, k, v in self._baked if _frozen(group.get(k)) != v]
        if changed:
            self._hparam_drops += 1
            if self._hparam_drops >= 2:
                self.stop(
                    f"the optimizer's {changed[0]!r} changes from step to step (a schedule of it, e.g. "
                    "OneCycleLR's cycle_momentum); a graph bakes it in"
                )
            return False
        self._hparam_drops = 0
        return True

    def _rates_into_tensors(self) -> list[tuple[_Rate, Any]]:
        """For the capture: the learning rates of capturable param groups (and of fused SGD's, whose
        kernel takes a tensor rate) as device tensors in the groups, so the captured update reads them
        from the device; returns what to put back. Other optimizers (a foreach SGD) read a tensor
        learning rate on the host (``.item()``, a sync a capture refuses): theirs stays a number baked
        into the graph, and a change of it captures again (:meth:`_still_valid`)."""
        opt = self.inner.optimizer
        self._rates = []
        numbers: list[tuple[_Rate, Any]] = []
        if opt is None:
            return numbers
        fused_sgd = isinstance(opt, torch.optim.SGD)
        for group in opt.param_groups:
            if not (group.get("capturable", False) or (fused_sgd and group.get("fused"))):
                continue
            for key in TENSOR_HPARAMS:
                value = group.get(key)
                if value is None or isinstance(value, torch.Tensor):
                    continue
                device = group["params"][0].device if group["params"] else self.inner.device
                rate = _Rate(group, key, torch.empty((), device=device))
                rate.fill()
                group[key] = rate.tensor
                self._rates.append(rate)
                numbers.append((rate, value))
        return numbers

    @staticmethod
    def _rates_back(numbers: list[tuple[_Rate, Any]]) -> None:
        """After the capture: the groups' learning rates are numbers again (the replays read the tensors)."""
        for rate, value in numbers:
            rate.group[rate.key] = value

    def drop_rate_tensors(self) -> None:
        """Drop the graph's learning-rate tensors (the rung's undo); a group still holding one (a
        capture cut short before it put the number back) gets the number again."""
        for rate in self._rates:
            if rate.group.get(rate.key) is rate.tensor:
                rate.group[rate.key] = float(rate.tensor.item())
        self._rates = []

    def gradient_sync_fixed(self) -> str | None:
        if self.stopped is None and self.inner.world_size() > 1:
            return (
                "the step replays a CUDA graph that holds DDP's gradient all-reduce (a replay cannot leave it out); "
                "bench/ddp.py measures scaling against one GPU"
            )
        return self.inner.gradient_sync_fixed()

    def memory_outside_peak(self) -> int:
        """Bytes in use that the allocator's peak during replays does not show: the graph's pool."""
        return self.graph_bytes if self.graph is not None else 0

    def report(self) -> list[str]:
        lines = [f"CUDA graph: {self.captures} captures, {self.replays} replayed steps, {self.eager_steps} eager steps"]
        if self.graph_bytes:
            lines.append(
                f"graph memory: {self.graph_bytes / 2**30:.2f} GiB in its pool at capture's peak, counted in the "
                "peak memory reported"
            )
        if self.static is not None:
            lines.append(self.static.report())
        if self.eager_for_other_ranks:
            lines.append(
                f"{self.eager_for_other_ranks} batches that fit the buffers ran eagerly: another rank's batch "
                "did not fit its own (every rank replays the same steps)"
            )
        if self.logs:
            lines.append(f"self.log calls made after each replay: {len(self.logs)}")
        lines += self.capture_notes
        if self.stopped:
            lines.append(f"graph stopped: {self.stopped}")
        return lines

    def counts(self) -> dict[str, Any]:
        """:meth:`report`'s counts, for a program: captures, replayed and eager steps, and why the graph
        stopped (None while it has not)."""
        return {
            "captures": self.captures,
            "replays": self.replays,
            "eager_steps": self.eager_steps,
            "eager_for_other_ranks": self.eager_for_other_ranks,
            "stopped": self.stopped,
        }

    # -- a Lightning fit -------------------------------------------------------------------------
    def bind_fit(self, trainer: Any, module: Any) -> Handle | None:
        inner = self.inner.bind_fit(trainer, module)
        auto = compat.lightning_automatic_optimization(trainer)
        original = auto.run
        self.reset()
        self.stopped = None
        self.capture_notes, self._oom_capture_parts = [], None
        # the fit's own counts, apart from the trials' (reported then)
        self.captures = self.replays = self.eager_steps = self.eager_for_other_ranks = 0

        def run(optimizer: Any, batch_idx: int, kwargs: Any) -> Any:
            return self._fit_step(trainer, original, optimizer, batch_idx, kwargs)

        handle = Handle("cuda_graph")
        handle.record("", self.reset, persistent=True)  # unbound from the fit, the graph and its pool go
        if inner is not None:
            handle.record("", inner.undo)
        auto.run = run
        handle.record(
            "the fit's automatic optimization runs each batch's step from one CUDA graph (Lightning's own step "
            "for warm-up and for batches the graph cannot take)",
            lambda: auto.__dict__.pop("run", None),
            lambda: setattr(auto, "run", run),
        )
        return handle

    def _fit_step(self, trainer: Any, original: Callable[..., Any], optimizer: Any, batch_idx: int, kwargs: Any) -> Any:
        batch = kwargs.get("batch") if isinstance(kwargs, dict) else None
        if self.stopped is not None or batch is None or self.inner.accumulate != 1:
            return original(optimizer, batch_idx, kwargs)
        if not self._ready():
            checked = self._checks_next()

            def run() -> Any:
                if checked:
                    return self._fit_step_as_captured(original, optimizer, batch_idx, kwargs)
                return original(optimizer, batch_idx, kwargs)

            return self._warm([batch], batch_idx, run=run)
        static = self._buffers(batch, batch_idx)
        if static is None:
            return original(optimizer, batch_idx, kwargs)
        compat.lightning_count_optimizer_step(trainer)
        self._replay_graph()
        with compat.lightning_logging_as(self.inner.model, "training_step"):
            self.inner.emit(self.logs, static)
        return {"loss": self.static_loss.clone()}

    def _fit_step_as_captured(self, original: Callable[..., Any], optimizer: Any, batch_idx: int, kwargs: Any) -> Any:
        """Lightning's own step with its ``self.log`` calls recorded and made after it, as the capture
        and its replays make them: the warm-up step checked before a capture. A compiled
        ``training_step`` (under DDP, Lightning's forward redirection compiles the whole of it) then
        meets the recording in this eager step: torch.compile guards on the module's ``log`` and
        compiles again when it changes, which inside the capture fails it ("operation failed due to a
        previous error during capture", seen with the compiled GPT-2 on 2 GPUs)."""
        logs: list[LogCall] = []
        with compat.recording_logs(self.inner.model, logs):
            out = original(optimizer, batch_idx, kwargs)
        with compat.lightning_logging_as(self.inner.model, "training_step"):
            self.inner.emit(logs, kwargs.get("batch"))
        return out


#: what a capture's error means, where torch's own message does not say it: (words of the error, why)
_CAPTURE_FAILURES = (
    (
        "generator not in capture mode",
        "the step sets the CUDA random generator's state while it is captured (activation checkpointing can: "
        "torch.utils.checkpoint's preserve_rng_state, a library's gradient_checkpointing, sets it back to draw the same "
        "dropout when it recomputes)",
    ),
)


def capture_failure(exc: BaseException) -> str:
    """One line saying why a capture raised ``exc``: its cause where known, then torch's message."""
    message = f"{type(exc).__name__}: {first_line(exc)[:300]}"
    why = next((why for words, why in _CAPTURE_FAILURES if words in message), None)
    return f"{why}; {message}" if why else message


def _frozen(value: Any) -> Any:
    """A comparable copy of a hyper-parameter value (tuples of betas, floats, flags)."""
    if isinstance(value, list):
        return tuple(value)
    return value
