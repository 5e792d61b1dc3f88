"""speedkit's Triton kernels for the memory-bound layers of training.

Each op is a ``torch.library.custom_op`` (``speedkit::<op>``) with a fake (meta) implementation and
a registered autograd formula, so ``torch.compile(fullgraph=True)`` traces through it and a whole
training step using it can be captured in a CUDA graph. None of them synchronizes with the host.

Functional API (same semantics as the PyTorch functions they stand in for, statistics in fp32):

* :func:`layer_norm` ``(x, weight, bias, eps)`` — over the last dim; weight/bias optional.
* :func:`rms_norm` ``(x, weight, eps)`` — ``x * rsqrt(mean(x²) + eps) * weight`` over the last dim.
* :func:`cross_entropy` ``(logits (N, V), target (N,), reduction, ignore_index, label_smoothing)`` —
  softmax cross-entropy computed in fp32 whatever the logits' dtype (as ``F.cross_entropy(logits.float(), …)``);
  returns an fp32 loss.
* :func:`bias_gelu` ``(x, bias, approximate)`` — ``gelu(x + bias)``, exact or tanh.
* :func:`swiglu` ``(gate, up)`` — ``silu(gate) * up``.
* :func:`geglu` ``(gate, up, approximate)`` — ``gelu(gate) * up``, exact or tanh.
* :func:`rotary` ``(x, cos, sin)`` — ``x * cos + rotate_half(x) * sin`` (rotary position embedding).

Kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (for tests). Without
Triton installed (torch's CPU builds do not bring it) the functions raise, and
:func:`kernels_available` says why, which is what the rungs ask first.
:mod:`speedkit.kernels.cublaslt` holds the GEMMs with cuBLASLt's GELU epilogues (GPT-2's MLP).
"""

from speedkit.kernels.support import kernels_available, triton_installed

if triton_installed():
    from speedkit.kernels.activations import bias_gelu, geglu, swiglu
    from speedkit.kernels.cross_entropy import cross_entropy
    from speedkit.kernels.norms import layer_norm, rms_norm
    from speedkit.kernels.rotary import rotary
else:  # torch's CPU builds come without Triton (its CUDA builds bring their own): nothing here can run

    def _no_triton(*args: object, **kwargs: object) -> None:
        raise RuntimeError(kernels_available())

    bias_gelu = geglu = swiglu = cross_entropy = layer_norm = rms_norm = rotary = _no_triton  # type: ignore[assignment]

__all__ = ["bias_gelu", "cross_entropy", "geglu", "kernels_available", "layer_norm", "rms_norm", "rotary", "swiglu"]
