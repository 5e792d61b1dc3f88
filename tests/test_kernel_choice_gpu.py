"""The kernel-or-compile micro-benchmark on CUDA (gpu mark): GPT-2's and a Llama's norm shapes timed
both ways on CUDA events give finite figures and a decision, remembered for the next call; the class it
picks under compile computes what nn.LayerNorm computes."""

from __future__ import annotations

import math

import pytest
import torch

from speedkit.kernels.choice import ChoiceStore, LayerCase, choose

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize(
    "case",
    [
        LayerCase("layer_norm", (16, 1024, 768), "bfloat16", "bfloat16"),
        LayerCase("rms_norm", (4, 2048, 2048), "bfloat16", "bfloat16", bias=False, eps=1e-5),
    ],
    ids=["gpt2-layer-norm", "llama-rms-norm"],
)
def test_measured_on_cuda_events_and_remembered(tmp_path, case):
    store = ChoiceStore(tmp_path / "k.json")
    first = choose(case, torch.device("cuda"), store)
    assert first.measured and math.isfinite(first.kernel_ms) and math.isfinite(first.compiled_ms)
    assert first.kernel_ms > 0 and first.compiled_ms > 0
    print(f"{case.describe()}: {first.why}")
    again = choose(case, torch.device("cuda"), ChoiceStore(tmp_path / "k.json"))
    assert not again.measured and again.use_kernel == first.use_kernel
