"""triton_layers' matcher, decisions and emitter for method sources (see :mod:`speedkit.rungs.triton_layers`):
``F.cross_entropy(logits[.float()][.view(-1, V)], t, …)``, ``self.proj(self.act(self.fc(x)))`` (a
Linear→tanh-GELU→Linear MLP), ``self.act(self.fc(x))`` / ``F.gelu(self.fc(x))`` (Linear→GELU),
``F.silu(g) * u`` (SwiGLU) and ``F.gelu(g) * u`` (GeGLU; either with ``self.act(g)``, an activation
module decided per instance by what it computes), and ``apply_rotary_pos_emb(q, k, cos, sin)`` (a
function named for rotary embeddings that computes the rotate-half form), found and rewritten in one
deterministic walk into calls to :mod:`speedkit.kernels.layers`; per instance, whether the modules named
are the plain PyTorch ones without hooks.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedkit.kernels import layers
from speedkit.kernels.recognise import computes_gelu, computes_rotary, computes_silu
from speedkit.rewrite.ast_tools import SCOPES, call_ops, local_names, resolve, self_attr, self_attribute, where
from speedkit.rewrite.pipeline import Decided, Found, Rewriter
from speedkit.rewrite.source import ParsedMethod, copy_tree

_CE_KEYWORDS = {"input", "target", "reduction", "ignore_index", "label_smoothing"}


@dataclass
class Site:
    kind: str  # "cross_entropy" | "gelu" | "gelu_mlp" | "swiglu" (a gated product: SwiGLU or GeGLU) | "rotary"
    line: int
    fc: str = ""  # gelu, gelu_mlp: the Linear's attribute
    act: str = ""  # gelu, gelu_mlp: the GELU module's attribute ("" for F.gelu)
    proj: str = ""  # gelu_mlp: the outer Linear's attribute (its site is followed by the inner gelu site)
    #: gelu_mlp: the same call read as a Linear→GELU pair (``self.act(self.fc(x))`` has both readings)
    alt: Site | None = None
    #: swiglu, per operand (left, right): "" for ``F.silu(a)``, "attr" for ``self.attr(a)``, None for neither
    silu: tuple[str | None, str | None] = (None, None)
    #: swiglu, per operand: True for ``F.gelu(a[, approximate=…])``
    gelu: tuple[bool, bool] = (False, False)
    #: swiglu, per operand: the index of the site the operand itself is (a Linear→GELU pair,
    #: ``self.act(self.fc(x))``), left as written when the product is rewritten around it
    inner: tuple[int | None, int | None] = (None, None)
    #: swiglu: the operands' nodes while the sites are found (their ``inner`` indices are read from them)
    operands: tuple[Any, ...] = ()
    #: rotary: the function called
    function: Any = None


class Sites(ast.NodeTransformer):
    """Finds (``decisions`` None) or rewrites (one decision per site, falsy to keep it) the sites of
    one method, in one deterministic walk: site k of a copy of the tree is site k of the original."""

    def __init__(self, parsed: ParsedMethod, decisions: tuple[Any, ...] | None = None) -> None:
        self.parsed, self.decisions = parsed, decisions
        self.self_name = parsed.self_name
        self.local_names = local_names(parsed)
        self.sites: list[Site] = []
        self.notes: list[str] = []

    def run(self, tree: ast.FunctionDef) -> Sites:
        self.root = tree
        self.nodes: list[int] = []  # id of each site's node, in site order
        self.visit(tree)
        index = {node: i for i, node in enumerate(self.nodes)}
        for site in self.sites:
            if site.operands:
                site.inner = (index.get(id(site.operands[0])), index.get(id(site.operands[1])))
                site.operands = ()
        return self

    # names ---------------------------------------------------------------------------------------------
    def _resolve(self, node: ast.AST) -> Any:
        """The object a global/closure name or a module attribute chain names, else None."""
        return resolve(self.parsed, self.local_names, node)

    def _is(self, node: ast.AST, target: Any) -> bool:
        return self._resolve(node) is target

    def _self_call(self, node: ast.AST) -> str | None:
        """``'attr'`` when node is ``self.attr(x)`` with one positional argument and no keywords."""
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords and not isinstance(node.args[0], ast.Starred):
            return self_attribute(node.func, self.self_name)
        return None

    # walk ----------------------------------------------------------------------------------------------
    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, SCOPES) and node is not self.root:  # other scopes, other names
            return node
        site = self._match(node)  # matched on the node as written, the same in both modes
        index = len(self.sites)
        if site is not None:
            self.sites.append(site)
            self.nodes.append(id(node))
        node = self.generic_visit(node)
        if site is not None and self.decisions is not None and self.decisions[index]:
            node = ast.copy_location(self._emit(node, site, self.decisions[index]), node)
        return node

    def _match(self, node: ast.AST) -> Site | None:
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Call) and self._is(node.func, F.cross_entropy):
            return self._match_cross_entropy(node)
        rotary = self._match_rotary(node)
        if rotary is not None:
            return rotary
        proj = self._self_call(node)
        if proj is not None:
            inner = self._match_gelu(node.args[0])
            if inner is not None:
                return Site("gelu_mlp", line, fc=inner.fc, act=inner.act, proj=proj, alt=self._match_gelu(node))
        gelu = self._match_gelu(node)
        if gelu is not None:
            return gelu
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            silu = (self._silu(node.left), self._silu(node.right))
            gelu = (self._gelu_call(node.left), self._gelu_call(node.right))
            if silu != (None, None) or any(gelu):
                return Site("swiglu", line, silu=silu, gelu=gelu, operands=(node.left, node.right))
        return None

    def _match_gelu(self, node: ast.AST) -> Site | None:
        """``self.act(self.fc(x))`` or ``F.gelu(self.fc(x)[, approximate=…])``."""
        if isinstance(node, ast.Call) and len(node.args) == 1 and not isinstance(node.args[0], ast.Starred):
            fc = self._self_call(node.args[0])
            if fc is not None:
                act = self_attribute(node.func, self.self_name)
                if act is not None and not node.keywords:
                    return Site("gelu", getattr(node, "lineno", 0), fc=fc, act=act)
                if self._is(node.func, F.gelu) and all(k.arg == "approximate" for k in node.keywords):
                    return Site("gelu", getattr(node, "lineno", 0), fc=fc)
        return None

    def _match_cross_entropy(self, node: ast.Call) -> Site | None:
        def skip(reason: str) -> None:
            self.notes.append(f"{where(self.parsed, node)}: F.cross_entropy {reason}")

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
        return Site("cross_entropy", node.lineno)

    def _silu(self, node: ast.AST) -> str | None:
        """ "" for ``F.silu(a)``, "attr" for ``self.attr(a)`` (an nn.SiLU, or a library's module computing
        one, decided per instance), else None."""
        if not (isinstance(node, ast.Call) and len(node.args) == 1 and not isinstance(node.args[0], ast.Starred)):
            return None
        if self._is(node.func, F.silu) and all(
            k.arg == "inplace" and isinstance(k.value, ast.Constant) and k.value.value is False for k in node.keywords
        ):
            return ""
        return self_attribute(node.func, self.self_name) if not node.keywords else None

    def _match_rotary(self, node: ast.AST) -> Site | None:
        """``f(q, k, cos, sin[, unsqueeze_dim])`` for a Python function ``f`` named for rotary embeddings
        (``rotary`` or ``rope`` in its name; what it computes is probed per function when deciding)."""
        if not (isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args)):
            return None
        if not (4 <= len(node.args) <= 5 and all(k.arg == "unsqueeze_dim" for k in node.keywords)):
            return None
        fn = self._resolve(node.func)
        name = getattr(fn, "__name__", "").lower()
        if not (inspect.isfunction(fn) and ("rotary" in name or "rope" in name)):
            return None
        return Site("rotary", getattr(node, "lineno", 0), function=fn)

    def _gelu_call(self, node: ast.AST) -> bool:
        """``F.gelu(a)`` or ``F.gelu(a, approximate=…)``."""
        return (
            isinstance(node, ast.Call)
            and len(node.args) == 1
            and not isinstance(node.args[0], ast.Starred)
            and self._is(node.func, F.gelu)
            and all(k.arg == "approximate" for k in node.keywords)
        )

    # emit ----------------------------------------------------------------------------------------------
    def _emit(self, node: Any, site: Site, decision: Any) -> ast.expr:
        if site.kind == "cross_entropy":
            args, keywords = list(node.args), list(node.keywords)
            if args:
                args[0], upcast = self._strip_upcast(args[0])
            else:
                k = next(i for i, kw in enumerate(keywords) if kw.arg == "input")
                value, upcast = self._strip_upcast(keywords[k].value)
                keywords[k] = ast.keyword(arg="input", value=value)
            return call_ops("cross_entropy", *args, keywords=[*keywords, ast.keyword(arg="upcast", value=ast.Constant(upcast))])
        if site.kind == "rotary":
            return call_ops("rotary_pos_emb", node.func, *node.args, keywords=list(node.keywords))
        if site.kind == "gelu" or decision == "gelu":
            inner = node.args[0]  # self.fc(x)
            act = node.func if site.act else ast.Constant(None)
            return call_ops("linear_gelu", inner.func, act, inner.args[0], keywords=list(node.keywords))
        if site.kind == "gelu_mlp":  # self.proj(<gelu>), the inner gelu site left as written
            gelu = node.args[0]
            fc_call = gelu.args[0]
            act = gelu.func if site.act else ast.Constant(None)
            return call_ops("gelu_mlp", node.func, act, fc_call.func, fc_call.args[0], keywords=list(gelu.keywords))
        function, where = decision  # ("silu_mul" | "gelu_mul", "left" | "right"): the operand holding the activation
        side = 0 if where == "left" else 1
        act, other = (node.left, node.right) if side == 0 else (node.right, node.left)
        gate, up = ast.keyword(arg="gate", value=act.args[0]), ast.keyword(arg="up", value=other)
        keywords = [gate, up] if side == 0 else [up, gate]  # keyword arguments evaluate in source order
        if site.silu[side]:  # self.attr(g): the module is passed, its class read at run time
            keywords.insert(0, ast.keyword(arg="act", value=self_attr(self.self_name, site.silu[side])))
        else:  # F.gelu(g, approximate=…): its keyword goes along
            keywords += list(act.keywords) if function == "gelu_mul" else []
        return call_ops(function, keywords=keywords)

    def _strip_upcast(self, node: ast.expr) -> tuple[ast.expr, bool]:
        """The logits expression without its ``.float()`` (also under ``.view``/``.reshape``/``.flatten``)."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            return node, False
        attr, args, kws = node.func.attr, node.args, node.keywords
        if (attr == "float" and not args and not kws) or (
            attr == "to" and len(args) == 1 and not kws and self._resolve(args[0]) is torch.float32
        ):
            return self._strip_upcast(node.func.value)[0], True
        # shape-only methods: a one-argument view/reshape could be a dtype view, which the upcast changes
        shape_only = (
            attr in ("view", "reshape")
            and not kws
            and (len(args) >= 2 or (len(args) == 1 and isinstance(args[0], (ast.Tuple, ast.List))))
            or attr in ("flatten", "contiguous")
        ) and not any(isinstance(a, ast.Starred) for a in args)
        if shape_only:
            inner, upcast = self._strip_upcast(node.func.value)
            if upcast:
                return ast.Call(func=ast.Attribute(value=inner, attr=attr, ctx=ast.Load()), args=args, keywords=kws), True
        return node, False


def decide(module: nn.Module, parsed: ParsedMethod, found: Found, options: Any) -> Decided:
    """Per site of this instance: how to rewrite it (falsy: not); the kinds rewritten; reasons for near
    misses (``options``: the rung's, which kinds it may rewrite)."""
    decisions, done = [], []
    notes = [f"{type(module).__name__}.{parsed.name}: {n}" for n in found.notes]
    inside_mlp = False  # the gelu site right after a gelu_mlp site taken is its inner part
    inside_product: set[int] = set()  # the operands of gated products taken that are sites of their own
    for index, site in enumerate(found.sites):
        ok: Any = False
        note = None
        kind = site.kind
        if inside_mlp or index in inside_product:
            inside_mlp = False
            decisions.append(False)
            continue
        if site.kind == "cross_entropy":
            ok = options.cross_entropy
        elif site.kind == "rotary":
            if options.rotary:
                ok = computes_rotary(site.function)
                if not ok:
                    note = f"{site.function.__name__}(…) (line {site.line}): computes something other than the rotate-half rotary embedding"
        elif site.kind == "gelu_mlp":
            if options.gelu_mlp:
                ok, note = _decide_gelu_mlp(module, site)
                inside_mlp = bool(ok)
            if not ok and site.alt is not None and options.gelu:  # the same call read as a Linear→GELU pair
                ok, alt_note = _decide_gelu(module, site.alt)
                ok, note, kind = ok and "gelu", note or alt_note, "gelu"
        elif site.kind == "gelu" and options.gelu:
            ok, note = _decide_gelu(module, site)
        elif site.kind == "swiglu":
            ok, kind, note = _decide_gated(module, site, options)
            if ok:
                inner = site.inner[0 if ok[1] == "left" else 1]
                if inner is not None:
                    inside_product.add(inner)
        decisions.append(ok)
        if ok:
            done.append(kind)
        if note:
            notes.append(f"{type(module).__name__}: {note}")
    return Decided(tuple(decisions), done, notes)


def _decide_gated(module: nn.Module, site: Site, options: Any) -> tuple[Any, str, str | None]:
    """How a gated product of this instance is rewritten: ``(function, side)`` or False; the kind
    counted ("swiglu" or "geglu"); the reason where it nearly was."""
    note = None
    for side, attr, gelu in zip(("left", "right"), site.silu, site.gelu):
        if gelu:
            if options.geglu:
                return ("gelu_mul", side), "geglu", None
            continue
        if attr is None:
            continue
        if attr == "":
            if options.swiglu:
                return ("silu_mul", side), "swiglu", None
            continue
        act = getattr(module, attr, None)
        if not isinstance(act, nn.Module):
            continue
        if layers.hooked(act):
            note = f"self.{attr}(…) * … (line {site.line}): hooks on the activation would be skipped"
        elif computes_silu(act) and options.swiglu:
            return ("silu_mul", side), "swiglu", None
        elif computes_gelu(act) is not None and options.geglu:
            return ("gelu_mul", side), "geglu", None
        elif isinstance(act, (nn.SiLU, nn.GELU)):
            base = "SiLU" if isinstance(act, nn.SiLU) else "GELU"
            note = f"self.{attr}(…) * … (line {site.line}): an nn.{base} subclass, or in place"
    return False, "swiglu", note


def _decide_gelu(module: nn.Module, site: Site) -> tuple[bool, str | None]:
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


def _decide_gelu_mlp(module: nn.Module, site: Site) -> tuple[bool, str | None]:
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


def find(parsed: ParsedMethod) -> Found:
    """The sites of ``parsed`` (a walk of a copy of its tree) and its near misses."""
    sites = Sites(parsed).run(copy_tree(parsed))
    return Found(sites.sites, sites.notes)


def emit(parsed: ParsedMethod, tree: ast.FunctionDef, decisions: tuple[Any, ...]) -> None:
    """Rewrite ``tree`` (a fresh copy of ``parsed.tree``) in place, in the same walk that finds the sites."""
    Sites(parsed, decisions).run(tree)


LAYERS = Rewriter("triton_layers", find, emit)
