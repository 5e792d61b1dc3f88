"""triton_layers: the memory-bound layers of training on speedkit's fused Triton kernels.

Speeds up: layers that read and write whole activations for little arithmetic — LayerNorm and
RMSNorm (statistics and affine in one pass, a persistent backward), softmax cross-entropy over a
large vocabulary (the gradient computed in the forward, no fp32 copy of the logits even where the
code upcasts them with ``.float()``), the bias + GELU after a Linear, and SwiGLU's ``silu(g) * u``.
Does not help: compute-bound models (large GEMMs dominate), small activations, and norms and
activations in code that ``torch.compile`` traces: there the swapped layers run PyTorch's ops and
leave the fusion to Inductor, which fuses them with their neighbours better than an opaque kernel
call (see :mod:`speedkit.layers`). The cross-entropy kernel stays under compile (a forward op that
keeps only the log-sum-exp, a backward op that writes the gradient in one pass).
Measured on an H200 (GPT-2 small, bf16 autocast, TF32, fused AdamW, SDPA, 16×1024 tokens): eager,
the fused cross-entropy takes the step from 46.9 to 38.4 ms and the peak memory from 17.2 to 10.6 GB
(an earlier run: the norm kernels alone 51.0 ms and bias+GELU 49.9 ms against 48.1, slower than
PyTorch's, the host overhead of a Python launch per call dominating at these sizes); with compile on
top, 32.55 ms with the rung against 33.14 ms without (the ladder's closing check measures this on
every run: ``recheck``).
Needs: Triton and an NVIDIA GPU of compute capability 8.0 or newer (CPU tensors under
``TRITON_INTERPRET=1``, for tests).

What is swapped, in the order it is done, all on one handle:

1. exact ``nn.LayerNorm`` / ``nn.RMSNorm`` (over one last dim) and ``nn.CrossEntropyLoss`` (without
   class weights) instances get the class of their :mod:`speedkit.layers` subclass: the same
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
   and a GELU, and
   ``F.silu(g) * u`` (or an ``nn.SiLU`` module) become calls to the functions of
   :mod:`speedkit.layers`, which check at run time that the kernel computes what the code would
   and run the code as written otherwise.
4. Hugging Face models that compute their causal- or masked-LM loss themselves
   (``model(input_ids, labels=labels)``) get a per-instance ``loss_function`` computing exactly
   transformers' loss through the fused cross-entropy (see :mod:`speedkit.hf_loss`).

Left alone, with the reason in the report: subclasses of the PyTorch modules (user code), norms
over several dims, cross-entropy with class weights, a Linear or GELU with hooks, modules whose
computation only resembles an RMSNorm (Gemma's ``1 + weight``), Linear→GELU inside ``nn.Sequential``
(torch's own forward is not rewritten), Hugging Face models with another loss or whose forward does
not call ``self.loss_function``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import math
import textwrap
import types
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedkit import hf_loss, layers, rewrite
from speedkit.kernels import cublaslt, kernels_available
from speedkit.rewrite import NotRewritable, ParsedForward
from speedkit.rungs.base import Handle, Rung, nested
from speedkit.state import TrainState

NOTHING_FOUND = ("nothing to swap: no nn.LayerNorm/RMSNorm, RMSNorm-like module, cross-entropy, Hugging Face LM loss, "
                 "Linear→GELU or SwiGLU found")
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


# -- 1. module classes ------------------------------------------------------------------------------------


def _class_swap(module: nn.Module, options: TritonLayersOptions) -> tuple[type | None, str | None]:
    """(the speedkit class to give ``module``, or None; a left-alone reason, or None)."""
    cls = type(module)
    if cls in layers.SWAPS.values():
        return None, None  # already swapped
    wanted = options.norms if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) else options.cross_entropy
    base = next((b for b in layers.SWAPS if isinstance(module, b)), None)
    if base is None or not wanted:
        return None, None
    if cls is not base:
        return None, f"{cls.__name__} subclasses nn.{base.__name__}: user code, not swapped"
    if base is nn.CrossEntropyLoss:
        return (None, "nn.CrossEntropyLoss with class weights: the kernel has none") if module.weight is not None else (layers.CrossEntropyLoss, None)
    if len(module.normalized_shape) != 1:
        return None, f"nn.{base.__name__}{tuple(module.normalized_shape)} normalizes over {len(module.normalized_shape)} dims; the kernels take one"
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
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD) \
        and params[0].default is params[0].empty


def _rms_like(module: nn.Module) -> tuple[str, float] | str | None:
    """``(parameter name, eps)`` when ``module`` computes an RMSNorm; a reason when it has the shape
    of one (and "norm" in its name) but computes something else; None when it is no candidate."""
    if not rewrite.is_user_module(module) or isinstance(module, tuple(layers.SWAPS)) \
            or list(module.buffers()) or list(module.children()):
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


# -- 3. source rewrites: F.cross_entropy, Linear→GELU, SwiGLU ---------------------------------------------


_CE_KEYWORDS = {"input", "target", "reduction", "ignore_index", "label_smoothing"}
_SCOPES = (ast.Lambda, ast.ClassDef, ast.AsyncFunctionDef, ast.FunctionDef)


@dataclass
class _Site:
    kind: str  # "cross_entropy" | "gelu" | "gelu_mlp" | "swiglu"
    line: int
    fc: str = ""   # gelu, gelu_mlp: the Linear's attribute
    act: str = ""  # gelu, gelu_mlp: the GELU module's attribute ("" for F.gelu)
    proj: str = ""  # gelu_mlp: the outer Linear's attribute (its site is followed by the inner gelu site)
    #: gelu_mlp: the same call read as a Linear→GELU pair (``self.act(self.fc(x))`` has both readings)
    alt: _Site | None = None
    #: swiglu, per operand (left, right): "" for ``F.silu(a)``, "attr" for ``self.attr(a)``, None for neither
    silu: tuple[str | None, str | None] = (None, None)


class _Sites(ast.NodeTransformer):
    """Finds (``decisions`` None) or rewrites (one decision per site, falsy to keep it) the sites of
    one method, in one deterministic walk: site k of a copy of the tree is site k of the original."""

    def __init__(self, parsed: ParsedForward, decisions: tuple[Any, ...] | None = None) -> None:
        self.parsed, self.decisions = parsed, decisions
        self.self_name = parsed.self_name
        a = parsed.tree.args
        self.local_names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x is not None}
        self.local_names |= rewrite.names_stored(parsed.tree) - {parsed.tree.name}
        fn = parsed.function
        self.closure = {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())
                        if n != "__class__" and _filled(c)}
        self.sites: list[_Site] = []
        self.notes: list[str] = []

    def run(self, tree: ast.FunctionDef) -> _Sites:
        self.root = tree
        self.visit(tree)
        return self

    # names ---------------------------------------------------------------------------------------------
    def _resolve(self, node: ast.AST) -> Any:
        """The object a global/closure name or a module attribute chain names, else None."""
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value)
            return getattr(base, node.attr, None) if isinstance(base, types.ModuleType) else None
        if isinstance(node, ast.Name) and node.id not in self.local_names:
            if node.id in self.closure:
                return self.closure[node.id]
            return self.parsed.function.__globals__.get(node.id, getattr(builtins, node.id, None))
        return None

    def _is(self, node: ast.AST, target: Any) -> bool:
        return self._resolve(node) is target

    def _self_call(self, node: ast.AST) -> str | None:
        """``'attr'`` when node is ``self.attr(x)`` with one positional argument and no keywords."""
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and not isinstance(node.args[0], ast.Starred):
            return rewrite.self_attribute(node.func, self.self_name)
        return None

    # walk ----------------------------------------------------------------------------------------------
    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, _SCOPES) and node is not self.root:  # other scopes, other names
            return node
        site = self._match(node)  # matched on the node as written, the same in both modes
        index = len(self.sites)
        if site is not None:
            self.sites.append(site)
        node = self.generic_visit(node)
        if site is not None and self.decisions is not None and self.decisions[index]:
            node = ast.copy_location(self._emit(node, site, self.decisions[index]), node)
        return node

    def _match(self, node: ast.AST) -> _Site | None:
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Call) and self._is(node.func, F.cross_entropy):
            return self._match_cross_entropy(node)
        proj = self._self_call(node)
        if proj is not None:
            inner = self._match_gelu(node.args[0])
            if inner is not None:
                return _Site("gelu_mlp", line, fc=inner.fc, act=inner.act, proj=proj, alt=self._match_gelu(node))
        gelu = self._match_gelu(node)
        if gelu is not None:
            return gelu
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            silu = (self._silu(node.left), self._silu(node.right))
            if silu != (None, None):
                return _Site("swiglu", line, silu=silu)
        return None

    def _match_gelu(self, node: ast.AST) -> _Site | None:
        """``self.act(self.fc(x))`` or ``F.gelu(self.fc(x)[, approximate=…])``."""
        if isinstance(node, ast.Call) and len(node.args) == 1 and not isinstance(node.args[0], ast.Starred):
            fc = self._self_call(node.args[0])
            if fc is not None:
                act = rewrite.self_attribute(node.func, self.self_name)
                if act is not None and not node.keywords:
                    return _Site("gelu", getattr(node, "lineno", 0), fc=fc, act=act)
                if self._is(node.func, F.gelu) and all(k.arg == "approximate" for k in node.keywords):
                    return _Site("gelu", getattr(node, "lineno", 0), fc=fc)
        return None

    def _match_cross_entropy(self, node: ast.Call) -> _Site | None:
        def skip(reason: str) -> None:
            self.notes.append(f"{rewrite.where(self.parsed, node)}: F.cross_entropy {reason}")

        names = [k.arg for k in node.keywords]
        if any(isinstance(a, ast.Starred) for a in node.args) or None in names:
            return skip("with *args/**kwargs (arguments unknown until run time)")
        if len(node.args) > 2 or "weight" in names:
            return skip("with class weights (weight=): the kernel has none")
        unknown = sorted(set(names) - _CE_KEYWORDS)
        if unknown:
            return skip(f"with {', '.join(unknown)}=: not taken by the kernel")
        if len(node.args) + len({"input", "target"} & set(names)) != 2:
            return None
        return _Site("cross_entropy", node.lineno)

    def _silu(self, node: ast.AST) -> str | None:
        """"" for ``F.silu(a)``, "attr" for ``self.attr(a)`` (an nn.SiLU decided per instance), else None."""
        if not (isinstance(node, ast.Call) and len(node.args) == 1 and not isinstance(node.args[0], ast.Starred)):
            return None
        if self._is(node.func, F.silu) and all(k.arg == "inplace" and isinstance(k.value, ast.Constant) and k.value.value is False
                                               for k in node.keywords):
            return ""
        return rewrite.self_attribute(node.func, self.self_name) if not node.keywords else None

    # emit ----------------------------------------------------------------------------------------------
    def _emit(self, node: Any, site: _Site, decision: Any) -> ast.expr:
        self_load = lambda attr: ast.Attribute(value=ast.Name(id=self.self_name, ctx=ast.Load()), attr=attr, ctx=ast.Load())  # noqa: E731
        if site.kind == "cross_entropy":
            args, keywords = list(node.args), list(node.keywords)
            if args:
                args[0], upcast = self._strip_upcast(args[0])
            else:
                k = next(i for i, kw in enumerate(keywords) if kw.arg == "input")
                value, upcast = self._strip_upcast(keywords[k].value)
                keywords[k] = ast.keyword(arg="input", value=value)
            return _ops_call("cross_entropy", args, [*keywords, ast.keyword(arg="upcast", value=ast.Constant(upcast))])
        if site.kind == "gelu" or decision == "gelu":
            inner = node.args[0]  # self.fc(x)
            act = node.func if site.act else ast.Constant(None)
            return _ops_call("linear_gelu", [inner.func, act, inner.args[0]], list(node.keywords))
        if site.kind == "gelu_mlp":  # self.proj(<gelu>), the inner gelu site left as written
            gelu = node.args[0]
            fc_call = gelu.args[0]
            act = gelu.func if site.act else ast.Constant(None)
            return _ops_call("gelu_mlp", [node.func, act, fc_call.func, fc_call.args[0]], list(gelu.keywords))
        side = 0 if decision == "left" else 1  # the operand holding the silu
        silu, other = (node.left, node.right) if side == 0 else (node.right, node.left)
        gate, up = ast.keyword(arg="gate", value=silu.args[0]), ast.keyword(arg="up", value=other)
        keywords = [gate, up] if side == 0 else [up, gate]  # keyword arguments evaluate in source order
        if site.silu[side]:
            keywords.insert(0, ast.keyword(arg="act", value=self_load(site.silu[side])))
        return _ops_call("silu_mul", [], keywords)

    def _strip_upcast(self, node: ast.expr) -> tuple[ast.expr, bool]:
        """The logits expression without its ``.float()`` (also under ``.view``/``.reshape``/``.flatten``)."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            return node, False
        attr, args, kws = node.func.attr, node.args, node.keywords
        if (attr == "float" and not args and not kws) or (attr == "to" and len(args) == 1 and not kws
                                                           and self._resolve(args[0]) is torch.float32):
            return self._strip_upcast(node.func.value)[0], True
        # shape-only methods: a one-argument view/reshape could be a dtype view, which the upcast changes
        shape_only = (attr in ("view", "reshape") and not kws and (len(args) >= 2 or (len(args) == 1 and isinstance(args[0], (ast.Tuple, ast.List))))
                      or attr in ("flatten", "contiguous")) and not any(isinstance(a, ast.Starred) for a in args)
        if shape_only:
            inner, upcast = self._strip_upcast(node.func.value)
            if upcast:
                return ast.Call(func=ast.Attribute(value=inner, attr=attr, ctx=ast.Load()), args=args, keywords=kws), True
        return node, False


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _ops_call(name: str, args: list[ast.expr], keywords: list[ast.keyword]) -> ast.Call:
    call = rewrite.call_ops(name)
    call.args, call.keywords = args, keywords
    return call


@functools.lru_cache(maxsize=None)
def _analyze(parsed: ParsedForward) -> _Sites:
    return _Sites(parsed).run(rewrite.copy_tree(parsed))


@functools.lru_cache(maxsize=None)
def _compiled(parsed: ParsedForward, decisions: tuple[Any, ...]) -> Callable[..., Any]:
    tree = rewrite.copy_tree(parsed)
    _Sites(parsed, decisions).run(tree)
    return rewrite.compile_forward(parsed, tree, TAG)


def _decide(module: nn.Module, sites: list[_Site], options: TritonLayersOptions) -> tuple[tuple[Any, ...], list[str], list[str]]:
    """Per site of this instance: how to rewrite it (falsy: not); the kinds rewritten; reasons for near misses."""
    decisions, done, notes = [], [], []
    inside_mlp = False  # the gelu site right after a gelu_mlp site taken is its inner part
    for site in sites:
        ok: Any = False
        note = None
        kind = site.kind
        if inside_mlp:
            inside_mlp = False
            decisions.append(False)
            continue
        if site.kind == "cross_entropy":
            ok = options.cross_entropy
        elif site.kind == "gelu_mlp":
            if options.gelu_mlp:
                ok, note = _decide_gelu_mlp(module, site)
                inside_mlp = bool(ok)
            if not ok and site.alt is not None and options.gelu:  # the same call read as a Linear→GELU pair
                ok, alt_note = _decide_gelu(module, site.alt)
                ok, note, kind = ok and "gelu", note or alt_note, "gelu"
        elif site.kind == "gelu" and options.gelu:
            ok, note = _decide_gelu(module, site)
        elif site.kind == "swiglu" and options.swiglu:
            for side, attr in zip(("left", "right"), site.silu):
                act = getattr(module, attr, None) if attr else None
                if attr == "" or (type(act) is nn.SiLU and not act.inplace and not layers.hooked(act)):
                    ok = side
                    break
                if isinstance(act, nn.SiLU):
                    note = f"self.{attr}(…) * … (line {site.line}): an nn.SiLU subclass, in place, or with hooks"
        decisions.append(ok)
        if ok:
            done.append(kind)
        if note:
            notes.append(f"{type(module).__name__}: {note}")
    return tuple(decisions), done, notes


def _decide_gelu(module: nn.Module, site: _Site) -> tuple[bool, str | None]:
    """Whether a Linear→GELU site of this instance is fused; the reason where it nearly was."""
    fc, act = getattr(module, site.fc, None), getattr(module, site.act, None) if site.act else None
    if not (isinstance(fc, nn.Linear) and (not site.act or isinstance(act, nn.GELU))):  # not a Linear→GELU pair
        return False, None
    pair = f"self.{site.fc}→{'self.' + site.act if site.act else 'F.gelu'} (line {site.line})"
    if type(fc) is not nn.Linear or (site.act and type(act) is not nn.GELU):
        return False, f"{pair}: a subclass of nn.Linear/nn.GELU (user code)"
    if fc.bias is None:
        return False, f"{pair}: the Linear has no bias to fuse"
    if layers.hooked(fc) or (act is not None and layers.hooked(act)):
        return False, f"{pair}: hooks on the Linear or GELU would be skipped"
    return True, None


def _decide_gelu_mlp(module: nn.Module, site: _Site) -> tuple[bool, str | None]:
    """Whether a Linear(GELU(Linear)) site of this instance goes to cuBLASLt; the reason where it nearly did."""
    fc, proj = getattr(module, site.fc, None), getattr(module, site.proj, None)
    act = getattr(module, site.act, None) if site.act else None
    if not (type(fc) is nn.Linear and type(proj) is nn.Linear and (not site.act or type(act) is nn.GELU)):
        return False, None
    mlp = f"self.{site.proj}(…self.{site.fc}…) (line {site.line})"
    if fc.bias is None or proj.bias is None:
        return False, f"{mlp}: a Linear without bias (cuBLASLt's epilogue adds one)"
    if act is not None and act.approximate != "tanh":
        return False, f"{mlp}: exact GELU; cuBLASLt's epilogue computes the tanh one"
    if any(layers.hooked(m) for m in (fc, proj, act) if m is not None):
        return False, f"{mlp}: hooks on the Linears or GELU would be skipped"
    return True, None  # F.gelu's approximate= is read at run time


@functools.lru_cache(maxsize=None)
def _parse_method(cls: type, name: str) -> ParsedForward:
    """Like :func:`rewrite.parse_forward` for another method (``training_step``)."""
    owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
    function = owner.__dict__[name] if owner is not None else None
    if not isinstance(function, types.FunctionType):
        raise NotRewritable(f"{cls.__name__}.{name} is not a plain Python function")
    if function.__module__.split(".")[0] in ("torch", "lightning", "pytorch_lightning"):
        raise NotRewritable(f"{cls.__name__}.{name} is the library's own")
    try:
        lines, first_line = inspect.getsourcelines(function)
        filename = inspect.getsourcefile(function) or "<unknown>"
        module = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise NotRewritable(f"source of {cls.__name__}.{name} is not available ({exc})") from None
    tree = module.body[0]
    if not isinstance(tree, ast.FunctionDef) or tree.decorator_list:
        raise NotRewritable(f"{cls.__name__}.{name} is decorated or not a def")
    ast.increment_lineno(module, first_line - 1)
    # the defining class as ``cls``: compile_forward mangles private names and resolves super() with it
    return ParsedForward(owner, function, tree, filename, first_line)


def _instance_method(module: nn.Module, name: str) -> ParsedForward:
    """What to transform for ``module.<name>``: the class's method, or an earlier speedkit rewrite of it."""
    if name == "forward":
        return rewrite.parse_module_forward(module)
    bound = module.__dict__.get(name)
    if bound is None:
        return _parse_method(type(module), name)
    parsed = getattr(getattr(bound, "__func__", None), "__speedkit_parsed__", None)
    if parsed is None:
        raise NotRewritable(f"{type(module).__name__} already has an instance-level {name} (patched)")
    return parsed


def _bind_method(handle: Handle, module: nn.Module, name: str, function: Callable[..., Any], description: str) -> None:
    """``rewrite.bind_forward`` for any method name (``forward`` keeps its checks)."""
    if name == "forward":
        rewrite.bind_forward(handle, module, function, description)
    else:
        rewrite.bind_method(handle, module, name, function, description)


# -- the plan and the rung ----------------------------------------------------------------------------------


@dataclass
class _Plan:
    swaps: list[tuple[nn.Module, type]] = field(default_factory=list)
    rms_like: list[tuple[nn.Module, Callable[..., Any], str]] = field(default_factory=list)
    #: (module, method name, parsed source, decisions, kinds rewritten)
    rewrites: list[tuple[nn.Module, str, ParsedForward, tuple[Any, ...], list[str]]] = field(default_factory=list)
    hf_losses: list[hf_loss.LossSite] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    left_alone: list[str] = field(default_factory=list)

    @property
    def swapped(self) -> int:
        return sum(self.counts.values())


_KIND_NAMES = {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm", "CrossEntropyLoss": "cross_entropy"}


def plan_triton_layers(model: nn.Module, options: TritonLayersOptions) -> _Plan:
    """What :func:`apply_triton_layers` would swap and what it leaves alone (probes RMSNorm-like
    modules on tiny random inputs; parses each class's source once)."""
    plan = _Plan()
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
                plan.rms_like.append((module, forward, f"{type(module).__name__}.forward → speedkit rms_norm(x, self.{param}, eps={eps:g})"))
                plan.counts["rms_like"] += 1
                rms_modules.add(id(module))
            elif found:
                plan.left_alone.append(found)
    if options.cross_entropy or options.gelu or options.gelu_mlp or options.swiglu:
        targets = [(m, "forward") for m in model.modules() if rewrite.is_user_module(m) and id(m) not in rms_modules
                   and type(m) not in layers.SWAPS.values()]
        if callable(getattr(model, "training_step", None)):
            targets.append((model, "training_step"))
        for module, method in targets:
            try:
                parsed = _instance_method(module, method)
            except NotRewritable as exc:
                defined_in = getattr(getattr(type(module), method, None), "__module__", "") or ""
                if module is model and rewrite.is_user_code(defined_in):  # the loss is usually computed here: say why
                    plan.left_alone.append(f"{type(module).__name__}.{method} not rewritten: {exc}")
                continue
            analysis = _analyze(parsed)
            plan.left_alone += [f"{type(module).__name__}.{method}: {n}" for n in analysis.notes]
            decisions, done, notes = _decide(module, analysis.sites, options)
            plan.left_alone += notes
            if done:
                plan.rewrites.append((module, method, parsed, decisions, done))
                plan.counts.update(done)
    if options.cross_entropy:
        plan.hf_losses, notes = hf_loss.find(model)
        if plan.hf_losses:
            plan.counts["hf_loss"] = len(plan.hf_losses)
        plan.left_alone += notes
    plan.left_alone = list(dict.fromkeys(plan.left_alone))
    return plan


def apply_triton_layers(model: nn.Module, options: TritonLayersOptions, plan: _Plan | None = None) -> Handle:
    """Swap what :func:`plan_triton_layers` found; ``handle.undo()`` puts every class and method back."""
    plan = plan if plan is not None else plan_triton_layers(model, options)
    handle, inner = Handle(TAG), Handle(TAG)
    try:
        for module, new_class in plan.swaps:
            # same object, parameters, hooks and state dict
            inner.record("", functools.partial(setattr, module, "__class__", type(module)),
                         functools.partial(setattr, module, "__class__", new_class))
            module.__class__ = new_class
        for module, forward, description in plan.rms_like:
            rewrite.bind_forward(inner, module, forward, description)
        for module, method, parsed, decisions, done in plan.rewrites:
            _bind_method(inner, module, method, _compiled(parsed, decisions),
                         f"{type(module).__name__}.{method} rewritten: {', '.join(f'{k} ×{n}' for k, n in Counter(done).items())}")
        for site in plan.hf_losses:
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
    handle.sites = {  # type: ignore[attr-defined]
        **{k: plan.counts.get(k, 0) for k in ("layer_norm", "rms_norm", "rms_like", "cross_entropy", "hf_loss", "gelu", "gelu_mlp", "swiglu")},
        "left_alone": list(plan.left_alone),
    }
    return handle


class TritonLayersRung(Rung):
    """Swaps norms, cross-entropy (Hugging Face models' own loss too), Linear→GELU and SwiGLU for
    speedkit's Triton kernels.

    ``check`` says why the kernels cannot run on the device, or that nothing was found;
    ``apply`` returns a handle whose ``sites`` dict counts the swaps per kind and lists what was
    left alone.
    """

    name = TAG
    judged_at_full_precision = True
    Options = TritonLayersOptions
    recheck = True  # pays in eager; whether it still pays under torch.compile is measured, not assumed

    def check(self, state: TrainState) -> str | None:
        reason = kernels_available(state.device)
        if reason is not None:
            return reason
        plan = plan_triton_layers(state.model, self.options)
        if plan.swapped == 0:
            return NOTHING_FOUND + (f" (left alone: {'; '.join(plan.left_alone)})" if plan.left_alone else "")
        return None

    def apply(self, state: TrainState) -> Handle:
        layers.probe_autocast(state.device.type)  # now, not inside the first step (or a CUDA graph capture)
        if state.device.type == "cuda":
            cublaslt.unavailable()  # finds (loads) cuBLASLt now, for the same reason
        return apply_triton_layers(state.model, self.options)
