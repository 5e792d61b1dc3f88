"""fused_lm_head: the LM head and cross-entropy in one chunked op equal ``cross_entropy(lm_head(h).float())``
(loss and every gradient, fp32 1e-5 relative; bf16 within autocast's own error) on an odd vocabulary
(50257), ignore-index labels, tied weights, a bias, label smoothing and chunks that do not divide the
tokens, through Triton's interpreter (conftest) and PyTorch's ops; traced by torch.compile without a
graph break. The rung finds the head and loss of transformers' GPT-2 and Llama (tiny, built from
configs), trains them to the model's own loss and gradients, returns logits=None while training on
labels and the model's own output otherwise, and leaves alone what it cannot stand in for, saying why."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel_close
from torch import nn

from speedkit.handle import Handle
from speedkit.kernels import linear_cross_entropy as lce
from speedkit.kernels.linear_cross_entropy import chunk_rows, linear_cross_entropy, reference
from speedkit.rewrite import hf_loss, lm_head
from speedkit.rungs.fused_lm_head import FusedLMHeadRung, logits_readers
from speedkit.training.state import TrainState

TOL = 1e-5


def _grads(loss_fn, *tensors):
    loss = loss_fn()
    return loss, torch.autograd.grad(loss * 1.7, [t for t in tensors if t is not None])


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """The chunk's loss and gradient from the Triton kernel (interpreted on CPU) or from PyTorch's ops."""
    if request.param == "torch":
        monkeypatch.setattr(lce, "runs_triton", lambda t: False)
    else:
        pytest.importorskip("triton")
    return request.param


@pytest.mark.parametrize(
    "n, hidden, vocab, bias, chunk, reduction, smoothing",
    [
        (37, 24, 50257, False, 16, "mean", 0.0),  # GPT-2's vocabulary, 3 chunks, the last one short
        (29, 16, 1001, True, 8, "sum", 0.0),
        (33, 16, 999, True, None, "mean", 0.1),
    ],
)
def test_equals_the_head_and_loss_in_fp32(path, n, hidden, vocab, bias, chunk, reduction, smoothing):
    gen = torch.Generator().manual_seed(n)
    h = torch.randn(n, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.1).requires_grad_()
    b = torch.randn(vocab, generator=gen).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=gen)
    t[::5] = -100
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    got, got_grads = _grads(lambda: linear_cross_entropy(h, w, t, b, chunk=chunk, **kw), h, w, b)
    want, want_grads = _grads(lambda: reference(h, w, t, b, **kw), h, w, b)
    assert got.dtype == torch.float32
    assert_rel_close(got, want, TOL, "loss")
    for name, g, e in zip(("h", "weight", "bias"), got_grads, want_grads):
        assert g.dtype == e.dtype
        assert_rel_close(g, e, TOL, f"d{name}")


def test_tied_weights_and_3d_hidden_states(path):
    """The head's weight is the embedding's (GPT-2's tying): both uses' gradients reach the one parameter."""
    gen = torch.Generator().manual_seed(1)
    emb = nn.Embedding(211, 32)
    ids = torch.randint(0, 211, (3, 11), generator=gen)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100

    def loss(fused: bool) -> torch.Tensor:
        h = torch.tanh(emb(ids))
        if fused:
            return linear_cross_entropy(h, emb.weight, labels, chunk=8)
        return reference(h, emb.weight, labels)

    got, (g_got,) = _grads(lambda: loss(True), emb.weight)
    want, (g_want,) = _grads(lambda: loss(False), emb.weight)
    assert_rel_close(got, want, TOL, "loss")
    assert_rel_close(g_got, g_want, TOL, "tied weight")


def test_bf16_within_autocasts_own_error(path):
    """Under bf16 autocast the fused op's error against fp32 is no larger than the model's own
    (``lm_head(h).float()`` under autocast) against fp32, give or take a factor of 2: the same rounding
    of the logits, the weight gradient summed in fp32 over the chunks instead of in one bf16 GEMM."""
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(45, 48, generator=gen).requires_grad_()
    w = (torch.randn(2003, 48, generator=gen) * 0.05).requires_grad_()
    t = torch.randint(0, 2003, (45,), generator=gen)
    t[::7] = -100
    exact, exact_grads = _grads(lambda: reference(h, w, t), h, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_grads = _grads(lambda: linear_cross_entropy(h, w, t, chunk=16), h, w)
        own, own_grads = _grads(lambda: reference(h, w, t), h, w)
    for g, o, e in zip((got, *got_grads), (own, *own_grads), (exact, *exact_grads)):
        assert g.dtype == e.dtype  # the gradients reach h and the weight in their own dtype (fp32)
        own_error = max((o.double() - e.double()).norm().item() / e.double().norm().item(), 1e-6)
        assert_rel_close(g, e, 2 * own_error, "bf16 against fp32")


def test_no_gradient_without_grad_mode_and_a_clear_error_on_backward():
    h = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(13, 8, requires_grad=True)
    t = torch.randint(0, 13, (5,))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t)
    assert_rel_close(loss, reference(h, w, t).detach(), TOL)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="expected h"):
        linear_cross_entropy(h, w, t[:4])


def test_chunk_rows_bounds_one_chunks_logits():
    assert chunk_rows(16384, 50257) == 2048  # 2^27 elements / 50257 → 2670 → 2048 rows: 8 chunks
    assert chunk_rows(100, 50257) == 100
    assert chunk_rows(10_000, 10**9) == 64  # never under 64 rows
    assert chunk_rows(10, 50, chunk=4) == 4


def test_every_gemm_of_an_odd_vocabulary_runs_on_aligned_rows(monkeypatch):
    """GPT-2's 50257 gave each chunk's logits an odd row stride, and cuBLAS ran the op's three GEMMs on
    slow unaligned kernels (3.6x the compiled model's own head on an H100): every matrix the op multiplies
    has rows a multiple of 16 bytes apart, and the padded vocabulary changes nothing computed."""
    seen = []

    def recording(gemm):
        def record(*args, **kwargs):
            mats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() == 2]
            seen.extend((tuple(m.shape), m.stride(), m.element_size()) for m in mats)
            return gemm(*args, **kwargs)

        return record

    monkeypatch.setattr(torch, "mm", recording(torch.mm))
    monkeypatch.setattr(torch, "addmm", recording(torch.addmm))
    assert lce.padded_vocab(50257) == 50304 and lce.padded_vocab(1024) == 1024
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(40, 16, generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(50257, 16, generator=gen) * 0.1).requires_grad_()
    t = torch.randint(0, 50257, (40,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear_cross_entropy(h, w, t, chunk=16).backward()
    assert len(seen) >= 3 * 3 * 2  # three chunks, three GEMMs each
    for shape, stride, size in seen:
        assert all(s == 1 or (s * size) % 16 == 0 for s in stride), f"a GEMM operand {shape} with strides {stride}"


def test_traced_by_compile_in_one_graph():
    """One opaque op under torch.compile(fullgraph=True): no graph break, the same loss and gradients."""
    if not torch._dynamo.is_dynamo_supported():
        pytest.skip("torch.compile is not supported here")
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 9, 16, generator=gen).requires_grad_()
    w = torch.randn(101, 16, generator=gen).requires_grad_()
    t = torch.randint(0, 101, (2, 9), generator=gen)

    def step(h, w, t):
        return linear_cross_entropy(torch.tanh(h), w, t, chunk=8)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, got_grads = _grads(lambda: compiled(h, w, t), h, w)
    want, want_grads = _grads(lambda: reference(torch.tanh(h), w, t), h, w)
    assert_rel_close(got, want, TOL, "loss")
    for g, e in zip(got_grads, want_grads):
        assert_rel_close(g, e, TOL)


# -- the rung on transformers' causal LMs -------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from test_hf_fused_loss import TOKENS, V, llama  # noqa: E402  (the tiny Llama of the fused-loss tests)


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=V, n_positions=64, **TOKENS)
    return transformers.GPT2LMHeadModel(cfg)  # dropout on (its defaults): the probe and the test draw it alike


class Wrapper(nn.Module):
    """A user's module holding a library LM and training it through its labels."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def training_step(self, batch, batch_idx):
        return self.lm(input_ids=batch, labels=batch).loss


def _state(model: nn.Module) -> TrainState:
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"))


@pytest.mark.parametrize("build", [gpt2, llama])
def test_the_rung_trains_a_library_lm_to_its_own_loss_and_gradients(build):
    torch.manual_seed(0)
    model = Wrapper(build())
    reference_model = copy.deepcopy(model)
    state = _state(model)
    rung = FusedLMHeadRung()
    assert rung.check(state) is None
    handle = rung.apply(state)
    assert any("LM head (64→101) and cross-entropy fused" in c for c in handle.changes)
    assert lm_head.fused(model.lm)
    ids = torch.randint(0, V, (3, 17))
    labels = ids.clone()
    labels[:, :4] = -100
    for m in (model, reference_model):
        m.train()
    torch.manual_seed(1)
    out = model.lm(input_ids=ids, labels=labels)
    out.loss.backward()
    torch.manual_seed(1)
    want = reference_model.lm(input_ids=ids, labels=labels)
    want.loss.backward()
    assert out.logits is None and type(out) is type(want)
    assert_rel_close(out.loss, want.loss, TOL, "loss")
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        assert_rel_close(p.grad, q.grad, TOL, name)
    # evaluation, and a call without labels: the model's own forward, logits and all
    model.eval()
    reference_model.eval()
    with torch.no_grad():
        assert_rel_close(model.lm(input_ids=ids).logits, reference_model.lm(input_ids=ids).logits, 0.0)
        assert model.lm(input_ids=ids, labels=labels).logits is not None
    # triton_layers' loss swap leaves a fused model alone (its loss_function would never run)
    assert hf_loss.find(model)[0] == []
    handle.undo()
    assert "forward" not in model.lm.__dict__ and not lm_head.fused(model.lm)


def test_compiled_library_lm_has_no_graph_break():
    torch.manual_seed(0)
    model = Wrapper(gpt2())
    FusedLMHeadRung().apply(_state(model))
    ids = torch.randint(0, V, (2, 9))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.lm)(input_ids=ids, labels=ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons


class ScaledGPT2(transformers.GPT2LMHeadModel):
    """A causal LM whose loss is more than its head's cross-entropy (as an auxiliary loss would be)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if out.loss is not None:
            out.loss = out.loss * 2
        return out


def test_left_alone_where_the_fused_forward_computes_another_loss():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=V, n_positions=32, **TOKENS)
    reason = FusedLMHeadRung().check(_state(Wrapper(ScaledGPT2(cfg))))
    assert reason is not None and "computes another loss" in reason and "ScaledGPT2" in reason


def test_left_alone_where_the_step_reads_the_logits():
    class ReadsLogits(Wrapper):
        def training_step(self, batch, batch_idx):
            out = self.lm(input_ids=batch, labels=batch)
            self.accuracy = (out.logits.argmax(-1) == batch).float().mean()
            return out.loss

    state = _state(ReadsLogits(gpt2()))
    assert logits_readers(state) == ["ReadsLogits.training_step"]
    assert "reads the model's logits" in FusedLMHeadRung().check(state)


def test_nothing_found_says_so():
    reason = FusedLMHeadRung().check(_state(nn.Sequential(nn.Linear(4, 4))))
    assert reason is not None and reason.startswith("no LM head and loss found")


def test_undo_through_a_handle_restores_the_forward():
    model = Wrapper(llama())
    original = model.lm.forward
    handle = Handle("outer")
    inner = FusedLMHeadRung().apply(_state(model))
    handle.record("fused", inner.undo)
    handle.undo()
    assert model.lm.forward == original
    ids = torch.randint(0, V, (1, 5))
    assert model.lm(input_ids=ids, labels=ids).logits is not None
    assert F.cross_entropy is torch.nn.functional.cross_entropy


# -- hand-written language models: the rewrite ------------------------------------------------------


class NanoGPTStyle(nn.Module):
    """nanoGPT's shape: ``(logits, loss)`` returned, the head tied to the embedding, ``ignore_index=-1``."""

    def __init__(self, vocab: int = 97, width: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        x = self.block(self.wte(idx))
        if targets is not None:
            logits = self.lm_head(self.ln_f(x))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(self.ln_f(x)[:, [-1], :])
            loss = None
        return logits, loss


class ReadsLogitsInForward(NanoGPTStyle):
    def forward(self, idx, targets=None):
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        self.last_max = logits.max()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _naive_gpt():
    from speedkit.demos.gpt2 import NaiveGPT

    return NaiveGPT(size="tiny", n_layer=1)


def test_the_rewrite_fuses_a_hand_written_gpt_to_its_own_loss_and_gradients():
    """The naive GPT-2 recipe's model (``logits = self.lm_head(self.ln_f(x))`` then
    ``F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))``, tied weights)."""
    torch.manual_seed(0)
    model = _naive_gpt()
    reference_model = copy.deepcopy(model)
    rung = FusedLMHeadRung()
    state = _state(model)
    assert rung.check(state) is None
    handle = rung.apply(state)
    assert handle.rewrite.counts == {"lm_head": 1}
    assert any("NaiveGPT.forward rewritten: LM head and cross-entropy fused" in c for c in handle.changes)
    idx = torch.randint(0, 512, (2, 13))
    targets = torch.randint(0, 512, (2, 13))
    for m in (model, reference_model):
        m.train()
    torch.manual_seed(1)
    loss = model(idx, targets)
    loss.backward()
    torch.manual_seed(1)
    want = reference_model(idx, targets)
    want.backward()
    assert_rel_close(loss, want, TOL, "loss")
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        assert_rel_close(p.grad, q.grad, TOL, name)
    with torch.no_grad():  # no gradients: the head runs as written
        assert_rel_close(model(idx, targets), reference_model(idx, targets), TOL)
        assert model(idx).shape == (2, 13, 512)
    handle.undo()
    assert "forward" not in model.__dict__


def test_the_rewrite_returns_none_logits_while_training_and_keeps_ignore_index():
    torch.manual_seed(0)
    model = NanoGPTStyle()
    reference_model = copy.deepcopy(model)
    handle = FusedLMHeadRung().apply(_state(model))
    idx = torch.randint(0, 97, (3, 7))
    targets = idx.roll(-1, 1)
    targets[:, -1] = -1
    torch.manual_seed(2)
    logits, loss = model(idx, targets)
    loss.backward()
    torch.manual_seed(2)
    want_logits, want = reference_model(idx, targets)
    want.backward()
    assert logits is None and want_logits.shape == (3, 7, 97)
    assert_rel_close(loss, want, TOL, "loss")
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert_rel_close(p.grad, q.grad, TOL)
    model.eval()
    reference_model.eval()
    assert_rel_close(model(idx)[0], reference_model(idx)[0], 0.0)  # generation: as written
    handle.undo()


def test_the_rewrite_leaves_alone_logits_read_elsewhere():
    reason = FusedLMHeadRung().check(_state(ReadsLogitsInForward()))
    assert reason is not None and "logits is read at line" in reason


def test_the_rewritten_model_compiles_in_one_graph():
    torch.manual_seed(0)
    model = NanoGPTStyle()
    FusedLMHeadRung().apply(_state(model))
    idx = torch.randint(0, 97, (2, 5))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_compile_on_top_compiles_the_fused_forward():
    """As the ladder stacks them: the fused forward first, speedkit's compile on top (it compiles the
    forward in effect beneath it); the loss and gradients stay the model's own, and undoing compile
    leaves the fused forward in place."""
    from speedkit.rungs.compile import CompileOptions, CompileRung

    torch.manual_seed(0)
    model = Wrapper(gpt2())
    reference_model = copy.deepcopy(model)
    state = _state(model)
    fused = FusedLMHeadRung().apply(state)
    compiled = CompileRung(CompileOptions(backend="eager")).apply(state)
    assert type(model.lm.__dict__["forward"]).__name__ == "GuardedForward"
    ids = torch.randint(0, V, (2, 11))
    torch.manual_seed(3)
    out = model.training_step(ids, 0)
    out.backward()
    torch.manual_seed(3)
    want = reference_model.training_step(ids, 0)
    want.backward()
    assert_rel_close(out, want, TOL, "loss")
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert_rel_close(p.grad, q.grad, TOL)
    compiled.undo()
    assert lm_head.fused(model.lm)
    fused.undo()
    assert "forward" not in model.lm.__dict__
