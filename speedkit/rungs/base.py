"""The rung protocol: every quick win says whether it applies, applies itself, and can be undone.

A rung is a small class over plain-PyTorch functions::

    class MyRung(Rung):
        name = "my_rung"
        Options = MyOptions              # a dataclass; validated from recipes by parse_options
        precision = None                 # or "tf32"/"bf16"/"fp16" if it changes numerics

        def check(self, state) -> str | None:   # None = applies; else the reason it does not
        def apply(self, state) -> Handle:        # change state reversibly; say what changed

A rung changes the run only through the :class:`~speedkit.handle.Handle` it returns: flags, the
model's modules and forwards, the optimizer's implementation, or ``state.step`` / ``state.data``,
which it may wrap (``set_attr(handle, state, "step", MyStep(state.step))``). Changes recorded with
a redo (``set_attr`` does) can be switched off and on again without being rebuilt, which the ladder
uses to time a configuration with and without the rung in interleaved windows.

Each rung's module docstring is its user documentation, from which ``docs/rung_cards.py`` writes its
card (``docs/rungs/<name>.md``) and its row of README.md's rung table. Its first paragraph is one
sentence, ``"<name>: <what it does>"``. The sections ``Speeds up:``, ``Does not help:``, ``Needs:`` and
``Numerics:`` (required) and ``Costs:`` (optional) each start with their label at the start of a
paragraph or after a sentence's end (``". "`` or ``".) "``) inside one, and run to the next label or
the end of the paragraph; ``Numerics:`` opens with a short sentence ("unchanged.", "bf16 / fp16."), the table's cell.
Paragraphs that start with no label are prose about how the rung works, left out of the card.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import nn

from speedkit.handle import AttributeWrapper, Handle, nested, set_attr
from speedkit.options import check_value, parse_options
from speedkit.rewrite.pipeline import PlanCache, RewritePlan
from speedkit.training.state import TrainState


@dataclasses.dataclass
class NoOptions:
    """This rung takes no options."""


class Rung:
    """Base class of all rungs. Subclasses set ``name`` and implement ``check`` and ``apply``."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: numerics this rung introduces; None when it must not change numerics beyond reordering
    precision: ClassVar[str | None] = None
    #: when ``SpeedLadder(rungs=[...])`` (no trials) applies it in a Lightning run: "setup" (before
    #: the strategy wraps the model), "fit_start" (once the optimizers exist) or "train_start" (once
    #: the train loader exists, before the first step)
    lightning_stage: ClassVar[str] = "setup"
    #: its stage where the fit's strategy shards the model (FSDP) when that differs: a rung that must see
    #: the sharded modules applies once ``configure_model`` sharded them ("fit_start"); None: ``lightning_stage``
    lightning_stage_sharded: ClassVar[str | None] = None
    #: re-judged by the ladder's closing check once later rungs are kept on top of it (its gain may
    #: depend on them: a fused kernel pays in eager and may not under torch.compile)
    recheck: ClassVar[bool] = False
    #: whether the allocator's peak shows what the rung's configuration holds (a kept-on-memory decision needs it)
    memory_comparable: ClassVar[bool] = True
    memory_note: ClassVar[str] = ""
    #: its cost includes work each new input shape brings (compiling, searching algorithms, autotuning,
    #: capturing): where batch shapes vary, it is timed on batches each window draws anew, as a fit
    #: meets them, not on the batches an A/B block shares (see ``shapes_vary`` in :class:`speedkit.engine.timing.Timing`)
    new_shape_cost: ClassVar[bool] = False
    #: rungs with which it may pay where it does not alone (bf16 on a convnet pays with channels_last
    #: and compile, not in eager NCHW): reverted on speed with some of these, it is also tried together
    #: with them in the ladder's second look (every rung reverted on speed is tried again alone there)
    partners: ClassVar[tuple[str, ...]] = ()
    #: a rewrite of the model's code (the same function at any precision): its parity is also judged
    #: with the kept precision rungs off, where the envelope is narrow enough to show a defect that
    #: bf16's rounding would hide
    judged_at_full_precision: ClassVar[bool] = False
    #: it runs the model's own arithmetic another way, compiled or replayed (compile, a CUDA graph), and
    #: builds it again for every configuration: switched off while a rewrite is judged at full
    #: precision, which needs the rewrite's arithmetic alone (beneath compile on an H200 each
    #: configuration of that check had compiled anew, 20 s a graph for a Llama-class LM)
    off_at_full_precision: ClassVar[bool] = False
    #: it changes what compile traced (the model's code or modules, its inputs' shapes or layout, the
    #: numerics a graph is specialized on): beneath a kept compile its trial compiles anew, tens of
    #: seconds on a large model, so it is tried after the rungs that do not (see trial_order)
    recompiles: ClassVar[bool] = False
    #: it can change the step's speed only by changing its arithmetic (a precision: tf32, autocast): with
    #: a loss trajectory bit-identical to the one without it, no op ran at its precision, so it is
    #: reverted as inert without timing it (a comparison would time noise: on a 2-core CPU it "kept"
    #: tf32 at 1.19x [1.10, 1.29] in one run of three, when no matmul of the model took its path)
    acts_through_numerics: ClassVar[bool] = False
    #: it removes host work from the step (compile, a CUDA graph, a host sync): on a host-bound step it
    #: is tried first, and the other rungs are judged beneath it, where their device-side gain shows
    cuts_host_work: ClassVar[bool] = False
    #: all it can remove is time the device waits for the host (the loader, the garbage collector,
    #: launches, a sync): on a step that keeps the device busy it shows only once the device's work has
    #: shrunk, so there it is tried after the rungs that shrink it (compile included)
    host_side: ClassVar[bool] = False
    #: what it can cut, by which the plan (:mod:`speedkit.engine.plan`) bounds its gain from the
    #: diagnosis of the step (:mod:`speedkit.engine.diagnose`): "data_wait" (the step waiting for its
    #: batch), "host" (the device idle while the host issues work; on a CPU, the step's time outside its
    #: ops), "syncs" (the host waiting for the device), "memory" (device memory it frees), or a device
    #: category of :data:`speedkit.profile.categories.CATEGORIES` ("gemm", "attention", "normalization",
    #: "elementwise", "loss", "optimizer", "memcpy", "communication", "other"); "*": anything in the step,
    #: never bounded. A rung that says nothing may change anything.
    targets: ClassVar[tuple[str, ...]] = ("*",)
    #: rungs that must be in effect for it to work, where they apply (cuda_graph cannot capture a step
    #: that syncs: explicit_mask and async_progress_bar remove the syncs of training steps); the plan
    #: tries it with them
    needs: ClassVar[tuple[str, ...]] = ()
    #: of those, the rungs it cannot work without where they are in the stack: a configuration that has
    #: one of them off has it off too (cuda_graph stops for good on the sync explicit_mask removes, and
    #: cannot capture the micro-batches micro_batch merges); the others in ``needs`` help it, and it works
    #: without them (the progress bar's sync is the loop's, outside the captured step)
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()

    def check(self, state: TrainState) -> str | None:
        """Return ``None`` if the rung applies to ``state``, else a one-line reason why not."""
        return None

    def precision_in_play(self, state: TrainState) -> str | None:
        """The precision whose parity tolerance the baseline calibrates for this rung: ``precision``, or
        None where a cheap look (the device, an installed library) already rules the rung out, so that
        no calibration trajectory is run for a precision no rung can bring."""
        return self.precision

    def apply(self, state: TrainState) -> Handle:
        raise NotImplementedError

    def chosen(self) -> dict[str, Any] | None:
        """What its apply chose by measuring (loader settings, ...), as plain data kept with a cached
        decision, so that a re-check applies the same without measuring again; None: nothing measured."""
        return None

    def reuse(self, chosen: dict[str, Any]) -> None:
        """Take ``chosen`` (what :meth:`chosen` returned in the fit that made a cached decision) for its
        next apply instead of measuring; where it no longer fits, the rung measures as usual."""

    def parity_steps_needed(self) -> int:
        """Optimizer steps a parity trajectory needs to exercise the change (0: any number): the
        ladder runs every trajectory at least this long, so the steps compared are the changed ones."""
        return 0

    def batch_parity(self, state: TrainState, batches: int) -> Any:
        """Where its change makes the batches' samples draw other random numbers (data_path's worker count
        under a dataset that augments from the global RNG), what must not change, compared over the first
        ``batches`` batches of the loaders themselves: an object with ``passed``, ``failure`` (why not) and
        ``lines()`` (what was compared, and what was not), which the ladder judges beside the loss
        trajectory, whose parity batches are drawn once and never show the change. None (the default):
        the change leaves every sample as it was."""
        return None

    def options_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.options)

    def __repr__(self) -> str:
        opts = self.options_dict()
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in opts.items())})"


class RewriteRung(Rung):
    """A rung that rewrites the model's source over :mod:`speedkit.rewrite.pipeline`: ``check`` makes
    its plan (``make_plan``) and asks ``why_not`` of it; ``apply`` applies the plan ``check`` made
    (``apply_plan``), made again only if the model changed since."""

    judged_at_full_precision = True
    recompiles = True

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._plans = PlanCache()

    def make_plan(self, model: nn.Module) -> RewritePlan:
        raise NotImplementedError

    def why_not(self, plan: RewritePlan) -> str | None:
        """The reason the plan changes nothing, or None."""
        raise NotImplementedError

    def apply_plan(self, model: nn.Module, plan: RewritePlan) -> Handle:
        raise NotImplementedError

    def plan(self, model: nn.Module) -> RewritePlan:
        return self._plans.plan(model, self.options, lambda: self.make_plan(model))

    def check(self, state: TrainState) -> str | None:
        return self.why_not(self.plan(state.model))

    def apply(self, state: TrainState) -> Handle:
        return self.apply_plan(state.model, self.plan(state.model))


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def active_dropouts(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where ``model`` drops something at random, as (module, attribute holding the rate) pairs: dropout
    modules with p > 0 (``"p"``), and the rates models keep as plain floats on a module and pass to a
    kernel themselves (an attribute whose name holds "drop": Hugging Face's T5 attention keeps
    ``self.dropout`` and Llama's ``self.attention_dropout`` for SDPA's ``dropout_p``, timm's DropPath
    its ``drop_prob``, a LayerDrop rate). Where a rung draws its masks differently
    (``Handle.draws_differently``: compile, a fused attention, autocast on CUDA) trajectories differ by
    design while any of them is on."""
    found: list[tuple[nn.Module, str]] = []
    for m in model.modules():
        if isinstance(m, _DROPOUTS):
            if m.p > 0:
                found.append((m, "p"))
            continue
        found.extend(
            (m, name)
            for name, value in vars(m).items()
            if type(value) is float and value > 0 and "drop" in name.lower() and not name.startswith("_")
        )
    return found


__all__ = [
    "AttributeWrapper",
    "Handle",
    "NoOptions",
    "RewriteRung",
    "Rung",
    "active_dropouts",
    "check_value",
    "nested",
    "parse_options",
    "set_attr",
]
