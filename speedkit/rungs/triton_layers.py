"""triton_layers: the memory-bound layers of training on speedkit's fused Triton kernels.

Speeds up: layers that read and write whole activations for little arithmetic — LayerNorm and
RMSNorm (statistics and affine in one pass, a persistent backward), softmax cross-entropy over a
large vocabulary (the gradient computed in the forward, no fp32 copy of the logits even where the
code upcasts them with ``.float()``), the bias + GELU after a Linear, the gated MLP products
(SwiGLU's ``silu(g) * u``, GeGLU's ``gelu(g) * u``) and the rotate-half rotary embedding of q and k.
Does not help: compute-bound models (large GEMMs dominate), small activations, and norms and
activations in code that ``torch.compile`` traces: there the swapped layers run PyTorch's ops and
leave the fusion to Inductor, which fuses them with their neighbours better than an opaque kernel
call (see :mod:`speedkit.kernels.layers`), except a norm or a gated product whose kernel was
measured faster than Inductor's code at each shape it is fed (:mod:`speedkit.kernels.choice`). The
cross-entropy kernel stays under compile (a forward op keeping only the log-sum-exp, a backward op writing the
gradient in one pass).
Needs: Triton and an NVIDIA GPU of compute capability 8.0 or newer (CPU tensors under
``TRITON_INTERPRET=1``, for tests).
Numerics: fp32 statistics. Norms take their mean and variance in fp32 whatever the input's dtype, and
the cross-entropy its log-sum-exp; kernels sum in their own order.

Measured on an H200 (GPT-2 small, bf16 autocast, TF32, fused AdamW, SDPA, 16×1024 tokens): eager,
the fused cross-entropy takes the step from 46.9 to 38.4 ms and the peak memory from 17.2 to 10.6 GB
(an earlier run: the norm kernels alone 51.0 ms and bias+GELU 49.9 ms against 48.1, slower than
PyTorch's, the host overhead of a Python launch per call dominating at these sizes); with compile on
top, 32.55 ms with the rung against 33.14 ms without (the ladder's closing check measures this on
every run: ``recheck``).

What is swapped, in the order it is done, all on one handle:

1. exact ``nn.LayerNorm`` / ``nn.RMSNorm`` (over one last dim) and ``nn.CrossEntropyLoss`` (without
   class weights) instances get the class of their :mod:`speedkit.kernels.layers` subclass: the same
   object, parameters, hooks and state dict; undo assigns the original class back.
2. user modules that compute an RMSNorm, recognised by what they compute and not by name (one
   (N,) parameter, no buffers or children, a one-tensor forward whose output matches
   ``x · rsqrt(mean(x²) + eps) · weight`` on random inputs, also with the weight perturbed, for an
   ``eps`` read from one of their float attributes) get an instance ``forward`` calling the kernel.
3. in the source of user modules' ``forward`` and of the LightningModule's ``training_step``,
   rewritten through :mod:`speedkit.rewrite`: ``F.cross_entropy(logits[.float()][.view(-1, V)], t, …)``,
   ``self.proj(self.act(self.fc(x)))`` / ``self.proj(F.gelu(self.fc(x), approximate="tanh"))`` for two
   Linears with biases around a tanh-GELU (GPT-2's MLP: the GELU and its derivative in cuBLASLt's GEMM
   epilogues, :mod:`speedkit.kernels.cublaslt`, kept under torch.compile; in fp32 without autocast
   it runs as the next form), ``self.act(self.fc(x))`` / ``F.gelu(self.fc(x))`` for a Linear with bias
   and a GELU, and the gated products ``F.silu(g) * u`` (SwiGLU) and ``F.gelu(g[, approximate=…]) * u``
   (GeGLU), with ``self.act(g)`` for PyTorch's module or a library's own one that computes the same
   (transformers' ``SiLUActivation`` / ``GELUTanh``, given a stand-in class the functions know), and a
   call of a model's rotate-half rotary function (``apply_rotary_pos_emb(q, k, cos, sin)``, recognised
   by what it computes; its kernel runs outside compiled code only) become calls to the functions of
   :mod:`speedkit.kernels.layers`, which check at run time that the kernel computes what the code would
   and run the code as written otherwise.
4. Hugging Face models that compute their causal- or masked-LM loss themselves
   (``model(input_ids, labels=labels)``) get a per-instance ``loss_function`` computing exactly
   transformers' loss through the fused cross-entropy (see :mod:`speedkit.rewrite.hf_loss`).

Left alone, with the reason in the report: subclasses of the PyTorch modules (user code), norms
over several dims, cross-entropy with class weights, a Linear or GELU with hooks, modules whose
computation only resembles an RMSNorm (Gemma's ``1 + weight``), Linear→GELU inside ``nn.Sequential``
(torch's own forward is not rewritten), Hugging Face models with another loss or whose forward does
not call ``self.loss_function``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from speedkit.kernels import choice as kernel_choice
from speedkit.kernels import cublaslt, kernels_available, layers
from speedkit.kernels.recognise import computes_gelu, computes_silu, gates
from speedkit.measure import layer_shapes
from speedkit.rewrite import hf_loss
from speedkit.rewrite.layers import LAYERS, decide
from speedkit.rewrite.pipeline import MethodRewrite, RewritePlan, RewriteReport, apply_plan, plan_rewrites
from speedkit.rewrite.source import NotRewritable, is_user_code, is_user_module
from speedkit.rungs.base import Handle, RewriteRung, nested
from speedkit.training.state import TrainState

NOTHING_FOUND = (
    "nothing to swap: no nn.LayerNorm/RMSNorm, RMSNorm-like module, cross-entropy, Hugging Face LM loss, "
    "Linear→GELU, SwiGLU, GeGLU or rotary embedding found"
)
TAG = "triton_layers"


@dataclass
class TritonLayersOptions:
    """Options of the triton_layers rung: which layers it may swap."""

    #: exact ``nn.LayerNorm`` and ``nn.RMSNorm`` modules
    norms: bool = True
    #: user modules that compute an RMSNorm (recognised by their output on random inputs)
    rms_like: bool = True
    #: ``F.cross_entropy`` calls in forwards / training_step, ``nn.CrossEntropyLoss`` modules, and the
    #: loss of Hugging Face causal- / masked-LM models
    cross_entropy: bool = True
    #: ``GELU(Linear(x))``: the Linear's bias added inside the GELU kernel
    gelu: bool = True
    #: ``Linear(GELU(Linear(x)))`` with the tanh-GELU: the GELU in the first GEMM's epilogue and its
    #: derivative in the backward GEMM's (cuBLASLt), also under torch.compile
    gelu_mlp: bool = True
    #: ``silu(gate) * up``
    swiglu: bool = True
    #: ``gelu(gate) * up`` (exact or tanh)
    geglu: bool = True
    #: a model's rotate-half rotary function (``apply_rotary_pos_emb(q, k, cos, sin)``), outside compiled code
    rotary: bool = True
    #: a norm or a gated product keeps its kernel inside compiled code where a micro-benchmark at the shape
    #: the step feeds it measured the kernel faster than Inductor's code (:mod:`speedkit.kernels.choice`)
    kernel_choice: bool = True


# -- 1. module classes ------------------------------------------------------------------------------------


def _class_swap(module: nn.Module, options: TritonLayersOptions) -> tuple[type | None, str | None]:
    """(the speedkit class to give ``module``, or None; a left-alone reason, or None)."""
    cls = type(module)
    if cls in layers.SWAPS.values() or cls in layers.UNDER_COMPILE.values():
        return None, None  # already swapped
    wanted = options.norms if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) else options.cross_entropy
    base = next((b for b in layers.SWAPS if isinstance(module, b)), None)
    if base is None or not wanted:
        return None, None
    if cls is not base:
        return None, f"{cls.__name__} subclasses nn.{base.__name__}: user code, not swapped"
    if base is nn.CrossEntropyLoss:
        return (
            (None, "nn.CrossEntropyLoss with class weights: the kernel has none")
            if module.weight is not None
            else (layers.CrossEntropyLoss, None)
        )
    if len(module.normalized_shape) != 1:
        return (
            None,
            f"nn.{base.__name__}{tuple(module.normalized_shape)} normalizes over {len(module.normalized_shape)} dims; the kernels take one",
        )
    return layers.SWAPS[base], None


# -- 2. RMSNorm-like user modules, recognised by what they compute ----------------------------------------


def _rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _matches(forward: Callable, module: nn.Module, weight: torch.Tensor, eps: float, inputs: list[torch.Tensor]) -> bool:
    for x in inputs:
        try:
            out = forward(module, x)
        except Exception:  # a forward that cannot take our probe is not an RMSNorm we can replace
            return False
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or not out.is_floating_point():
            return False
        ref = _rms_reference(x, weight, eps)
        err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
        if not err <= 1e-5:  # NaN fails too
            return False
    return True


def _one_tensor_forward(forward: Callable) -> bool:
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return (
        len(params) == 1
        and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)
        and params[0].default is params[0].empty
    )


def _rms_like(module: nn.Module) -> tuple[str, float] | str | None:
    """``(parameter name, eps)`` when ``module`` computes an RMSNorm; a reason when it has the shape
    of one (and "norm" in its name) but computes something else; None when it is no candidate."""
    if not is_user_module(module) or isinstance(module, tuple(layers.SWAPS)) or list(module.buffers()) or list(module.children()):
        return None
    params = list(module.named_parameters(recurse=False))
    if len(params) != 1 or params[0][1].dim() != 1 or not params[0][1].is_floating_point() or params[0][1].is_meta:
        return None
    name, weight = params[0]
    forward = type(module).forward
    if "forward" in module.__dict__ or not isinstance(forward, types.FunctionType) or not _one_tensor_forward(forward):
        return None
    normish = "norm" in type(module).__name__.lower()
    candidates = sorted({v for v in vars(module).values() if type(v) is float and 0.0 < v < 1.0})
    if not candidates:
        return f"{type(module).__name__}: no float attribute to read eps from" if normish else None
    n = weight.shape[0]
    gen = torch.Generator(device=weight.device).manual_seed(0)
    saved = weight.detach().clone()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=weight.device)

    # two odd shapes; one input at the eps scale, where a wrong eps shows
    shapes = [(3, 5, n), (7, n)]
    try:
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for eps in candidates:
                inputs = [randn(*s) for s in shapes] + [randn(*shapes[1]) * math.sqrt(eps)]
                if not _matches(forward, module, saved, eps, inputs):
                    continue
                # a module ignoring (or offsetting) its weight matched only by luck of the weight's values
                weight.copy_(saved + randn(n).to(saved.dtype))
                if _matches(forward, module, weight.detach(), eps, inputs):
                    return name, eps
                weight.copy_(saved)
    finally:
        with torch.no_grad():
            weight.copy_(saved)  # bit-exact: a copy of the same dtype
    return f"{type(module).__name__}: computes something other than x·rsqrt(mean(x²)+eps)·{name}" if normish else None


# -- the plan and the rung ----------------------------------------------------------------------------------


_KIND_NAMES = {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm", "CrossEntropyLoss": "cross_entropy"}
_REPORTED = ("layer_norm", "rms_norm", "rms_like", "cross_entropy", "hf_loss", "gelu", "gelu_mlp", "swiglu", "geglu", "rotary")


def plan_triton_layers(model: nn.Module, options: TritonLayersOptions) -> RewritePlan:
    """What :func:`apply_triton_layers` would swap and what it leaves alone (probes RMSNorm-like
    modules on tiny random inputs; parses each class's source once); ``plan.extra``: the Hugging
    Face losses."""
    plan = RewritePlan()
    rms_modules: set[int] = set()
    for module in model.modules():
        new_class, reason = _class_swap(module, options)
        if new_class is not None:
            plan.swaps.append((module, new_class))
            plan.counts[_KIND_NAMES[new_class.__name__]] += 1
        if reason:
            plan.left_alone.append(reason)
        if type(module) is nn.Sequential and options.gelu:
            kids = list(module)
            if any(type(a) is nn.Linear and type(b) is nn.GELU for a, b in zip(kids, kids[1:])):
                plan.left_alone.append("Linear→GELU inside nn.Sequential not fused (torch's own forward is not rewritten)")
        if options.rms_like:
            found = _rms_like(module)
            if isinstance(found, tuple):
                param, eps = found
                forward = layers.rms_like_forward(param, eps, type(module).forward)
                plan.bindings.append(
                    (
                        module,
                        "forward",
                        forward,
                        f"{type(module).__name__}.forward → speedkit rms_norm(x, self.{param}, eps={eps:g})",
                    )
                )
                plan.counts["rms_like"] += 1
                rms_modules.add(id(module))
            elif found:
                plan.left_alone.append(found)
    if options.cross_entropy or options.gelu or options.gelu_mlp or options.swiglu or options.geglu or options.rotary:
        targets = [
            (m, "forward")
            for m in model.modules()
            if is_user_module(m)
            and id(m) not in rms_modules
            and type(m) not in layers.SWAPS.values()
            and type(m) not in layers.UNDER_COMPILE.values()
        ]
        if callable(getattr(model, "training_step", None)):
            targets.append((model, "training_step"))

        def refused(module: nn.Module, method: str, exc: NotRewritable) -> str | None:
            defined_in = getattr(getattr(type(module), method, None), "__module__", "") or ""
            if module is model and is_user_code(defined_in):  # the loss is usually computed here: say why
                return f"{type(module).__name__}.{method} not rewritten: {exc}"
            return None

        plan.rewrites, left_alone = plan_rewrites(
            LAYERS, targets, lambda m, parsed, found: decide(m, parsed, found, options), refused
        )
        plan.left_alone += left_alone
        for rewrite in plan.rewrites:
            plan.counts.update(rewrite.done)
    # a library's own SiLU / GELU module that a gated product calls gets the stand-in silu_mul / gelu_mul knows
    plan.swaps += [(act, _stand_in(act)) for act in _gate_activations(plan) if type(act) not in (nn.SiLU, nn.GELU)]
    if options.cross_entropy:
        plan.extra, notes = hf_loss.find(model)
        if plan.extra:
            plan.counts["hf_loss"] = len(plan.extra)
        plan.left_alone += notes
    plan.left_alone = list(dict.fromkeys(plan.left_alone))
    return plan


def choose_under_compile(
    state: TrainState, plan: RewritePlan, timer: kernel_choice.Timer | None = None
) -> tuple[RewritePlan, list[str]]:
    """``plan`` with its norms and gated products' activations whose kernel is faster than Inductor's code at every
    shape the baseline fed them (:mod:`speedkit.measure.layer_shapes`) given the class that keeps the
    kernel under compile (a copy: the plan ``check`` made stays as made), and one line per layer and shape
    saying what was measured or remembered."""
    fed = state.notes.get(layer_shapes.NOTE) or {}
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(state.precision)
    store = kernel_choice.store_for(state.notes)
    swaps: list[tuple[nn.Module, type]] = []
    lines: list[str] = []

    def kernel_faster(module: nn.Module, label: str) -> bool:
        """The kernel won at every shape the baseline fed ``module`` (none recorded: it did not)."""
        verdicts = []
        for shape, dtype in fed.get(id(module), ()):
            case = kernel_choice.case_of(module, shape, autocast or dtype, autocast)
            assert case is not None  # a norm swapped for one of UNDER_COMPILE's classes, or a gated product's activation
            choice = kernel_choice.choose(case, state.device, store, timer)
            verdicts.append(choice.use_kernel)
            lines.append(f"{label} at {case.describe()}: {choice.why}")
        return bool(verdicts) and all(verdicts)

    for module, new_class in plan.swaps:
        under = layers.UNDER_COMPILE.get(new_class)
        label = _GATED.get(new_class, type(module).__name__)
        swaps.append((module, under) if under is not None and kernel_faster(module, label) else (module, new_class))
    for act in _gate_activations(plan, (nn.SiLU, nn.GELU)):
        if kernel_faster(act, _GATED[type(act)]):
            swaps.append((act, layers.UNDER_COMPILE[type(act)]))
    return dataclasses.replace(plan, swaps=swaps), list(dict.fromkeys(lines))


#: a gated product's label in the kernel choice's lines, by its activation's class
_GATED = {nn.SiLU: "SwiGLU", layers.SiLU: "SwiGLU", nn.GELU: "GeGLU", layers.GELU: "GeGLU", layers.GELUTanh: "GeGLU"}


def _gate_activations(plan: RewritePlan, classes: tuple[type[nn.Module], ...] | None = None) -> list[nn.Module]:
    """The SiLU and GELU children (PyTorch's modules, or a library's module computing one) of the modules
    whose methods the plan rewrites with a gated product (the ``act`` that
    :func:`speedkit.kernels.layers.silu_mul` / ``gelu_mul`` is given; called alone, its under-compile class
    is PyTorch's), each once; only those of exactly ``classes`` where given."""
    acts: dict[int, nn.Module] = {}
    for rewrite in plan.rewrites:
        if "swiglu" in rewrite.done or "geglu" in rewrite.done:
            for child in rewrite.module.children():
                if gates(child) and not layers.hooked(child) and (classes is None or type(child) in classes):
                    acts.setdefault(id(child), child)
    return list(acts.values())


def _stand_in(act: nn.Module) -> type[nn.Module]:
    """The class that tells silu_mul / gelu_mul what a library's activation module computes."""
    if computes_silu(act):
        return layers.SiLU
    return layers.GELUTanh if computes_gelu(act) == "tanh" else layers.GELU


def _describe(rewrite: MethodRewrite) -> str:
    kinds = ", ".join(f"{k} ×{n}" for k, n in Counter(rewrite.done).items())
    return f"{type(rewrite.module).__name__}.{rewrite.method} rewritten: {kinds}"


def apply_triton_layers(model: nn.Module, options: TritonLayersOptions, plan: RewritePlan | None = None) -> Handle:
    """Swap what :func:`plan_triton_layers` found; ``handle.undo()`` puts every class and method back."""
    plan = plan if plan is not None else plan_triton_layers(model, options)
    handle, inner = Handle(TAG), Handle(TAG)
    apply_plan(inner, LAYERS, plan, _describe)
    try:
        for site in plan.extra or []:
            hf_loss.swap(inner, site)
    except Exception:
        inner.undo()
        raise
    summary = ", ".join(f"{kind} ×{count}" for kind, count in plan.counts.items()) or "none"
    nested(handle, inner, f"triton_layers: {summary}")
    for description, count in Counter(c for c in inner.changes if c).items():
        handle.changes.append(description + (f" (×{count} modules)" if count > 1 else ""))
    for note in plan.left_alone:
        handle.record(f"left alone: {note}")
    handle.rewrite = RewriteReport(TAG, {k: plan.counts.get(k, 0) for k in _REPORTED}, tuple(plan.left_alone))
    return handle


class TritonLayersRung(RewriteRung):
    """Swaps norms, cross-entropy (Hugging Face models' own loss too), Linear→GELU and SwiGLU for
    speedkit's Triton kernels.

    ``check`` says why the kernels cannot run on the device, or that nothing was found; ``apply``
    applies the plan ``check`` made (made again only if the model changed since) and returns a handle
    whose ``rewrite`` report counts the swaps per kind and lists what was left alone.
    """

    name = TAG
    # LayerNorm/RMSNorm, (log-)softmax cross-entropy, bias + GELU and SwiGLU's product in fused kernels;
    # the cross-entropy keeps no fp32 copy of the logits
    targets = ("normalization", "loss", "elementwise", "memory")
    Options = TritonLayersOptions
    recheck = True  # pays in eager; whether it still pays under torch.compile is measured, not assumed

    def make_plan(self, model: nn.Module) -> RewritePlan:
        return plan_triton_layers(model, self.options)

    def check(self, state: TrainState) -> str | None:
        return kernels_available(state.device) or super().check(state)

    def why_not(self, plan: RewritePlan) -> str | None:
        if plan.counts.total() == 0:
            return NOTHING_FOUND + (f" (left alone: {'; '.join(plan.left_alone)})" if plan.left_alone else "")
        return None

    #: the micro-benchmark's timer (None: CUDA events on a CUDA device, nothing measured elsewhere)
    timer: kernel_choice.Timer | None = None

    def apply(self, state: TrainState) -> Handle:
        layers.probe_autocast(state.device.type)  # now, not inside the first step (or a CUDA graph capture)
        if state.device.type == "cuda":
            cublaslt.unavailable()  # finds (loads) cuBLASLt now, for the same reason
        plan, chosen = self.plan(state.model), []
        if self.options.kernel_choice:
            plan, chosen = choose_under_compile(state, plan, self.timer)
        handle = self.apply_plan(state.model, plan)
        for line in chosen:
            handle.record(line)
        return handle

    def apply_plan(self, model: nn.Module, plan: RewritePlan) -> Handle:
        return apply_triton_layers(model, self.options, plan)
