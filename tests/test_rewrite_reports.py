"""The source-rewriting rungs decide and rewrite exactly what they did before their rebuild over one
pipeline (``speedkit/rewrite/``): the same ``check`` outcome for every rung on every model, and, for
sdpa, batched and triton_layers, the same report lines, site counts and rewritten forwards. The golden
copy was captured at a626ffb, before the rebuild (see ``rewrite_reports.py``)."""

from __future__ import annotations

import json

import pytest
from rewrite_reports import GOLDEN, capture


@pytest.fixture(scope="module")
def captured():
    return capture()


#: zoo models added after the golden copy was captured: no earlier behaviour to compare with
ADDED_SINCE = {"zoo:dcgan", "zoo:hf-llama-ckpt", "zoo:tv-resnet18-randaug"}


def test_the_same_models_are_compared(captured):
    assert sorted(set(captured) - ADDED_SINCE) == sorted(json.loads(GOLDEN.read_text()))


@pytest.mark.parametrize("label", sorted(json.loads(GOLDEN.read_text())))
def test_rewrite_rungs_decide_and_rewrite_as_before(captured, label):
    golden = json.loads(GOLDEN.read_text())[label]
    assert captured[label]["checks"] == golden["checks"]
    assert captured[label]["rewrites"] == golden["rewrites"]
