"""One optimizer step of training: the ``Step`` seam the ladder measures and rungs wrap.

A step is the forward and the loss under the precision in effect, the backward (scaled when fp16
needs a GradScaler), gradient clipping, the optimizer step, zero-grad and the learning-rate
schedule, over one or more micro-batches (gradient accumulation). It owns the training state that
is not the model's or the optimizer's (schedulers, grad scaler) and hands it to snapshots.

* :class:`PlainStep` runs it in plain PyTorch (``speedkit.apply``, tests).
* ``speedkit.lightning.step.LightningStep`` drives a Lightning Trainer's strategy, precision plugin,
  clipping and hooks through their public API, so trials run the user's own step.
* :class:`StepWrapper` is the base of rungs' wrappers (``set_attr(handle, state, "step",
  MyWrapper(state.step))``): it forwards everything to the step it wraps.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from speedkit.errors import ConfigError
from speedkit.handle import Handle, set_attr
from speedkit.training.accumulate import stop_on_out_of_memory

LossFn = Callable[[nn.Module, Any, int], torch.Tensor]
#: one recorded ``self.log(*args, **kwargs)`` call: (args, kwargs, "file:line" of the call)
LogCall = tuple[tuple[Any, ...], dict[str, Any], str]

#: numerics class of a precision setting (the parity tolerance follows the loosest in effect)
NUMERICS = {
    "bf16": "bf16",
    "fp16": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "32-true": "fp32",
    "32": "fp32",
    "64-true": "fp32",
    "64": "fp32",
}


def default_loss_fn(model: nn.Module, batch: Any, batch_idx: int) -> torch.Tensor:
    """The loss of one batch, the way Lightning's automatic optimization gets it.

    A LightningModule's ``training_step`` may return the loss or a dict holding it under "loss".
    A plain ``nn.Module`` is called on the batch (a tuple/list is unpacked) and must return the loss.
    """
    if hasattr(model, "training_step"):
        return loss_of(model.training_step(batch, batch_idx))
    args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    try:
        out = model(*args)
    except TypeError:
        if _takes(model, len(args)):  # raised inside the forward: the model's own error
            raise
        raise ConfigError(
            "loss_fn",
            f"without one, each batch is passed to the model as model(*batch) and its output taken as the loss, but "
            f"{type(model).__name__}.forward does not take the batch's {len(args)} items; give "
            "loss_fn=lambda model, batch, batch_idx: <the loss>, e.g. F.cross_entropy(model(batch[0]), batch[1])",
        ) from None
    if not (isinstance(out, torch.Tensor) and out.dim() == 0) and not (isinstance(out, dict) and "loss" in out):
        raise ConfigError(
            "loss_fn",
            f"without one, the model's output is taken as the loss, but {type(model).__name__} returned "
            f"{type(out).__name__}{f' of shape {tuple(out.shape)}' if isinstance(out, torch.Tensor) else ''}; give "
            "loss_fn=lambda model, batch, batch_idx: <the loss>, e.g. F.cross_entropy(model(batch[0]), batch[1])",
        )
    return loss_of(out)


def _takes(model: nn.Module, n: int) -> bool:
    """Whether ``model.forward`` can be called with ``n`` positional arguments."""
    import inspect

    try:
        inspect.signature(model.forward).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # no signature to read: assume it does
        return True
    return True


def loss_of(out: Any) -> torch.Tensor:
    """The scalar loss in what a training step returned (a tensor, or a dict with "loss")."""
    if isinstance(out, dict):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        raise ConfigError(
            "model",
            f"the training step must return a scalar loss tensor, found {type(out).__name__}"
            " (return the loss, or a dict with a 'loss' key, from training_step)",
        )
    return out


def local_processes_from_env(environ: Any = None) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them; (0, 1) where unset or not numbers."""
    env = os.environ if environ is None else environ
    try:
        rank, count = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    except ValueError:
        return 0, 1
    return (rank, count) if 0 <= rank < count else (0, 1)


class Step:
    """The interface: what the engine and rungs may ask of a training step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    #: the GradScaler the step scales its loss with (fp16 autocast), None without one
    scaler: torch.amp.GradScaler | None = None
    #: the Lightning Trainer whose ``fit`` runs the step, None outside a Lightning fit
    trainer: Any = None
    #: the function the step computes its loss with, ``(model, batch, batch_idx) -> loss``, where it
    #: takes one (a plain step); None where the model's own ``training_step`` computes it
    loss_fn: Any = None

    @property
    def accumulate(self) -> int:
        """Loader batches (micro-batches) per optimizer step."""
        return 1

    @property
    def passes_per_step(self) -> int:
        """Forward and backward passes an optimizer step makes: one per micro-batch, unless a wrapper
        merges them (:meth:`group`)."""
        return self.accumulate

    def group(self, batches: Sequence[Any]) -> list[Any]:
        """The micro-batches one optimizer step runs, from the ``accumulate`` loader batches it is given
        (as they are, unless a wrapper merges them)."""
        return list(batches)

    def __call__(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        """One optimizer step over ``batches`` (``accumulate`` of them, on the device); returns the
        detached loss (the mean over micro-batches) without synchronizing with the device."""
        loss = self.compute(batches, batch_idx)
        self.after_step(batch_idx)
        return loss

    def compute(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        """The device work of one optimizer step: forwards, backwards, clipping, the optimizer's
        update and zero-grad (what a CUDA graph of the step captures)."""
        raise NotImplementedError

    def after_step(self, batch_idx: int) -> None:
        """The host work after an optimizer step that must run every step (learning-rate schedules)."""

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[LogCall]]:
        """Around a step whose host side effects must not happen as they run (a CUDA graph capture,
        which runs the Python once): ``self.log`` calls are recorded into the yielded list instead,
        for :meth:`emit` to make after each replay."""
        yield []

    def emit(self, logs: Sequence[LogCall], batch: Any) -> None:
        """Make the log calls recorded by :meth:`capture`, after a step that computed their values."""

    def forward_loss(self, batch: Any, batch_idx: int = 0) -> torch.Tensor:
        """Forward and loss of one batch under the precision in effect (no backward)."""
        raise NotImplementedError

    def host_processes(self) -> tuple[int, int]:
        """(this process's index, how many training processes) on this machine: several under DDP,
        which share its CPUs. From torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE where set, else (0, 1)."""
        return local_processes_from_env()

    def world_size(self) -> int:
        """How many processes train together (all machines): the default process group's size."""
        dist = torch.distributed
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def has_schedule(self) -> bool:
        """Whether a learning-rate schedule changes the optimizer's hyper-parameters between steps."""
        return False

    # -- precision -------------------------------------------------------------------------
    @property
    def numerics(self) -> str:
        """Numerics of the forward: "fp32", "bf16" or "fp16"."""
        return "fp32"

    def precision_choice(self) -> str | None:
        """None when speedkit may choose the autocast precision; else why not (the user chose it)."""
        return None

    def set_autocast(self, dtype_name: str) -> Handle:
        """Run the forward under autocast in ``dtype_name`` ("bf16"/"fp16", with loss scaling)."""
        raise NotImplementedError

    def fused_optimizer_blocker(self) -> str | None:
        """Why this step cannot run an optimizer that unscales its own gradients (a fused one), if so."""
        return None

    def optimizer_step_blocker(self) -> str | None:
        """Why a rung cannot run this step's optimizer step itself (a CUDA graph of the whole step, merged
        micro-batches), if so: the user's own code steps the optimizers (Lightning's manual optimization)."""
        return None

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer the step steps (a snapshot saves them all): :attr:`optimizer`, or several."""
        return [self.optimizer] if self.optimizer is not None else []

    def counted_pass(self, batch: Any, batch_idx: int = 0) -> None:
        """One forward and backward of ``batch`` whose FLOPs count as the step's
        (:func:`speedkit.measure.flops.count_step_flops`); the state is restored after it."""
        self.forward_loss(batch, batch_idx).backward()

    def oom_fallback(self) -> Any | None:
        """The out-of-memory fallback this step runs its batches through
        (:class:`speedkit.training.accumulate.MicroBatcher`), if any: a CUDA graph captures its split."""
        return None

    def optimizer_step(self) -> None:
        """Clip (if asked), step the optimizer (through the GradScaler where there is one), zero the
        gradients, step the scheduler: the second half of a step whose forward and backward the user
        runs by hand (:class:`speedkit.frontend.api.Accelerated`). A step that runs in someone
        else's loop (Lightning's) has none."""
        raise NotImplementedError(f"{type(self).__name__} steps its optimizer inside its own loop")

    def memory_outside_peak(self) -> int:
        """Bytes the step holds that the allocator's peak does not show (a CUDA graph's pool): the
        measured peak memory adds them."""
        return 0

    def why_no_optimizer(self) -> str | None:
        """Why rungs that change the optimizer find none to change (None: :attr:`optimizer` is the one)."""
        opt = self.optimizer
        if opt is None:
            return "the run has no optimizer"
        if not opt.param_groups:
            return f"{type(opt).__name__} holds no parameters"
        return None

    # -- training state the step owns (schedulers, grad scaler) ------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @contextlib.contextmanager
    def trial(self) -> Iterator[None]:
        """Within this context steps are trials: nothing they do may reach the user's logs or
        raise for running more steps than the schedule was built for."""
        yield

    @contextlib.contextmanager
    def guarded(self, on: bool = True) -> Iterator[None]:
        """Within this context, across several processes (DDP), a step that raises on one rank raises
        on every rank at the same point (:func:`speedkit.distributed.together`), none left waiting
        inside the gradient all-reduce: each micro-batch's forward and backward run without DDP's
        sync, the ranks agree it ran, then the gradients are averaged in one all-reduce, as DDP
        averages them. Slower than DDP's overlapped buckets: for parity steps, not timed ones.
        ``on=False``: DDP's own step again within a guarded stretch (what a CUDA graph captures).
        One process: nothing changes."""
        yield

    def prepare_capture(self) -> int:
        """Make the step's own machinery ready to be captured in a CUDA graph; returns how many more eager
        steps it needs first (DDP: its reducer's first iterations sync with the host). 0 by default."""
        return 0

    def gradient_sync(self, on: bool) -> None:
        """Turn DDP's gradient all-reduce off (``on=False``: each rank steps on its own gradients, the
        step one GPU would run with the same per-rank batch) or back on. One process: nothing to do."""

    def gradient_sync_fixed(self) -> str | None:
        """Why :meth:`gradient_sync` would not take the all-reduce out of this step's work, and where scaling
        is measured instead (None: it would)."""
        return None

    def bind_fit(self, trainer: Any, module: Any) -> Handle | None:
        """Make this step's change take effect in a Lightning ``fit`` that runs its own loop (after
        the trials, the kept step wrappers are bound here); None when there is nothing to bind. The
        returned handle undoes the binding."""
        return None

    def ddp_options(self) -> dict[str, Any] | None:
        """None when the step does not train under DistributedDataParallel on several processes; else
        what it is wrapped with: the keyword arguments given to DDP (those not given take DDP's defaults),
        "comm_hook" (the communication hook's name, None for DDP's own all-reduce) and "backend" (the
        process group's)."""
        return None

    def set_ddp(self, **changes: Any) -> Handle:
        """Wrap the model in DistributedDataParallel with ``changes`` (DDP keyword arguments, and
        "comm_hook": a communication hook) on top of what :meth:`ddp_options` says: before the model is
        wrapped, it is then wrapped so; after, wrapped anew over the same module. Every rank calls it.
        The handle puts the previous wrapping back."""
        raise NotImplementedError(f"{type(self).__name__} does not train under DistributedDataParallel")


class StepWrapper(Step):
    """A step around another one; subclasses override what they change (usually ``__call__``)."""

    def __init__(self, inner: Step) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # attributes of the wrapped step (model, scaler, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def accumulate(self) -> int:
        return self.inner.accumulate

    @property
    def passes_per_step(self) -> int:
        return self.inner.passes_per_step

    def group(self, batches: Sequence[Any]) -> list[Any]:
        return self.inner.group(batches)

    @property
    def numerics(self) -> str:
        return self.inner.numerics

    def __call__(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        return self.inner(batches, batch_idx)

    def compute(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        return self.inner.compute(batches, batch_idx)

    def after_step(self, batch_idx: int) -> None:
        self.inner.after_step(batch_idx)

    def capture(self) -> contextlib.AbstractContextManager[list[LogCall]]:
        return self.inner.capture()

    def emit(self, logs: Sequence[LogCall], batch: Any) -> None:
        self.inner.emit(logs, batch)

    def forward_loss(self, batch: Any, batch_idx: int = 0) -> torch.Tensor:
        return self.inner.forward_loss(batch, batch_idx)

    def precision_choice(self) -> str | None:
        return self.inner.precision_choice()

    def oom_fallback(self) -> Any | None:
        return self.inner.oom_fallback()

    def host_processes(self) -> tuple[int, int]:
        return self.inner.host_processes()

    def world_size(self) -> int:
        return self.inner.world_size()

    def has_schedule(self) -> bool:
        return self.inner.has_schedule()

    def set_autocast(self, dtype_name: str) -> Handle:
        return self.inner.set_autocast(dtype_name)

    def fused_optimizer_blocker(self) -> str | None:
        return self.inner.fused_optimizer_blocker()

    def why_no_optimizer(self) -> str | None:
        return self.inner.why_no_optimizer()

    def optimizer_step_blocker(self) -> str | None:
        return self.inner.optimizer_step_blocker()

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        return self.inner.all_optimizers()

    def counted_pass(self, batch: Any, batch_idx: int = 0) -> None:
        self.inner.counted_pass(batch, batch_idx)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:  # type: ignore[override]
        return self.inner.scaler

    @property
    def trainer(self) -> Any:  # type: ignore[override]
        return self.inner.trainer

    @property
    def loss_fn(self) -> Any:  # type: ignore[override]
        return self.inner.loss_fn

    def optimizer_step(self) -> None:
        self.inner.optimizer_step()

    def memory_outside_peak(self) -> int:
        return self.inner.memory_outside_peak()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def trial(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.trial()

    def guarded(self, on: bool = True) -> contextlib.AbstractContextManager[None]:
        return self.inner.guarded(on)

    def prepare_capture(self) -> int:
        return self.inner.prepare_capture()

    def gradient_sync(self, on: bool) -> None:
        self.inner.gradient_sync(on)

    def gradient_sync_fixed(self) -> str | None:
        return self.inner.gradient_sync_fixed()

    def bind_fit(self, trainer: Any, module: Any) -> Handle | None:
        return self.inner.bind_fit(trainer, module)

    def ddp_options(self) -> dict[str, Any] | None:
        return self.inner.ddp_options()

    def set_ddp(self, **changes: Any) -> Handle:
        return self.inner.set_ddp(**changes)


class ScheduleGuard:
    """Steps learning-rate schedulers; during trials, rewinds one that refuses to go on.

    Trials run more optimizer steps than a short run's schedule may allow (``OneCycleLR`` raises
    past ``total_steps``). The schedule's values do not change what a step costs, so a trial
    rewinds the scheduler (and its optimizer's learning rates) to where the trials started instead
    of failing; the snapshot puts the real schedule back after the trials.
    """

    def __init__(self) -> None:
        self._start: list[tuple[Any, dict[str, Any], list[dict[str, Any]]]] | None = None

    @contextlib.contextmanager
    def trial(self, schedulers: Sequence[Any]) -> Iterator[None]:
        previous = self._start
        self._start = [(s, s.state_dict(), _group_hparams(s)) for s in schedulers]
        try:
            yield
        finally:
            self._start = previous

    def step(self, scheduler: Any, do_step: Callable[[], None]) -> None:
        if self._start is None:
            do_step()
            return
        try:
            do_step()
        except Exception:
            saved = next(((state, groups) for s, state, groups in self._start if s is scheduler), None)
            if saved is None:
                raise
            scheduler.load_state_dict(saved[0])
            opt = getattr(scheduler, "optimizer", None)
            for group, hparams in zip(opt.param_groups if opt is not None else [], saved[1]):
                group.update(hparams)


def _group_hparams(scheduler: Any) -> list[dict[str, Any]]:
    opt = getattr(scheduler, "optimizer", None)
    if opt is None:
        return []
    return [{k: v for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)} for g in opt.param_groups]


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _check_step_arguments(loss_fn: Any, accumulate: Any, clip_grad_norm: Any, scheduler: Any) -> None:
    """One ConfigError naming the first of a plain step's arguments that cannot work."""
    if not callable(loss_fn):
        raise ConfigError("loss_fn", f"expected a function (model, batch, batch_idx) -> loss, found {type(loss_fn).__name__}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ConfigError("accumulate", f"expected a number of batches per optimizer step >= 1, found {accumulate!r}")
    if clip_grad_norm is not None and (
        isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) or not clip_grad_norm > 0
    ):
        raise ConfigError("clip_grad_norm", f"expected a positive number or None, found {clip_grad_norm!r}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise ConfigError("scheduler", f"expected a learning-rate scheduler (with step()), found {type(scheduler).__name__}")


class PlainStep(Step):
    """A training step in plain PyTorch.

    Args:
        model: the module to train (a LightningModule works: its ``training_step`` gives the loss).
        optimizer: its optimizer.
        device: where the step runs.
        loss_fn: ``(model, batch, batch_idx) -> loss``; defaults to :func:`default_loss_fn`.
        accumulate: micro-batches per optimizer step (the loss of each is divided by it).
        clip_grad_norm: clip the gradients' total norm to this value before the optimizer step.
        scheduler: a learning-rate scheduler stepped after every optimizer step.
        micro_batcher: the out-of-memory fallback (:class:`speedkit.training.accumulate.MicroBatcher`): each
            batch's forward and backward run through it, split into micro-batches on out-of-memory.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        *,
        loss_fn: LossFn = default_loss_fn,
        accumulate: int = 1,
        clip_grad_norm: float | None = None,
        scheduler: Any = None,
        micro_batcher: Any = None,
    ) -> None:
        _check_step_arguments(loss_fn, accumulate, clip_grad_norm, scheduler)
        self.micro_batcher = micro_batcher
        self.steps_done = 0  # optimizer steps computed (the fallback's events name them)
        self.model = model
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.loss_fn = loss_fn
        self._accumulate = accumulate
        self.clip_grad_norm = clip_grad_norm
        self.scheduler = scheduler
        self.autocast_dtype: torch.dtype | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self._scaler_initial: dict[int, dict[str, Any]] = {}
        self._schedule = ScheduleGuard()

    @property
    def accumulate(self) -> int:
        return self._accumulate

    def has_schedule(self) -> bool:
        return self.scheduler is not None

    def oom_fallback(self) -> Any | None:
        return self.micro_batcher

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context of the forward pass (a no-op without autocast)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_loss(self, batch: Any, batch_idx: int = 0) -> torch.Tensor:
        with self.autocast():
            return self.loss_fn(self.model, batch, batch_idx)

    def compute(self, batches: Sequence[Any], batch_idx: int) -> torch.Tensor:
        n = len(batches)
        total: torch.Tensor | None = None
        for batch in batches:
            if self.micro_batcher is None:
                loss = self.forward_backward(batch, batch_idx, divide=n)
            else:
                loss = self.micro_batcher.run(
                    batch, self.steps_done, lambda part, weight: self.forward_backward(part, batch_idx, weight, n)
                )
                assert loss is not None  # a plain step's loss function always gives a loss
            total = loss if total is None else total + loss
        if self.micro_batcher is None:
            self.update()
        else:
            with stop_on_out_of_memory("the optimizer step", self.micro_batcher):
                self.update()
        self.steps_done += 1
        assert total is not None, "a step needs at least one batch"
        return total

    def forward_backward(self, batch: Any, batch_idx: int, weight: float = 1.0, divide: int = 1) -> torch.Tensor:
        """Forward, the loss times ``weight`` (a micro-batch's share of its batch) over ``divide`` (the
        batches of the optimizer step), backward (scaled under fp16); returns that loss, detached."""
        loss = self.forward_loss(batch, batch_idx)
        if weight != 1.0:
            loss = loss * weight
        if divide > 1:
            loss = loss / divide
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach()

    def after_step(self, batch_idx: int) -> None:
        if self.scheduler is not None:
            self._schedule.step(self.scheduler, self.scheduler.step)

    def optimizer_step(self) -> None:
        """Clip (unscaled), step through the scaler if any, zero the gradients, step the schedule."""
        self.update()
        self.after_step(0)

    def update(self) -> None:
        """Clip (unscaled), step through the scaler if any, zero the gradients."""
        opt = self.optimizer
        if self.clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    # -- precision -------------------------------------------------------------------------
    @property
    def numerics(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.autocast_dtype, "fp32")  # type: ignore[arg-type]

    def precision_choice(self) -> str | None:
        return f"autocast is already on ({self.autocast_dtype})" if self.autocast_dtype is not None else None

    def set_autocast(self, dtype_name: str) -> Handle:
        handle = Handle("autocast")
        set_attr(
            handle,
            self,
            "autocast_dtype",
            _AUTOCAST_DTYPES[dtype_name],
            f"forward pass under torch.autocast({self.device.type!r}, {dtype_name})",
        )
        if dtype_name == "fp16":
            scaler = torch.amp.GradScaler(self.device.type)
            self._scaler_initial[id(scaler)] = scaler.state_dict()
            set_attr(handle, self, "scaler", scaler, "loss scaled with torch.amp.GradScaler (fp16)")
        return handle

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "scaler": (self.scaler, self.scaler.state_dict()) if self.scaler is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_scaler(self.scaler, state.get("scaler"), self._scaler_initial)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    @contextlib.contextmanager
    def trial(self) -> Iterator[None]:
        with self._schedule.trial([self.scheduler] if self.scheduler is not None else []):
            yield


def restore_scaler(scaler: Any, saved: tuple[Any, dict[str, Any]] | None, initial: dict[int, dict[str, Any]]) -> None:
    """Put a grad scaler back: to its saved state if it is the one saved, else (a scaler a rung
    created after the snapshot) to the state it was created with."""
    if scaler is None:
        return
    if saved is not None and saved[0] is scaler:
        scaler.load_state_dict(saved[1])
    elif id(scaler) in initial:
        scaler.load_state_dict(initial[id(scaler)])
