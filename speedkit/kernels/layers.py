"""Modules and functions that speedkit swaps in for PyTorch's layers: its Triton kernels, and the
linear layer computed on an aligned (padded) weight.

The modules subclass the PyTorch module they stand in for and add nothing to it (no parameter,
buffer or attribute), so a model whose ``nn.LayerNorm`` became :class:`LayerNorm` has the same
state dict, and ``module.__class__ = nn.LayerNorm`` turns it back exactly: that is how the
``triton_layers`` rung swaps them. The functions are what the rung's rewritten ``forward`` /
``training_step`` code calls (through :mod:`speedkit.kernels.ops`) in place of a PyTorch expression.

Each one checks at run time that the kernel computes what the PyTorch code would, and runs the
PyTorch code itself otherwise (a device the kernels do not run on, a dtype or shape they do not
take, a module that gained a hook): a swap decided at apply time never changes the result.

Inside a region ``torch.compile`` traces they also run the PyTorch code, for speed: Inductor fuses
these layers with their neighbours (the residual add into the norm, the upcast into the loss),
which an opaque kernel call prevents. Measured on an H200, GPT-2 small (bf16 autocast, 16×1024
tokens, the kernels of commit 7a74542), kernel calls inside the compiled graph cost 10% of the step
(norms 4.5%, bias+GELU 2.6%, cross-entropy ±0 with 1.5 GB more peak memory) against Inductor's code.
The exception is :func:`gelu_mlp`, whose GEMMs are cuBLAS's own (with the GELU in their epilogues),
which Inductor cannot fuse into anyway: it stays under compile; and the norms and gated products'
activations of :data:`UNDER_COMPILE`'s classes, given by ``triton_layers`` to a norm or a gated
product's activation (whose product :func:`silu_mul` / :func:`gelu_mul` computes) whose kernel was
measured faster than Inductor's code at its shapes (:mod:`speedkit.kernels.choice`).
Under autocast they see the dtypes PyTorch's own ops would (probed per device: CUDA autocast runs
``layer_norm`` in fp32), and ``cross_entropy`` returns an fp32 loss under any autocast.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speedkit import compat, kernels
from speedkit.kernels import cublaslt
from speedkit.kernels.support import interpreting

#: dtypes the kernels take
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
#: chosen once, like the kernels themselves (Triton reads TRITON_INTERPRET when they are defined);
#: a module constant also keeps the check a constant for torch.compile
_INTERPRETING = interpreting()


def runs_kernels(t: Any, *, under_compile: bool = False) -> bool:
    """``t`` is a tensor the kernels run on (CUDA, or CPU under Triton's interpreter; a kernel dtype).

    Inside code that torch.compile traces, the norms and activations are left to Inductor, which
    fuses them with their neighbours (residual adds, casts) better than an opaque kernel can;
    ``under_compile=True`` (cross-entropy: nothing to fuse it with, and the fp32 upcast it saves
    is a whole copy of the logits) keeps the kernel there too."""
    return (
        isinstance(t, Tensor)
        and t.dtype in _KERNEL_DTYPES
        and (t.is_cuda or (_INTERPRETING and t.device.type == "cpu"))
        and (under_compile or not torch.compiler.is_compiling())
    )


def hooked(module: nn.Module) -> bool:
    """The module (or every module: global hooks) has hooks that a fused call would skip."""
    return compat.has_hooks(module)


#: (device type, norm op) -> whether autocast runs that op in fp32 there (its output is fp32 for
#: half inputs). It differs between ops and versions (CUDA: layer_norm always; rms_norm in none we
#: saw, although autocast_test_lists.py lists it): probed, not assumed, by :func:`probe_autocast`.
_AUTOCAST_FP32: dict[tuple[str, str], bool] = {}


def probe_autocast(device_type: str) -> None:
    """Find out how autocast treats the norms on ``device_type`` (one tiny op each; not under compile)."""
    for op in ("layer_norm", "rms_norm"):
        if (device_type, op) not in _AUTOCAST_FP32:
            x = torch.ones(1, 2, device=device_type, dtype=torch.bfloat16)
            with torch.autocast(device_type, dtype=torch.bfloat16):
                out = getattr(F, op)(x, (2,))
            _AUTOCAST_FP32[(device_type, op)] = out.dtype == torch.float32


def _norm_input(x: Tensor, op: str) -> tuple[Tensor, bool]:
    """``x`` as PyTorch's norm op sees it under autocast (fp32 where autocast upcasts it), and
    whether it was upcast."""
    if x.dtype in _HALF and torch.is_autocast_enabled(x.device.type):
        if (x.device.type, op) not in _AUTOCAST_FP32:  # eager only: runs_kernels is False under compile
            probe_autocast(x.device.type)
        if _AUTOCAST_FP32[(x.device.type, op)]:
            return x.float(), True
    return x, False


def _params_match(x: Tensor, upcast: bool, *params: Tensor | None) -> bool:
    """Outside autocast PyTorch's norms want parameters of the input's dtype (the kernels would take any)."""
    return upcast or all(p is None or p.dtype == x.dtype for p in params)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` through :func:`speedkit.kernels.layer_norm` (over one last dim; else PyTorch's)."""

    #: whether the kernel also runs inside code torch.compile traces (see :data:`UNDER_COMPILE`)
    kernel_under_compile = False

    def forward(self, input: Tensor) -> Tensor:
        if (
            len(self.normalized_shape) != 1
            or not runs_kernels(input, under_compile=self.kernel_under_compile)
            or input.dim() == 0
            or input.shape[-1] != self.normalized_shape[0]
        ):
            return super().forward(input)
        x, upcast = _norm_input(input, "layer_norm")
        if not _params_match(x, upcast, self.weight, self.bias):
            return super().forward(input)
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)

    def _get_name(self) -> str:  # repr: speedkit.LayerNorm((768,), eps=1e-05, elementwise_affine=True)
        return "speedkit.LayerNorm"


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` through :func:`speedkit.kernels.rms_norm` (over one last dim; else PyTorch's)."""

    kernel_under_compile = False

    def forward(self, x: Tensor) -> Tensor:
        if (
            len(self.normalized_shape) != 1
            or not runs_kernels(x, under_compile=self.kernel_under_compile)
            or x.dim() == 0
            or x.shape[-1] != self.normalized_shape[0]
        ):
            return super().forward(x)
        xk, upcast = _norm_input(x, "rms_norm")
        if not _params_match(xk, upcast, self.weight):
            return super().forward(x)
        # eps=None: PyTorch adds the epsilon of the op's math type (fp32 for fp32/bf16/fp16 inputs)
        eps = self.eps if self.eps is not None else torch.finfo(torch.float32).eps
        return kernels.rms_norm(xk, self.weight, eps)

    def _get_name(self) -> str:
        return "speedkit.RMSNorm"


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """``nn.CrossEntropyLoss`` (without class weights) through :func:`cross_entropy`."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        if self.weight is not None:
            return super().forward(input, target)
        return cross_entropy(
            input, target, reduction=self.reduction, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing
        )

    def _get_name(self) -> str:
        return "speedkit.CrossEntropyLoss"


#: the speedkit module that stands in for each exact PyTorch class
SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.LayerNorm: LayerNorm,
    nn.RMSNorm: RMSNorm,
    nn.CrossEntropyLoss: CrossEntropyLoss,
}


class LayerNormUnderCompile(LayerNorm):
    """:class:`LayerNorm` whose kernel also runs where torch.compile traces it: given to a norm whose
    shape the kernel was measured faster at than Inductor's code (:mod:`speedkit.kernels.choice`)."""

    kernel_under_compile = True


class RMSNormUnderCompile(RMSNorm):
    """:class:`RMSNorm` whose kernel also runs where torch.compile traces it (as :class:`LayerNormUnderCompile`)."""

    kernel_under_compile = True


class SiLU(nn.SiLU):
    """``nn.SiLU``, given to a library's own SiLU module that a SwiGLU product calls (transformers'
    ``SiLUActivation``: recognised by what it computes, :mod:`speedkit.kernels.recognise`), so
    that :func:`silu_mul` knows it computes ``F.silu``. Neither has state; the class attribute stands
    for the ``inplace`` the library's module never had."""

    inplace = False


class SiLUUnderCompile(nn.SiLU):
    """An ``nn.SiLU`` whose product with the up projection (:func:`silu_mul`, SwiGLU) runs speedkit's
    kernel where torch.compile traces it too: given to a SwiGLU activation (an ``nn.SiLU``, or a library's
    module that computes one) whose shape the kernel was measured faster at than Inductor's code. Called
    alone it is ``nn.SiLU``."""

    kernel_under_compile = True
    inplace = False  # a library's SiLU module has no such attribute; an nn.SiLU's own (False) shadows it


class GELU(nn.GELU):
    """``nn.GELU`` (exact), given to a library's own GELU module that a GeGLU product calls (as
    :class:`SiLU`); the class attribute stands for the ``approximate`` the library's module never had."""

    approximate = "none"


class GELUTanh(nn.GELU):
    """``nn.GELU(approximate="tanh")``, given to a library's own tanh-GELU module (transformers'
    ``GELUTanh``, Gemma's ``gelu_pytorch_tanh``) that a GeGLU product calls."""

    approximate = "tanh"

    def __init__(self, approximate: str = "tanh") -> None:  # made directly, it is what its name says
        super().__init__(approximate)


class GELUUnderCompile(nn.GELU):
    """An ``nn.GELU`` whose product with the up projection (:func:`gelu_mul`, GeGLU) runs speedkit's
    kernel where torch.compile traces it too (as :class:`SiLUUnderCompile`): an ``nn.GELU`` keeps its
    own ``approximate``; a library's exact GELU module reads the class's."""

    kernel_under_compile = True
    approximate = "none"


class GELUTanhUnderCompile(nn.GELU):
    """:class:`GELUUnderCompile` for a library's tanh-GELU module."""

    kernel_under_compile = True
    approximate = "tanh"

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__(approximate)


#: the classes that keep their kernel inside compiled code, by the class they stand in for (the norms'
#: speedkit classes; a SwiGLU's ``nn.SiLU`` or a GeGLU's ``nn.GELU``, which triton_layers swaps for
#: nothing else, or the stand-in a library's activation module was given)
UNDER_COMPILE: dict[type[nn.Module], type[nn.Module]] = {
    LayerNorm: LayerNormUnderCompile,
    RMSNorm: RMSNormUnderCompile,
    nn.SiLU: SiLUUnderCompile,
    SiLU: SiLUUnderCompile,
    nn.GELU: GELUUnderCompile,
    GELU: GELUUnderCompile,
    GELUTanh: GELUTanhUnderCompile,
}
#: the GELU classes :func:`gelu_mul` knows compute ``F.gelu(x, approximate=self.approximate)``
_GELUS = (nn.GELU, GELU, GELUTanh, GELUUnderCompile, GELUTanhUnderCompile)


# -- functions the rewritten code calls ------------------------------------------------------------------


def cross_entropy(
    input: Any,
    target: Any,
    *,
    upcast: bool = False,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    **other: Any,
) -> Tensor:
    """``F.cross_entropy(input.float() if upcast else input, target, …)``, fused where the kernel applies.

    ``upcast`` stands for a ``.float()`` the rewriter removed from the user's logits: the kernel
    computes in fp32 from the logits as they are, without materializing an fp32 copy of them (the
    loss equals the upcast version's up to fp32 rounding). Class-index targets over the last dim
    of 2-D logits only; probability targets, class weights, other layouts and devices run PyTorch.
    """
    if (
        other
        or reduction not in ("mean", "sum", "none")
        or not runs_kernels(input, under_compile=True)
        or input.dim() != 2
        or not isinstance(target, Tensor)
        or target.dtype != torch.int64
        or target.dim() != 1
        or target.shape[0] != input.shape[0]
        or target.device != input.device
    ):
        logits = input.float() if upcast else input
        return F.cross_entropy(
            logits, target, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing, **other
        )
    # the kernel reads targets with stride 1 (a strided view, e.g. target[::2], would be misread)
    loss = kernels.cross_entropy(input, target.contiguous(), reduction, ignore_index, label_smoothing)  # fp32
    if upcast or input.dtype == torch.float32 or torch.is_autocast_enabled(input.device.type):
        return loss
    return loss.to(input.dtype)  # half logits outside autocast: PyTorch returns a half loss


def linear_gelu(linear: nn.Module, act: nn.Module | None, x: Any, approximate: str = "none") -> Tensor:
    """``act(linear(x))`` (``F.gelu(linear(x), approximate=…)`` when ``act`` is None) as one GEMM
    without bias followed by one fused bias + GELU kernel.

    Fused only while ``linear`` is a plain ``nn.Linear`` with a bias, ``act`` a plain ``nn.GELU``,
    and neither has hooks; anything else calls them as the user's code did.
    """
    if act is not None:
        if type(act) is not nn.GELU or hooked(act):
            return act(linear(x))
        approximate = act.approximate
    if (
        type(linear) is not nn.Linear
        or linear.bias is None
        or hooked(linear)
        or not runs_kernels(x)
        or approximate not in ("none", "tanh")
        or linear.bias.dtype != linear.weight.dtype
    ):
        h = linear(x)
        return act(h) if act is not None else F.gelu(h, approximate=approximate)
    h = F.linear(x, linear.weight)  # (…, out): the bias is added inside the GELU kernel
    return kernels.bias_gelu(h, linear.bias, approximate)


def gelu_mlp(proj: nn.Module, act: nn.Module | None, fc: nn.Module, x: Any, approximate: str = "none") -> Tensor:
    """``proj(act(fc(x)))`` (``proj(F.gelu(fc(x), approximate=…))`` when ``act`` is None) with the
    tanh-GELU and its derivative in cuBLASLt's GEMM epilogues (:func:`kernels.cublaslt.gelu_mlp`).

    Taken while both are plain ``nn.Linear`` with biases and ``act`` a plain ``nn.GELU``, none with
    hooks, the GELU is the tanh one (cuBLASLt's), and the GEMMs run in bf16/fp16 (autocast's dtype,
    or the tensors' own): on CUDA with widths cuBLASLt takes, on the CPU under ``TRITON_INTERPRET=1``
    (tests) through the ops' PyTorch implementations. Otherwise ``proj`` is called on
    :func:`linear_gelu`, as the code was written. Stays under torch.compile: Inductor cannot fuse
    into cuBLAS's GEMMs.
    """
    if act is not None:
        if type(act) is not nn.GELU or hooked(act):
            return proj(act(fc(x)))
        approximate = act.approximate
    dtype = _mlp_dtype(proj, fc, x) if approximate == "tanh" else None
    if dtype is None:
        return proj(linear_gelu(fc, act, x, approximate))
    return cublaslt.gelu_mlp(x, fc.weight, fc.bias, proj.weight, proj.bias, dtype)


def _mlp_dtype(proj: nn.Module, fc: nn.Module, x: Any) -> torch.dtype | None:
    """The dtype :func:`gelu_mlp` computes in, or None where it does not apply."""
    if not (
        type(fc) is nn.Linear
        and type(proj) is nn.Linear
        and fc.bias is not None
        and proj.bias is not None
        and not hooked(fc)
        and not hooked(proj)
        and isinstance(x, Tensor)
        and x.dim() >= 2
        and x.shape[-1] == fc.in_features
        and proj.in_features == fc.out_features
        and len({fc.weight.dtype, fc.bias.dtype, proj.weight.dtype, proj.bias.dtype}) == 1
        and x.device == fc.weight.device
    ):
        return None
    autocast = torch.is_autocast_enabled(x.device.type)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    if dtype not in cublaslt.DTYPES or not (autocast or fc.weight.dtype == dtype):
        return None  # fp32 stays with linear_gelu: PyTorch's fp32 GEMMs follow the user's TF32 setting
    if x.is_cuda:
        if not torch.compiler.is_compiling() and not cublaslt.READY:
            cublaslt.unavailable()  # found once; traced code reads the flag the rung's apply set
        ok = all(n % 8 == 0 for n in (fc.in_features, fc.out_features, proj.out_features)) and cublaslt.READY
        return dtype if ok else None
    return dtype if _INTERPRETING and x.device.type == "cpu" else None


def silu_mul(gate: Any, up: Any, act: nn.Module | None = None) -> Tensor:
    """``F.silu(gate) * up`` (``act(gate) * up`` for an ``nn.SiLU`` module ``act``, or the :class:`SiLU` a
    library's SiLU module was given) in one kernel; inside compiled code only for a
    :class:`SiLUUnderCompile` ``act``.

    Fused for two tensors of one shape, dtype and device (no broadcasting), else computed as written.
    """
    if act is not None and (type(act) not in (nn.SiLU, SiLU, SiLUUnderCompile) or act.inplace or hooked(act)):
        return act(gate) * up
    if not _gated_operands(gate, up, under_compile=type(act) is SiLUUnderCompile):
        return F.silu(gate) * up
    return kernels.swiglu(gate, up)


def _gated_operands(gate: Any, up: Any, under_compile: bool) -> bool:
    """A gated product's kernel takes ``gate`` and ``up``: two tensors of one shape, dtype and device
    (no broadcasting) that the kernels run on."""
    return (
        runs_kernels(gate, under_compile=under_compile)
        and isinstance(up, Tensor)
        and gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.device == up.device
    )


def gelu_mul(gate: Any, up: Any, act: nn.Module | None = None, approximate: str = "none") -> Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` (``act(gate) * up`` for an ``nn.GELU`` module ``act``,
    or the stand-in a library's GELU module was given) in one kernel; inside compiled code only for a
    :class:`GELUUnderCompile` / :class:`GELUTanhUnderCompile` ``act``.

    Fused for two tensors of one shape, dtype and device (no broadcasting), else computed as written.
    """
    if act is not None:
        if type(act) not in _GELUS or hooked(act):
            return act(gate) * up
        approximate = act.approximate
    under_compile = type(act) in (GELUUnderCompile, GELUTanhUnderCompile)
    if not (approximate in ("none", "tanh") and _gated_operands(gate, up, under_compile)):
        return F.gelu(gate, approximate=approximate) * up
    return kernels.geglu(gate, up, approximate)


def rotary_pos_emb(fn: Any, q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(q, k, cos, sin, …)``, a model's rotate-half rotary function (recognised by what it computes:
    :func:`speedkit.kernels.recognise.computes_rotary`), with both rotations in speedkit's kernel.

    Taken for 4-D ``q``/``k`` with an even head dim the kernels run on, tables of one floating dtype that
    need no gradient and broadcast to both once unsqueezed at ``unsqueeze_dim`` (a trailing positional
    argument or keyword, default 1); anything else, and code torch.compile traces (Inductor fuses the
    rotation into its neighbours), calls ``fn`` as written.
    """
    unsqueeze = kwargs.get("unsqueeze_dim", args[0] if args else 1)
    if (
        len(args) + len(kwargs) > 1
        or set(kwargs) - {"unsqueeze_dim"}
        or type(unsqueeze) is not int
        or not (runs_kernels(q) and runs_kernels(k))
        or not (isinstance(cos, Tensor) and isinstance(sin, Tensor))
        or cos.dtype != sin.dtype
        or cos.dtype not in _KERNEL_DTYPES
        or cos.requires_grad
        or sin.requires_grad
        or q.dim() != 4
        or k.dim() != 4
        or q.shape[-1] % 2
        or k.shape[-1] % 2
        or not (q.device == k.device == cos.device == sin.device)
    ):
        return fn(q, k, cos, sin, *args, **kwargs)
    try:
        c, s = cos.unsqueeze(unsqueeze), sin.unsqueeze(unsqueeze)
        fits = all(torch.broadcast_shapes(t.shape, x.shape) == x.shape for t in (c, s) for x in (q, k))
    except (IndexError, RuntimeError):
        fits = False
    if not fits:
        return fn(q, k, cos, sin, *args, **kwargs)
    return kernels.rotary(q, c, s), kernels.rotary(k, c, s)


def rms_like_forward(param: str, eps: float, original: Any) -> Any:
    """A ``forward(self, x)`` for a user RMSNorm recognised by what it computes (fp32 inputs).

    The result has the dtype the user's ``original`` forward returns for the same input dtype,
    weight dtype and autocast state: found on the first call with each, by one call of the
    original on a one-row input. Inputs the kernel does not take run the original.
    """
    out_dtypes: dict[tuple[Any, ...], torch.dtype | None] = {}

    def forward(self: nn.Module, x: Any) -> Any:
        weight = getattr(self, param)
        if not runs_kernels(x) or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
            return original(self, x)
        device = x.device.type
        key = (device, x.dtype, weight.dtype, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
        if key not in out_dtypes:  # eager only (runs_kernels is False under compile)
            out_dtypes[key] = _output_dtype(original, self, x)
        out_dtype = out_dtypes[key]
        if out_dtype is None:
            return original(self, x)
        return kernels.rms_norm(x, weight, eps).to(out_dtype)

    forward.__qualname__ = f"rms_like_forward[{param}, eps={eps:g}]"
    return forward


def _output_dtype(original: Any, module: nn.Module, x: Tensor) -> torch.dtype | None:
    try:
        with torch.no_grad():
            out = original(module, torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device))
    except Exception:  # the original cannot take this input: it runs as it is, and raises as it would
        return None
    return out.dtype if isinstance(out, Tensor) and out.is_floating_point() else None


class AlignedLinear(nn.Linear):
    """``nn.Linear`` through :func:`padded_linear`: its output features padded to a multiple of
    :attr:`multiple` inside the GEMM (subclasses fix the multiple; no attribute is added to the
    instance, so ``module.__class__ = nn.Linear`` turns it back exactly)."""

    multiple: int = 64

    def forward(self, input: Tensor) -> Tensor:
        return padded_linear(input, self.weight, self.bias, self.multiple)

    def _get_name(self) -> str:
        return "speedkit.AlignedLinear"


def aligned_linear_class(multiple: int) -> type[AlignedLinear]:
    """The :class:`AlignedLinear` subclass that pads to ``multiple`` (one class per multiple)."""
    if multiple not in _ALIGNED:
        _ALIGNED[multiple] = type(f"AlignedLinear{multiple}", (AlignedLinear,), {"multiple": multiple, "__module__": __name__})
    return _ALIGNED[multiple]


_ALIGNED: dict[int, type[AlignedLinear]] = {AlignedLinear.multiple: AlignedLinear}


def padded_width(features: int, multiple: int) -> int:
    """``features`` rounded up to a multiple of ``multiple``: the width :func:`padded_linear` computes on."""
    return -(-features // multiple) * multiple


def padded_linear(x: Tensor, weight: Tensor, bias: Tensor | None, multiple: int) -> Tensor:
    """``F.linear(x, weight, bias)`` computed on a weight padded with zero rows to a multiple of
    ``multiple`` output features, the output sliced back: the same values, but the GEMM writes
    rows whose length is aligned (cuBLAS picks slower kernels for a leading dimension such as
    50,257). Under autocast the weight is cast before it is padded, so the pad copies half-size
    data; the returned tensor is a view whose rows are the padded width apart."""
    out_features = weight.shape[0]
    pad = padded_width(out_features, multiple) - out_features
    if pad == 0:
        return F.linear(x, weight, bias)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    weight = F.pad(weight, (0, 0, 0, pad))
    bias = F.pad(bias, (0, pad)) if bias is not None else None
    return F.linear(x, weight, bias)[..., :out_features]
