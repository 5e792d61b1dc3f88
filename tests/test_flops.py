"""FLOPs per step come from torch.utils.flop_counter and match a hand count exactly."""

from __future__ import annotations

import pytest
import torch

from speedkit.demos import LaunchBoundMLP, NaiveGPT
from speedkit.measure import count_step_flops, mfu, peak_tflops
from speedkit.training.step import PlainStep


def test_mlp_flops_match_hand_count():
    B, F, H, D, C = 64, 256, 256, 8, 10
    model = LaunchBoundMLP(features=F, hidden=H, depth=D, classes=C)
    batch = (torch.randn(B, F), torch.randint(0, C, (B,)))
    layers = [(F, H)] + [(H, H)] * (D - 1) + [(H, C)]
    forward = sum(2 * B * i * o for i, o in layers)
    weight_grads = forward
    # the input needs no gradient, so the first layer's input-gradient GEMM is never run
    input_grads = forward - 2 * B * F * H
    assert count_step_flops(PlainStep(model, None, "cpu"), batch) == forward + weight_grads + input_grads


def test_gpt_flops_match_6N_plus_attention():
    """Per token: 6 x (matmul weights) + 12 L T d, the convention of ANCHORS.md."""
    B, T = 2, 32
    model = NaiveGPT("tiny")
    L, d, V = model.config["n_layer"], model.config["n_embd"], model.config["vocab_size"]
    idx = torch.randint(0, V, (B, T))
    matmul_weights = L * 12 * d * d + d * V  # qkv 3d², proj d², fc 4d², proj 4d²; tied lm_head d·V
    expected = 6 * matmul_weights * B * T + 12 * L * B * T * T * d
    assert count_step_flops(PlainStep(model, None, "cpu"), (idx, idx)) == expected


def test_counting_leaves_no_gradients_behind():
    model = LaunchBoundMLP(features=8, hidden=8, depth=1)
    count_step_flops(PlainStep(model, None, "cpu"), (torch.randn(4, 8), torch.randint(0, 10, (4,))))
    assert all(p.grad is None for p in model.parameters())


def test_mfu_and_peaks():
    util, achieved = mfu(10**12, 0.5, 4.0)
    assert achieved == pytest.approx(2.0) and util == pytest.approx(0.5)
    assert mfu(None, 0.5, 4.0) == (None, None)
    assert peak_tflops(torch.device("cpu"))[0] is None
    assert peak_tflops(torch.device("cpu"), override=123.0) == (123.0, "measure.peak_tflops (recipe override)")


def test_peak_table_prefers_the_longest_match():
    from speedkit.config import gpu_peak_tflops

    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert gpu_peak_tflops("NVIDIA H200", "tf32") == 494.7
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert gpu_peak_tflops("Some Unknown GPU", "bf16") is None
