"""triton_layers on Hugging Face models' own loss (``model(input_ids, labels=labels).loss``): the
loss and every parameter's gradient equal transformers' (shifted or not, -100 labels, another
ignore_index, ``num_items_in_batch``, ``shift_labels``) through the fused kernel; the report names
the model; undo and suspend/resume give the very attributes back; other losses are left alone with
their reason. Tiny models built from config objects (no downloads); the kernel runs in Triton's
interpreter on CPU (conftest), so everything is small."""

from __future__ import annotations

import copy
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from conftest import assert_rel_close

from speedkit import compat, kernels
from speedkit.kernels import layers
from speedkit.rewrite import hf_loss
from speedkit.rungs.triton_layers import TritonLayersOptions, TritonLayersRung
from speedkit.training.state import TrainState
from speedkit.training.step import default_loss_fn

transformers = pytest.importorskip("transformers")
loss_utils = pytest.importorskip("transformers.loss.loss_utils")
ForCausalLMLoss, ForMaskedLMLoss = loss_utils.ForCausalLMLoss, loss_utils.ForMaskedLMLoss

TOL = 1e-5  # fp32: the kernel sums in another order than PyTorch, nothing more
V = 101
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter (conftest)
#: the loss alone: the norms' kernels are tested in test_triton_layers.py
LOSS_ONLY = TritonLayersOptions(norms=False, rms_like=False, gelu=False, swiglu=False)
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=V, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **TOKENS
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=V,
        max_position_embeddings=64,
        **TOKENS,
    )
    return transformers.LlamaForCausalLM(cfg)


def modernbert() -> torch.nn.Module:
    """A masked LM whose forward calls ``self.loss_function`` (BERT's does not: see the left-alone test)."""
    cfg = transformers.ModernBertConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        cls_token_id=1,
        sep_token_id=2,
        mask_token_id=3,
        **TOKENS,
    )
    return transformers.ModernBertForMaskedLM(cfg)


def bert(cls: type | None = None, **config) -> torch.nn.Module:
    cfg = transformers.BertConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **config,
    )
    return (cls or transformers.BertForMaskedLM)(cfg)


MODELS = {"gpt2": (gpt2, ForCausalLMLoss), "llama": (llama, ForCausalLMLoss), "modernbert": (modernbert, ForMaskedLMLoss)}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the cross-entropy kernel's calls (the point: not a fallback to PyTorch) and the dtype
    of the logits it was given."""
    calls = Counter()

    def spy(logits, *args, **kwargs):
        calls[logits.dtype] += 1
        return original(logits, *args, **kwargs)

    original = kernels.cross_entropy
    monkeypatch.setattr(layers.kernels, "cross_entropy", spy)
    return calls


def _state(model: torch.nn.Module) -> TrainState:
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device=DEVICE)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (3, 11), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[2, 7:] = -100  # padding
    return ids.to(DEVICE), labels.to(DEVICE)


def _make(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = MODELS[name][0]().to(DEVICE)
    return model, copy.deepcopy(model)


# -- the same loss and gradients, through the kernel ----------------------------------------------------------


CASES = {
    "mean": lambda labels: {},
    "num_items_in_batch": lambda labels: {"num_items_in_batch": torch.tensor(17, device=DEVICE)},
    "num_items_int": lambda labels: {"num_items_in_batch": 40},
    "shift_labels": lambda labels: {"shift_labels": labels.roll(-1, dims=1)},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(MODELS))
def test_loss_and_gradients_equal_transformers(name, case, kernel_calls):
    model, reference = _make(name)
    handle = TritonLayersRung(LOSS_ONLY).apply(_state(model))
    assert handle.rewrite.counts["hf_loss"] == 1
    assert (
        f"{type(model).__name__}.loss_function: transformers' {MODELS[name][1].__name__} → speedkit fused cross-entropy"
        in handle.changes
    ), handle.changes
    ids, labels = _batch()
    kwargs = CASES[case](labels)
    loss = model(input_ids=ids, labels=labels, **kwargs).loss
    expected = reference(input_ids=ids, labels=labels, **kwargs).loss
    loss.backward()
    expected.backward()
    assert kernel_calls == Counter({torch.float32: 1})
    assert loss.dtype == expected.dtype == torch.float32
    assert_rel_close(loss, expected, TOL, "loss")
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            assert_rel_close(p.grad, q.grad, TOL, f"grad of {pname}")


def test_another_ignore_index_and_all_ignored():
    fused = hf_loss.FusedLMLoss(ForCausalLMLoss, shift=True)
    logits = torch.randn(2, 6, V, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, V, (2, 6), device=DEVICE)
    ignore = labels[0, 2].item()
    assert_rel_close(
        fused(logits, labels, V, ignore_index=ignore), ForCausalLMLoss(logits, labels, V, ignore_index=ignore), TOL, "loss"
    )
    ignored = torch.full_like(labels, -100)  # nothing to predict: NaN, as transformers gives
    assert torch.isnan(fused(logits, ignored, V)) and torch.isnan(ForCausalLMLoss(logits, ignored, V))


def test_half_logits_reach_the_kernel_without_an_fp32_copy(kernel_calls):
    model, reference = _make("gpt2")
    model.bfloat16()
    reference.bfloat16()
    TritonLayersRung(LOSS_ONLY).apply(_state(model))
    ids, labels = _batch()
    loss, expected = model(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss
    assert kernel_calls == Counter({torch.bfloat16: 1})  # the logits as the model made them
    assert loss.dtype == expected.dtype == torch.float32
    assert_rel_close(loss, expected, TOL, "loss")  # fp32 math on the same bf16 logits


# -- undo, suspend / resume -------------------------------------------------------------------------------------


def _attributes(model: torch.nn.Module) -> list[dict]:
    return [dict(m.__dict__) for m in model.modules()]


def _assert_same_attributes(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(x[k] is y[k] for k in x)


@pytest.mark.parametrize("name", list(MODELS))
def test_undo_and_suspend_resume_are_exact(name):
    model, _ = _make(name)
    original = model.loss_function
    before = _attributes(model)
    handle = TritonLayersRung().apply(_state(model))
    fused = model.loss_function
    assert isinstance(fused, hf_loss.FusedLMLoss) and fused.original is original
    for _ in range(2):
        handle.suspend()
        assert model.loss_function is original and compat.HF_LOSS_FUNCTION_ATTR not in model.__dict__
        handle.resume()
        assert model.loss_function is fused  # the same object back
    handle.undo()
    assert model.loss_function is original
    _assert_same_attributes(_attributes(model), before)


def test_a_loss_function_the_user_set_comes_back():
    model, reference = _make("gpt2")
    model.loss_function = ForCausalLMLoss  # the user's own choice, through transformers' setter
    assert model.__dict__[compat.HF_LOSS_FUNCTION_ATTR] is ForCausalLMLoss
    before = _attributes(model)
    handle = TritonLayersRung(LOSS_ONLY).apply(_state(model))
    assert handle.rewrite.counts["hf_loss"] == 1
    ids, labels = _batch()
    assert_rel_close(model(input_ids=ids, labels=labels).loss, reference(input_ids=ids, labels=labels).loss, TOL, "loss")
    handle.undo()
    assert model.__dict__[compat.HF_LOSS_FUNCTION_ATTR] is ForCausalLMLoss
    _assert_same_attributes(_attributes(model), before)


# -- left alone, with the reason ---------------------------------------------------------------------------------


def _left_alone(model: torch.nn.Module) -> list[str]:
    handle = TritonLayersRung().apply(_state(model))
    assert handle.rewrite.counts["hf_loss"] == 0 and compat.HF_LOSS_FUNCTION_ATTR not in model.__dict__
    return handle.rewrite.left_alone


def test_bert_masked_lm_computes_its_loss_without_loss_function():
    model = bert()
    assert model.loss_function is ForMaskedLMLoss  # what its loss_type names, yet forward never calls it
    assert "BertForMaskedLM: its forward computes the loss without self.loss_function" in _left_alone(model)


def test_other_losses_are_left_alone():
    classifier = bert(transformers.BertForSequenceClassification, num_labels=3)
    assert (
        "BertForSequenceClassification: its loss_function is ForSequenceClassificationLoss, not a causal- or "
        "masked-LM cross-entropy" in _left_alone(classifier)
    )

    def my_loss(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels, vocab_size, **kwargs) * 2

    model = gpt2()
    model.loss_function = my_loss
    assert (
        "GPT2LMHeadModel: its loss_function is my_loss, not a causal- or masked-LM cross-entropy"
        in TritonLayersRung().apply(_state(model)).rewrite.left_alone
    )
    assert model.loss_function is my_loss


def test_a_transformers_loss_that_computes_something_else_is_left_alone(monkeypatch):
    """The guard against a release changing the loss: here ForCausalLMLoss taken for an unshifted loss."""
    monkeypatch.setattr(hf_loss, "_lm_losses", lambda: {ForCausalLMLoss: False})
    assert (
        "LlamaForCausalLM: ForCausalLMLoss of this transformers computes something else than speedkit's version "
        "(with defaults)" in _left_alone(llama())
    )


def test_options_cross_entropy_off_leaves_the_loss():
    model = gpt2()
    handle = TritonLayersRung(TritonLayersOptions(cross_entropy=False)).apply(_state(model))
    assert handle.rewrite.counts["hf_loss"] == 0 and model.loss_function is ForCausalLMLoss


# -- in a LightningModule -------------------------------------------------------------------------------------


class LitGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.model(input_ids=x, labels=y).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_module_wrapping_a_hugging_face_model(kernel_calls):
    torch.manual_seed(0)
    lit = LitGPT2().to(DEVICE)
    reference = copy.deepcopy(lit)
    state = TrainState(model=lit, optimizer=lit.configure_optimizers(), device=DEVICE)
    assert TritonLayersRung().check(state) is None
    handle = TritonLayersRung().apply(state)
    assert handle.rewrite.counts["hf_loss"] == 1
    assert (
        "GPT2LMHeadModel (self.model).loss_function: transformers' ForCausalLMLoss → speedkit fused cross-entropy"
        in handle.changes
    ), handle.changes
    batch = _batch()
    loss, expected = default_loss_fn(lit, batch, 0), default_loss_fn(reference, batch, 0)
    loss.backward()
    expected.backward()
    assert kernel_calls == Counter({torch.float32: 1})
    assert_rel_close(loss, expected, TOL, "loss")
    for (pname, p), q in zip(lit.named_parameters(), reference.parameters()):
        assert_rel_close(p.grad, q.grad, TOL, f"grad of {pname}")
    handle.undo()
    assert lit.model.loss_function is ForCausalLMLoss and compat.HF_LOSS_FUNCTION_ATTR not in lit.model.__dict__
