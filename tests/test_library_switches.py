"""The sdpa rung through the model libraries' own switches: Hugging Face attn_implementation, timm
fused_attn. Tiny models built from configs (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

from speedkit.rungs.sdpa import SdpaOptions, SdpaRung
from speedkit.training.state import TrainState

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")


def _gpt2(attn: str):
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=97,
        n_positions=32,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_implementation=attn,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _state(model):
    return TrainState(model=model, optimizer=None, device=torch.device("cpu"))


def test_hugging_face_eager_attention_switches_to_sdpa_through_the_library_and_back():
    model = _gpt2("eager")
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    eager_loss = model(input_ids=ids, labels=ids).loss
    rung = SdpaRung()
    assert rung.check(_state(model)) is None
    handle = rung.apply(_state(model))
    assert model.config._attn_implementation == "sdpa"
    assert any("attn_implementation 'eager' -> 'sdpa'" in line for line in handle.changes)
    assert handle.draws_differently  # attention dropout inside the kernel: parity with dropout off
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, eager_loss, rtol=1e-5, atol=1e-6)
    for _ in range(2):
        handle.suspend()
        assert model.config._attn_implementation == "eager"
        handle.resume()
        assert model.config._attn_implementation == "sdpa"
    handle.undo()
    assert model.config._attn_implementation == "eager"


def test_a_model_already_on_sdpa_is_named_in_the_reason():
    reason = SdpaRung().check(_state(_gpt2("sdpa")))
    assert reason is not None and "GPT2LMHeadModel already runs attn_implementation='sdpa'" in reason


def test_the_library_switches_can_be_turned_off():
    assert SdpaRung(SdpaOptions(libraries=False)).check(_state(_gpt2("eager"))) is not None


def test_timm_attention_with_fused_attn_off_is_switched_on_and_back():
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10, depth=2)
    attns = [m for m in model.modules() if hasattr(m, "fused_attn")]
    for m in attns:
        m.fused_attn = False
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    reference = model(x)
    handle = SdpaRung().apply(_state(model))
    assert all(m.fused_attn for m in attns)
    assert handle.changes[0].startswith("timm Attention: fused_attn False -> True in 2 module(s)")
    assert not any("left alone" in line for line in handle.changes)  # its hand-written path no longer runs
    torch.testing.assert_close(model(x), reference, rtol=1e-4, atol=1e-5)
    handle.undo()
    assert not any(m.fused_attn for m in attns)


def test_timm_attention_already_fused_is_named_and_its_unused_eager_path_not_reported():
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10, depth=2)
    reason = SdpaRung().check(_state(model))
    assert reason is not None and "timm Attention: 2 module(s) already run F.scaled_dot_product_attention" in reason
    assert "cannot express" not in reason  # the hand-written path timm does not run is not analysed
