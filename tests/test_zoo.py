"""The model zoo under SpeedLadder trials in the user's own (CPU) Trainer: every model at its tiny
size, the default ladder but triton_layers, each rung decided without failing, and nothing of the
trials left behind.

Per-model expectations live in one table, :data:`EXPECT`; every zoo model must have an entry. A
known speedkit bug a model runs into is written there too, narrowly: the test it fails, marked
``xfail(strict=True)`` so a fix shows; or the one rung it may make fail, by that bug's error alone,
beside a strict xfail test that reproduces the bug.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import tensors_holding_a_graph
from test_lightning import _model_fingerprint

from speedkit import compat
from speedkit.data.batch import count_items
from speedkit.data.workers import worker_dependence
from speedkit.demos.zoo import ZOO
from speedkit.lightning import SpeedLadder
from speedkit.results import LadderResult
from speedkit.rungs import make as make_rung
from speedkit.rungs.compile import GuardedForward


def _pinned() -> dict[str, str]:
    """The test extra's exact pins (pyproject.toml), by library: the versions whose behaviour these tests assert."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()  # tomllib is Python 3.11's; we support 3.10
    test_extra = text[text.index("\ntest = [") : text.index("]", text.index("\ntest = ["))]
    return dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', test_extra))


#: the versions of the zoo's libraries whose behaviour these tests assert (graph breaks, attention switches);
#: a test failing under another version names both
PINNED = _pinned()


def _version(library: str) -> str:
    from importlib.metadata import version

    return version(library)


#: the ladder tried on every model: the default one, cheap on a CPU (no triton_layers, which runs in Triton's
#: interpreter here; compile traces with Dynamo without generating code)
LADDER: list[Any] = [
    "tf32",
    "autocast",
    "fused_optimizer",
    "sdpa",
    "batched",
    "channels_last",
    "cudnn_benchmark",
    {"name": "compile", "options": {"backend": "eager"}},
]
#: small and quick: the decisions are not what these tests are about
QUICK = {
    "warmup": 1,
    "steps": 1,
    "repeats": 2,
    "parity_steps": 2,
    "min_blocks": 2,
    "max_blocks": 2,
    "settle": 0,
    "budget_s": 60.0,
    "window_s": 0.02,  # windows of the fewest steps: every phase runs, none long
    "min_window_steps": 1,
    "holds_windows": 1,
    "telemetry": False,
}
MAX_STEPS = 3
#: what any rung may end as
DECIDED = {"kept", "reverted", "not_applicable"}
#: rungs that may bind a new ``forward`` to module instances
FORWARD_RUNGS = {"sdpa", "compile", "batched", "triton_layers"}


@dataclass
class Fit:
    """One finished fit with trials: what the checks of a model's :class:`Expect` receive."""

    module: pl.LightningModule
    trainer: pl.Trainer
    ladder: SpeedLadder
    result: LadderResult
    probe: Probe


@dataclass(frozen=True)
class Expect:
    """What the trials must show on one zoo model, beyond what every model must.

    Attributes:
        options: module options for the zoo's builder (e.g. ``attn_implementation="eager"``).
        statuses: per rung, the statuses it may end as (default: :data:`DECIDED`).
        check: more assertions on the finished :class:`Fit`.
        bugs: per test of this file (its function's name), a known speedkit bug the model makes it fail
            by: that test is marked ``xfail(strict=True)`` for the model, so a fix shows as an XPASS.
        workers: the tiny loader's ``num_workers`` (none, but where the loader's workers are the model's point).
    """

    options: dict[str, Any] = field(default_factory=dict)
    statuses: dict[str, set[str]] = field(default_factory=dict)
    check: Callable[[Fit], None] | None = None
    bugs: dict[str, str] = field(default_factory=dict)
    workers: int = 0


def _entry(fit: Fit, name: str) -> Any:
    return next(r for r in fit.result.rungs if r.name == name)


def compiled(label: str, breaks: bool = True) -> Callable[[Fit], None]:
    """compile applied to ``label`` (e.g. "model (GPT2LMHeadModel)"), which the step ran: frames of
    the inner model compiled (counted by Dynamo, read through speedkit.compat); ``breaks=False``: and
    no graph break."""

    def check(fit: Fit) -> None:
        entry = _entry(fit, "compile")
        assert entry.status in ("kept", "reverted") and entry.parity.passed, entry.reason
        ran = [line for line in entry.changes if line.startswith(f"ran {label}.forward: ")]
        assert ran, entry.changes
        calls, graphs = (int(ran[0].split(": ")[1].split(" calls")[0]), int(ran[0].split(", ")[1].split(" graphs")[0]))
        assert calls > 0 and (graphs > 0 or "compile cache" in ran[0]), ran[0]
        assert any(line.startswith("graph breaks:") for line in entry.changes)
        if not breaks:  # a library's behaviour: as of the version the test extra pins (pyproject.toml)
            assert "graph breaks: none" in entry.changes, (
                f"graph breaks under transformers {_version('transformers')} (none as of {PINNED.get('transformers', 'no pin')}, "
                f"the test extra's pin): {entry.changes}"
            )

    return check


def checkpointing_kept(fit: Fit) -> None:
    """The library's activation checkpointing is as the user turned it on, through the trials and after."""
    model = fit.module.model
    on = getattr(model, "is_activation_checkpointing", None)
    assert (on if on is not None else model.is_gradient_checkpointing) is True


def manual_optimization(fit: Fit) -> None:
    """Trials ran the module's own training_step (two optimizers): fused_optimizer switched both."""
    assert fit.result.run["optimization"] == "manual" and fit.result.run["optimizer"] == "Adam, Adam"
    fused = _entry(fit, "fused_optimizer")
    assert fused.status in ("kept", "reverted") and fused.parity.passed, fused.reason
    assert sum(c.startswith(("optimizer 0 of 2: Adam", "optimizer 1 of 2: Adam")) for c in fused.changes) == 2


def hf_switched(label: str) -> Callable[[Fit], None]:
    """The sdpa rung switched the Hugging Face model from eager to sdpa through the library; parity held."""

    def check(fit: Fit) -> None:
        entry = _entry(fit, "sdpa")
        assert entry.status in ("kept", "reverted") and entry.parity.passed, entry.reason
        assert any(line.startswith(f"Hugging Face {label}: attn_implementation 'eager' -> 'sdpa'") for line in entry.changes)

    return check


def both(*checks: Callable[[Fit], None]) -> Callable[[Fit], None]:
    def check(fit: Fit) -> None:
        for one in checks:
            one(fit)

    return check


#: transformers' collators (DataCollatorWithPadding among them) return a BatchEncoding: a Mapping, not a dict
#: Lightning refuses gradient clipping under mixed precision with an optimizer that unscales its own gradients (a fused
#: one, bf16 too); speedkit's fused_optimizer rung looks only at the Trainer's gradient_clip_val, not at clipping in the
#: module's own configure_gradient_clipping: where autocast was kept before it, the rung fails (see the test below)
_EAGER = {
    "attn_implementation": "eager"
}  # as transformers < 5 built models from configs, and code reading attention weights does
EXPECT: dict[str, Expect] = {
    "hf-gpt2": Expect(
        options=_EAGER,
        statuses={"sdpa": {"kept", "reverted"}},
        check=both(hf_switched("GPT2LMHeadModel"), compiled("model (GPT2LMHeadModel)")),
    ),
    "hf-llama": Expect(
        options=_EAGER,
        statuses={"sdpa": {"kept", "reverted"}},
        check=both(hf_switched("LlamaForCausalLM"), compiled("model (LlamaForCausalLM)")),
    ),
    "hf-bert-mlm": Expect(
        options=_EAGER,
        statuses={"sdpa": {"kept", "reverted"}},
        check=both(hf_switched("BertForMaskedLM"), compiled("model (BertForMaskedLM)")),
    ),
    "timm-vit": Expect(check=compiled("model (VisionTransformer)")),
    "timm-convnext": Expect(statuses={"channels_last": {"kept", "reverted"}}, check=compiled("model (ConvNeXt)")),
    "tv-resnet50": Expect(statuses={"channels_last": {"kept", "reverted"}}, check=compiled("model (ResNet)")),
    "lightning-transformer": Expect(check=compiled("LightningDemoTransformer")),  # its step calls self(...)
    # hand-written causal attention: sdpa applies; the step calls self(...), so the module's own forward is compiled
    "nanogpt": Expect(statuses={"sdpa": {"kept", "reverted"}}, check=compiled("NaiveGPT")),
    # timm's own scheduler (stepped through lr_scheduler_step), SGD in two parameter groups, depthwise convolutions
    "timm-mobilenetv3": Expect(statuses={"channels_last": {"kept", "reverted"}}, check=compiled("model (MobileNetV3)")),
    "hf-t5": Expect(
        options=_EAGER,
        statuses={"sdpa": {"kept", "reverted"}},
        check=both(hf_switched("T5ForConditionalGeneration"), compiled("model (T5ForConditionalGeneration)")),
    ),
    # batches padded per batch by DataCollatorWithPadding: a BatchEncoding of a new length every batch
    "hf-bert-cls": Expect(
        options=_EAGER,
        statuses={"sdpa": {"kept", "reverted"}},
        check=both(hf_switched("BertForSequenceClassification"), compiled("model (BertForSequenceClassification)")),
    ),
    # tied embedding and decoder, clipping in configure_gradient_clipping, a plateau schedule the trials do not step
    "lstm-lm": Expect(check=compiled("model (RNNModel)")),
    # data-bound: float images decoded and augmented per sample in the training process (no loader workers)
    "tv-resnet18-augment": Expect(statuses={"channels_last": {"kept", "reverted"}}, check=compiled("model (ResNet)")),
    # data-bound as users write it: torchvision's transforms drawing from the global RNG in the loader's 2 workers
    "tv-resnet18-randaug": Expect(statuses={"channels_last": {"kept", "reverted"}}, check=compiled("model (ResNet)"), workers=2),
    # the library's activation checkpointing on: compiled whole, the recomputation traced with the layers
    "hf-llama-ckpt": Expect(
        options=_EAGER,
        statuses={"sdpa": {"kept", "reverted"}},
        check=both(hf_switched("LlamaForCausalLM"), compiled("model (LlamaForCausalLM)", breaks=False), checkpointing_kept),
    ),
    # manual optimization: two optimizers stepped in training_step; both nets the step calls are compiled
    "dcgan": Expect(
        check=both(compiled("generator (Sequential)"), compiled("discriminator (Sequential)"), manual_optimization),
    ),
}


def _models(test: str) -> list[Any]:
    """Every zoo model, as the parameters of ``test``; a known bug (:attr:`Expect.bugs`) marks its model's xfail."""
    return [
        pytest.param(name, marks=pytest.mark.xfail(raises=AssertionError, strict=True, reason=EXPECT[name].bugs[test]))
        if test in EXPECT[name].bugs
        else name
        for name in ZOO
    ]


class Probe(pl.Callback):
    """The optimizer's implementation flags when the fit starts (before the trials), and the flags
    and each module's instance ``forward`` at the first real training step (after them)."""

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None
        self.flags_before: list[tuple[Any, Any]] = []
        self.flags_training: list[tuple[Any, Any]] | None = None
        self.forwards_training: dict[str, Any] | None = None
        #: tensors alive at the first real step that hold an autograd graph (a trial step's, kept past
        #: the trials: its AccumulateGrad nodes stay the parameters' own, with the stream each was made on)
        self.graphs_training: list[str] | None = None
        self.batches = 0  # training batches the fit ran

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.optimizer = trainer.optimizers[0]
        self.flags_before = _flags(self.optimizer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches += 1
        if self.flags_training is None:
            self.flags_training = _flags(trainer.optimizers[0])
            self.forwards_training = _forwards(pl_module)
            self.graphs_training = tensors_holding_a_graph()


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a busy two-core machine every op of a tiny model otherwise waits for a
    second OpenMP thread that does not get a core (ten times slower and more)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pickles(module: torch.nn.Module) -> bool:
    """``torch.save`` takes the whole module (nothing unpicklable is bound to it)."""
    try:
        torch.save(module, io.BytesIO())
    except (AttributeError, TypeError, RuntimeError, pickle.PicklingError):
        return False
    return True


def _flags(optimizer: torch.optim.Optimizer) -> list[tuple[Any, Any]]:
    return [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]


def _forwards(module: torch.nn.Module) -> dict[str, Any]:
    return {name: m.__dict__["forward"] for name, m in module.named_modules() if "forward" in m.__dict__}


def _library_attrs(module: pl.LightningModule) -> dict[str, set[str]]:
    """The instance attributes of every module below the LightningModule (Lightning sets its own on that one)."""
    return {name: set(m.__dict__) for name, m in module.named_modules() if name}


def _global_flags() -> tuple[Any, ...]:
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def _rung_name(spec: Any) -> str:
    return spec if isinstance(spec, str) else spec["name"]


def test_every_zoo_model_has_expectations():
    assert set(EXPECT) == set(ZOO) and len(ZOO) >= 8
    assert len({m.library for m in ZOO.values()} - {"speedkit"}) >= 4


@pytest.mark.parametrize("name", _models("test_tiny_build_is_seeded_and_yields_its_batch_size_in_its_unit"))
def test_tiny_build_is_seeded_and_yields_its_batch_size_in_its_unit(name):
    entry = ZOO[name]
    pytest.importorskip(entry.library)
    (first, loader), (second, again) = entry.build("tiny"), entry.build("tiny")
    torch.testing.assert_close(first.state_dict(), second.state_dict(), rtol=0, atol=0)
    torch.manual_seed(1)  # the shuffle's order, as seed_everything sets it
    batch = next(iter(loader))
    torch.manual_seed(1)
    torch.testing.assert_close(batch, next(iter(again)), rtol=0, atol=0)
    items, unit = count_items(batch, entry.unit)
    assert unit == f"{entry.unit}/s" and count_items(batch)[1] == unit  # the ladder's "auto" counts the same
    assert items % entry.batch_size["tiny"] == 0 and loader.batch_size == entry.batch_size["tiny"]
    assert loader.num_workers == EXPECT[name].workers


@pytest.mark.parametrize("name", _models("test_trials_on_a_zoo_model_decide_every_rung_and_leave_nothing_behind"))
def test_trials_on_a_zoo_model_decide_every_rung_and_leave_nothing_behind(name):
    entry, expect = ZOO[name], EXPECT[name]
    pytest.importorskip(entry.library)
    # Dynamo's recompile limit counts per code object across the process: what earlier tests compiled of a
    # library's forward must not leave this model's trials without room to compile (each test its own process, as a run)
    torch._dynamo.reset()
    module, loader = entry.build("tiny", **expect.options)
    before, attrs_before, flags_before = _model_fingerprint(module), _library_attrs(module), _global_flags()
    pickled_before = _pickles(module)  # a library's own hook may hold a closure (transformers' checkpointing does)
    ladder, probe = SpeedLadder(LADDER, trials="always", measure=QUICK), Probe()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=MAX_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ladder, probe],
    )
    trainer.fit(module, train_dataloaders=loader)

    # the ladder ran in the user's Trainer, one entry per rung, each decided
    result = ladder.result
    assert result is not None and ladder.not_run is None and ladder.exception is None and result.interrupted is None
    assert result.run["precision"] == "32-true"
    # trials took no real step (under manual optimization each batch steps every optimizer once)
    if module.automatic_optimization:
        assert trainer.global_step == MAX_STEPS
    else:
        assert trainer.global_step == probe.batches * len(trainer.optimizers) >= MAX_STEPS
    entries = [r for r in result.rungs[1:] if r.status not in ("closing", "switches")]  # second looks; the switches floor
    # every rung decided once, in the plan's order: the user's switches first (the floor, in the ladder's
    # order), then the diagnosed step's remedy, then the ladder's order
    names, ladder_names = [r.name for r in entries], [_rung_name(s) for s in LADDER]
    assert sorted(names) == sorted(ladder_names) and len(set(names)) == len(names)
    floor = [r.name for r in entries if (r.reason or "").startswith("one of the user's switches")]
    assert names[: len(floor)] == [n for n in ladder_names if n in floor]
    tried_first = result.run.get("first_tried", "")  # "device-bound: batched, aligned_linear first (its remedy)"
    remedy = set(tried_first.split(": ", 1)[1].split(" first")[0].split(", ")) if tried_first else set()
    first = [n for n in names if n in remedy and n not in floor]
    # the others in the ladder's order, except that beneath compile the rungs that compile anew go after
    # those that do not, each part in its order (a rung that does not apply, or is not worth timing, is said
    # so where the plan found it: left out here)
    tried = {r.name for r in entries if r.status != "not_applicable"}
    rest = [n for n in ladder_names if n not in first and n not in floor and n in tried]
    if "compile" in floor:
        recompiles = {n: make_rung(n).recompiles for n in rest}
        rest = [n for n in rest if not recompiles[n]] + [n for n in rest if recompiles[n]]
    assert [n for n in names[len(floor) :] if n in rest] == rest
    for r in entries:
        assert r.status in expect.statuses.get(r.name, DECIDED), f"{r.name}: {r.status} ({r.reason})"
        if r.measurement is not None:
            assert r.parity is not None and r.parity.passed, f"{r.name}: {r.parity}"
    json.dumps(result.to_dict())

    # during training: exactly the kept rungs were on at its first step (a fit check that went back to the
    # floor undid the rungs on top later, inside the fit: they were on until then)
    back = result.run.get("fit_check_vs_floor", {})
    kept = {r.name for r in result.kept} | set(back.get("undone", []) if back.get("back_to_the_floor") else [])
    if back.get("back_to_the_floor"):
        assert not set(back["undone"]) & {r.name for r in result.kept} and not back["failed"]
    assert (probe.flags_training != probe.flags_before) == ("fused_optimizer" in kept)
    assert probe.graphs_training == [], probe.graphs_training  # no trial step's graph lives into the fit
    had_forward = {k for k, attrs in before["instance"].items() if "forward" in attrs}
    new = {k: v for k, v in probe.forwards_training.items() if k not in had_forward}
    if not kept & FORWARD_RUNGS:
        assert not new, sorted(new)
    assert any(isinstance(f, GuardedForward) for f in new.values()) == ("compile" in kept)
    sdpa_changes = next((r.changes for r in entries if r.name == "sdpa"), [])
    rewrote_attention = any("attn_implementation" not in c and not c.startswith("note:") for c in sdpa_changes)
    if "sdpa" in kept and rewrote_attention:  # a library's own switch (Hugging Face) rebinds no forward
        assert any(not isinstance(f, GuardedForward) for f in new.values())

    # after the fit: everything back
    after = _model_fingerprint(module)
    assert after["ids"] == before["ids"] and after["classes"] == before["classes"]
    assert after["instance"] == before["instance"] and _library_attrs(module) == attrs_before
    assert _flags(probe.optimizer) == probe.flags_before and _global_flags() == flags_before
    assert _pickles(module) == pickled_before
    if expect.check is not None:
        expect.check(Fit(module, trainer, ladder, result, probe))


@pytest.mark.skipif(  # the CPU's own instructions, not SPEEDKIT_CPU_BF16's answer: oneDNN needs them
    not compat.cpu_bf16_instructions(),
    reason="oneDNN runs no bf16 LSTM on a CPU without bf16 instructions "
    '("could not create a primitive descriptor for the LSTM forward"); on CUDA the zoo runs it',
)
def test_fused_optimizer_under_autocast_keeps_the_modules_own_clipping_working(bf16_cpu):
    """The word-language LSTM clips in ``configure_gradient_clipping``. Under the autocast rung's bf16
    plugin a fused optimizer clips and trains (nothing is scaled). Under Lightning's own mixed
    precision, which refuses to clip for an optimizer that unscales its own gradients, a fused
    optimizer is left out, with the reason, rather than break the fit."""
    for precision, rungs in (("32-true", ["autocast", "fused_optimizer"]), ("bf16-mixed", ["fused_optimizer"])):
        module, loader = ZOO["lstm-lm"].build("tiny")
        ladder = SpeedLadder(rungs, trials=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=2,
            precision=precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ladder],
        )
        trainer.fit(module, train_dataloaders=loader)
        assert trainer.global_step == 2
        changes = " ".join(ladder.applied_changes.get("fused_optimizer", [])) + ladder.skipped.get("fused_optimizer", "")
        if precision == "32-true":
            assert "autocast" in ladder.applied_changes and "SGD: fused implementation" in changes, changes
        else:  # foreach instead of fused, or nothing, and why
            assert "configure_gradient_clipping" in changes, changes


def test_the_augmented_images_are_decoded_per_sample_by_a_hurried_users_loader():
    """tv-resnet18-augment: its loader as a hurried user leaves it (no workers, pageable memory, workers
    not kept); every sample a JPEG decoded and augmented anew, drawn from its own index's generator, so
    that the same picture comes out differently at another index and loader workers would change no
    sample (data_path may give it some)."""
    pytest.importorskip("torchvision")
    _, loader = ZOO["tv-resnet18-augment"].build("tiny")
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers) == (0, False, False)
    dataset = loader.dataset
    image, label = dataset[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label < 10
    torch.testing.assert_close(dataset[0], (image, label), rtol=0, atol=0)
    assert not torch.equal(dataset[len(dataset.jpegs)][0], image)  # the same JPEG, another crop, flip and jitter
    assert worker_dependence(dataset) is None


def test_the_randaug_images_are_augmented_as_torchvisions_documentation_writes_it():
    """tv-resnet18-randaug: torchvision's v2 transforms (RandomResizedCrop, RandomHorizontalFlip, ToDtype,
    Normalize) drawing from the global torch RNG, no per-sample seed, in a loader of 2 workers as torchvision's
    documentation writes it; so another worker count draws other augmentations (from the RNG each worker seeds)
    for the same index and the same label, which data_path may choose by default and keeps with exact: true."""
    pytest.importorskip("torchvision")
    from torchvision.transforms import v2

    _, loader = ZOO["tv-resnet18-randaug"].build("tiny")
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers) == (2, False, False)
    dataset = loader.dataset
    assert [type(t) for t in dataset.transform.transforms] == [
        v2.RandomResizedCrop,
        v2.RandomHorizontalFlip,
        v2.ToDtype,
        v2.Normalize,
    ]
    torch.manual_seed(0)
    image, label = dataset[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label < 10
    again, same_label = dataset[0]  # the RNG moved on: another crop of the same image, the same label
    assert same_label == label and not torch.equal(again, image)
    torch.manual_seed(0)
    assert torch.equal(dataset[0][0], image)  # the global RNG's draws, nothing else
    dependence = worker_dependence(dataset)
    assert dependence.draws == ("torch",) and dependence.worker_seeded


def test_the_augmented_images_crop_box_is_random_resized_crops():
    """The crop box of torchvision's ``RandomResizedCrop`` (8-100% of the area, aspect 3/4-4/3) inside
    the image; where ten tries find none (an image far wider than 4/3), its central crop at aspect 4/3."""
    pytest.importorskip("torchvision")
    from speedkit.demos.zoo import _AugmentedJpegSamples

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        top, left, h, w = _AugmentedJpegSamples._crop_box(300, 400, g)
        assert 0 <= top <= 300 - h and 0 <= left <= 400 - w
        assert 0.07 <= h * w / (300 * 400) <= 1.01 and 0.74 <= w / h <= 1.35, (h, w)
    assert _AugmentedJpegSamples._crop_box(2, 100, g) == (0, 48, 2, 3)


def test_the_zoo_imports_without_the_model_libraries():
    code = (
        "import sys\n"
        "import lightning.pytorch  # which imports some of them where installed, for its own integrations\n"
        "sys.modules.update(dict.fromkeys(('transformers', 'timm', 'torchvision')))  # now they fail to import\n"
        "from speedkit.demos.zoo import ZOO\n"
        "ZOO['nanogpt'].build('tiny')\n"
        "from speedkit.errors import ConfigError\n"
        "try:\n    ZOO['timm-vit'].build('tiny')\nexcept ConfigError as exc:\n"
        "    print('ok' if 'is built with timm, which is not installed' in str(exc) else exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_zoo_model_whose_library_is_missing_names_how_to_install_it(monkeypatch):
    """The demo's install has torch alone: the shipped tv-resnet50-ddp recipe met a bare "No module
    named 'torchvision'"."""
    import importlib

    from speedkit.demos.zoo import TorchvisionResNet50
    from speedkit.errors import ConfigError

    real = importlib.import_module

    def without_torchvision(name, *args, **kwargs):
        if name == "torchvision":
            raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", without_torchvision)
    with pytest.raises(ConfigError, match=r"^model: TorchvisionResNet50 is built with torchvision, which is not installed"):
        TorchvisionResNet50(size="tiny")
