"""explicit_mask: nn.Transformer's stacks apply a given mask without the host read that asks whether it
is causal; the same function, no graph break under compile, undone and copied cleanly."""

from __future__ import annotations

import copy
import io
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_rel_close
from torch import nn
from torch.nn.modules import transformer as torch_transformer

from speedkit import rungs
from speedkit.rungs.explicit_mask import MaskAsGiven, sniffing_stacks


class DemoLike(nn.Module):
    """Lightning's demo Transformer's shape: a fresh causal mask made every call, passed as ``tgt_mask``
    with no ``tgt_is_causal``; an encoder stack called positionally with its mask."""

    def __init__(self, vocab: int = 61, width: int = 24) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.transformer = nn.Transformer(
            d_model=width, nhead=2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=40, dropout=0.0, batch_first=True
        )
        self.decoder = nn.Linear(width, vocab)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(inputs.size(1)).to(inputs.device)
        src = self.embedding(inputs) * math.sqrt(24)
        out = self.transformer(src, self.embedding(target), tgt_mask=mask)
        return self.decoder(out).log_softmax(-1)


def _state(model: nn.Module, device: str = "cuda") -> SimpleNamespace:
    return SimpleNamespace(model=model, device=torch.device(device))


def _batch(seed: int, batch: int = 3, length: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 61, (batch, length), generator=g), torch.randint(0, 61, (batch, length), generator=g)


def _count_sniffs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Calls of torch's causal-mask detection that would read the mask (hint None, a mask given)."""
    reads: list[object] = []
    original = torch_transformer._detect_is_causal_mask

    def spy(mask, is_causal=None, size=None):
        if is_causal is None and mask is not None:
            reads.append(mask)
        return original(mask, is_causal, size)

    monkeypatch.setattr(torch_transformer, "_detect_is_causal_mask", spy)
    return reads


def test_same_function_no_mask_read_and_undo(monkeypatch):
    torch.manual_seed(0)
    model = DemoLike()
    reads = _count_sniffs(monkeypatch)
    rung = rungs.make("explicit_mask")
    assert rung.cuts_host_work and rung.judged_at_full_precision
    assert rung.check(_state(model)) is None
    assert "no device sync" in rung.check(_state(model, "cpu"))

    for seed, length in ((1, 13), (2, 7), (3, 29)):  # odd shapes, fresh inputs
        inputs, target = _batch(seed, length=length)
        reads.clear()
        expected = model(inputs, target)
        assert len(reads) == 1  # the decoder stack asked (the encoder got no mask)
        handle = rung.apply(_state(model))
        reads.clear()
        actual = model(inputs, target)
        assert reads == []
        assert_rel_close(actual, expected, 1e-5, f"length {length}")
        # the gradients are the same function's too
        torch.manual_seed(seed)
        grads = torch.autograd.grad(actual.sum(), list(model.parameters()))
        handle.undo()
        expected_grads = torch.autograd.grad(model(inputs, target).sum(), list(model.parameters()))
        for got, want in zip(grads, expected_grads):
            assert_rel_close(got, want, 1e-5, "gradient")
        assert "forward" not in vars(model.transformer.decoder)

    handle = rung.apply(_state(model))
    assert len(handle.changes) == 2 and "tgt_is_causal=False" in handle.changes[1]
    handle.suspend()
    assert "forward" not in vars(model.transformer.encoder)
    handle.resume()
    assert "forward" in vars(model.transformer.encoder)
    handle.undo()


def test_a_hint_given_positional_args_and_no_mask_pass_unchanged(monkeypatch):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    stack = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    seen: list[object] = []
    original = torch_transformer._detect_is_causal_mask
    monkeypatch.setattr(
        torch_transformer,
        "_detect_is_causal_mask",
        lambda mask, is_causal=None, size=None: seen.append(is_causal) or original(mask, is_causal, size),
    )
    handle = rungs.make("explicit_mask").apply(_state(stack))
    x = torch.randn(2, 5, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    stack(x, mask)  # positional mask, no hint
    stack(x, mask, None, True)  # positional hint: the caller's
    stack(x, mask=mask, is_causal=True)  # keyword hint: the caller's
    stack(x)  # no mask: nothing to read
    assert seen == [False, True, True, None]
    handle.undo()


def test_subclass_with_own_forward_is_left_alone():
    class Mine(nn.TransformerEncoder):
        def forward(self, src, mask=None):  # takes no hint
            return super().forward(src, mask)

    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    model = nn.Sequential(Mine(layer, 1, enable_nested_tensor=False))
    assert sniffing_stacks(model) == []
    assert "no nn.TransformerEncoder" in rungs.make("explicit_mask").check(_state(model))


def test_copies_and_pickles_come_back_unwrapped():
    model = DemoLike()
    handle = rungs.make("explicit_mask").apply(_state(model))
    twin = copy.deepcopy(model)
    copied = vars(twin.transformer.decoder)["forward"]  # torch's own forward, bound to the copy: no wrapper travels
    assert not isinstance(copied, MaskAsGiven) and copied.__self__ is twin.transformer.decoder
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    inputs, target = _batch(4)
    assert_rel_close(loaded(inputs, target), twin(inputs, target), 1e-6, "copy")
    handle.undo()


def test_compiled_stack_has_no_graph_break_on_the_mask():
    torch.manual_seed(0)
    model = DemoLike()  # training mode, as a fit runs it
    inputs, target = _batch(5)
    before = torch._dynamo.explain(model)(inputs, target)
    assert before.graph_break_count >= 1  # the host read of the mask
    handle = rungs.make("explicit_mask").apply(_state(model))
    torch._dynamo.reset()
    after = torch._dynamo.explain(model)(inputs, target)
    assert after.graph_break_count == 0, after.break_reasons
    handle.undo()
    torch._dynamo.reset()
