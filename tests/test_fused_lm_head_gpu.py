"""fused_lm_head on CUDA (gpu mark): the chunked head and loss through the fused cross-entropy kernel
equal ``cross_entropy(lm_head(h).float())`` in fp32 and within autocast's own error in bf16, at GPT-2's
vocabulary, compiled and not; the chunk's logits never exceed their budget (peak memory)."""

from __future__ import annotations

import pytest
import torch

from speedkit.kernels.linear_cross_entropy import linear_cross_entropy, reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _case(n=4099, hidden=768, vocab=50257, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hidden, device="cuda", generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    t[::9] = -100
    return h, w, t


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_fp32_equals_the_head_and_loss():
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, t = _case()
    got = linear_cross_entropy(h, w, t, chunk=1024)
    g = torch.autograd.grad(got, [h, w])
    want = reference(h, w, t)
    e = torch.autograd.grad(want, [h, w])
    assert _rel(got, want) < 1e-5
    for a, b in zip(g, e):
        assert _rel(a, b) < 1e-4  # cuBLAS sums in its own order, chunked against whole


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_within_autocasts_own_error(compiled):
    h, w, t = _case(seed=1)
    exact = reference(h, w, t)
    exact_g = torch.autograd.grad(exact, [h, w])
    fn = torch.compile(linear_cross_entropy, fullgraph=True) if compiled else linear_cross_entropy
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = fn(h, w, t)
        got_g = torch.autograd.grad(got, [h, w])
        own = reference(h, w, t)
        own_g = torch.autograd.grad(own, [h, w])
    for a, o, e in zip((got, *got_g), (own, *own_g), (exact, *exact_g)):
        assert _rel(a, e) <= 2 * max(_rel(o, e), 1e-6)


def test_peak_memory_is_a_chunk_not_the_logits():
    h, w, t = _case(n=16384)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = linear_cross_entropy(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_bytes = 16384 * 50257 * (2 + 4)  # the bf16 logits and their fp32 copy the unfused loss holds
    assert extra < 0.25 * logits_bytes, extra / 2**30


def test_captured_in_a_cuda_graph_and_replayed():
    """No host sync and no allocation that changes between calls: the forward and backward are captured
    once and replayed on new inputs copied into the same buffers, with the eager results."""
    h, w, t = _case(n=2048, seed=2)
    static_h = h.detach().clone().requires_grad_()
    static_t = t.clone()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(static_h, w, static_t, chunk=512)
        gh, gw = torch.autograd.grad(loss, [static_h, w])
        return loss, gh, gw

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh_h, _, fresh_t = _case(n=2048, seed=3)
    with torch.no_grad():
        static_h.copy_(fresh_h)
    static_t.copy_(fresh_t)
    graph.replay()
    torch.cuda.synchronize()
    h2 = fresh_h.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = linear_cross_entropy(h2, w, fresh_t, chunk=512)
    want_g = torch.autograd.grad(want, [h2, w])
    for got, expected in zip(captured, (want, *want_g)):
        assert _rel(got, expected) < 1e-5
