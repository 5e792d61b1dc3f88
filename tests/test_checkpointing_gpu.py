"""On a real GPU: activation checkpointing through CUDA graphs and compile (issue 57). A step whose
blocks are recomputed in the backward (``torch.utils.checkpoint``, both forms, dropout included) is
captured whole and matches eager; the zoo's Llama with the library's checkpointing switch goes
through compile and cuda_graph in a Lightning fit, or the rung says why not."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from test_cuda_graph_gpu import _Record
from torch import nn
from torch.utils.checkpoint import checkpoint

from speedkit import rungs
from speedkit.cudagraph.graphed_step import GraphedStep
from speedkit.lightning import SpeedLadder
from speedkit.training.state import TrainState
from speedkit.training.step import PlainStep

pytestmark = pytest.mark.gpu


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, dropout: float, checkpointed: bool = True) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 64)  # the checkpointed blocks' input needs gradients, as after an embedding
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(dropout), nn.Linear(256, 64)) for _ in range(3)
        )
        self.head, self.reentrant, self.checkpointed = nn.Linear(64, 10), reentrant, checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=self.reentrant) if self.checkpointed else block(x))
        return self.head(x)


def _loss(model: nn.Module, batch, batch_idx: int) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _run(graphed: bool, reentrant: bool, dropout: float, steps: int = 12, checkpointed: bool = True):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = _Checkpointed(reentrant, dropout, checkpointed).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    step = PlainStep(model, opt, "cuda", loss_fn=_loss)
    state = TrainState(model=model, optimizer=opt, device=torch.device("cuda"), step=step)
    if graphed:
        rungs.make("cuda_graph").apply(state)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()) for _ in range(steps)]
    losses = [float(state.step([b], i)) for i, b in enumerate(batches)]
    return losses, [p.detach().clone() for p in model.parameters()], state.step


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_step_is_captured_whole_and_matches_eager(reentrant):
    eager_losses, eager_params, _ = _run(False, reentrant, 0.0)
    losses, params, step = _run(True, reentrant, 0.0)
    assert isinstance(step, GraphedStep) and step.stopped is None, step.report()
    assert step.captures == 1 and step.replays == 12 - step.warmup, step.report()
    for a, b in zip(losses, eager_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, eager_losses)
    worst = max(float((p - q).abs().max() / q.abs().max().clamp_min(1e-12)) for p, q in zip(params, eager_params))
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_a_checkpointed_step_with_dropout_trains_as_the_same_model_without_checkpointing(graphed):
    """With dropout in a recomputed block the recomputation must draw the forward's masks again
    (checkpoint's preserve_rng_state puts the generator back for it, then where it was): the
    checkpointed model then trains exactly as the same model without checkpointing, eagerly and
    replayed from a CUDA graph (the device generator's graph-safe state). A mask drawn anew would give
    other gradients, which parity (judged with dropout off) would not see."""
    losses, params, step = _run(graphed, False, 0.1, steps=16)
    plain_losses, plain_params, _ = _run(graphed, False, 0.1, steps=16, checkpointed=False)
    if graphed:
        assert isinstance(step, GraphedStep) and step.stopped is None and step.replays >= 10, step.report()
    for a, b in zip(losses, plain_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, plain_losses)
    worst = max(float((p - q).abs().max() / q.abs().max().clamp_min(1e-12)) for p, q in zip(params, plain_params))
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("given", [["cuda_graph"], ["compile", "cuda_graph"]], ids=["graph", "compile+graph"])
def test_the_zoo_llama_with_the_librarys_checkpointing_goes_through_compile_and_cuda_graph_or_says_why(given):
    from speedkit.demos.zoo import ZOO

    torch._dynamo.reset()
    torch.backends.cuda.matmul.allow_tf32 = False

    def fit(callbacks: list) -> _Record:
        pl.seed_everything(0, verbose=False)
        module, loader = ZOO["hf-llama-ckpt"].build("tiny")
        record = _Record()  # the losses, and the step the ladder left in effect (the graph)
        trainer = pl.Trainer(
            max_steps=12,
            accelerator="gpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*callbacks, record],
        )
        trainer.fit(module, train_dataloaders=loader)
        on = getattr(module.model, "is_activation_checkpointing", None)
        assert (on if on is not None else module.model.is_gradient_checkpointing) is True
        return record

    eager = fit([])
    ladder = SpeedLadder(rungs=given)
    record = fit([ladder])
    if "cuda_graph" in ladder.skipped:  # the rung said why not, before the fit
        print("hf-llama-ckpt cuda_graph:", ladder.skipped["cuda_graph"])
        assert ladder.skipped["cuda_graph"]
        return
    graph = record.graph
    assert isinstance(graph, GraphedStep)
    if graph.stopped is not None:  # a sync in the step: named with its file and line
        print("hf-llama-ckpt cuda_graph stopped:", graph.stopped)
        assert ".py:" in graph.stopped, graph.stopped
        return
    assert graph.replays > 0, graph.report()
    print(f"hf-llama-ckpt {'+'.join(given)}: captured, {graph.replays} replays")
    # capturable AdamW (the graph needs it) rounds its bias correction on the device; compiled kernels reorder sums
    tolerance = 1e-4 if given == ["cuda_graph"] else 2e-3
    for a, b in zip(record.losses, eager.losses):
        assert abs(a - b) <= tolerance * abs(b), (record.losses, eager.losses)
