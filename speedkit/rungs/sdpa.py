"""sdpa: replace hand-written attention with ``F.scaled_dot_product_attention``.

Speeds up: models that compute attention by hand (``softmax(q @ kᵀ * scale + mask) @ v``), which
materialize the (B, H, T, T) score matrix several times per layer. SDPA runs flash or
memory-efficient kernels that never store it: less memory traffic, less memory, and — with a
causal mask recognised as such — half the work.
Does not help: models already on SDPA / ``nn.MultiheadAttention``; very short sequences.
Needs: nothing beyond PyTorch (flash kernels need a recent GPU and fp16/bf16; SDPA picks).

Detection works on the computation, not on names: in every user module's ``forward`` source,
a statement computing ``q @ kᵀ`` (``@``, ``torch.matmul``, ``torch.bmm``, or a canonical
``einsum``), optionally scaled (multiply or divide, inline or in later statements), then masked
(``masked_fill(M, -inf)`` and/or ``+ mask``, possibly under an ``if``), then ``softmax`` over the
last dim (also in fp32 and cast back), optionally dropped out, then multiplied by ``v``. Each step
is recorded where the user's statement stood (so evaluation order is unchanged) and the final
``@ v`` becomes one :func:`speedkit.ops.attention` call. A mask that is exactly a causal buffer
sliced to a square (checked on the buffer's values at apply time) becomes ``is_causal=True``.

Left alone, with the reason in the report: weights used between the steps, pre-softmax scores
used afterwards, weights returned or stored while attention dropout is on (they could not match),
a softmax over another dim, a mask fill value other than -inf, a scale after an additive mask.
Weights returned or stored *without* dropout stay exact: they are computed on demand only where
the code reads them.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from speedkit import rewrite
from speedkit.library_switches import SwitchPlan, apply_switches, plan_switches
from speedkit.rewrite import NotRewritable, ParsedForward, call_ops
from speedkit.rungs.base import Handle, Rung
from speedkit.state import TrainState

_NEG_INF_SOURCES = {"float('-inf')", '-float("inf")', "-float('inf')", "-math.inf", "-torch.inf", "-np.inf", "-numpy.inf",
                    "float('-Inf')", "-float('Inf')"}


class _Skip(Exception):
    """This candidate is not rewritten; the message says why."""


class _Unrecognized(_Skip):
    """A statement uses the candidate's values in a way that is not an attention step."""


def new_name(st: ast.stmt) -> str:
    """The single name a statement binds, or ''."""
    if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
        return st.targets[0].id
    return ""


# -- small AST predicates ---------------------------------------------------------------------------


def _src(node: ast.AST) -> str:
    return ast.unparse(node)


def _is_torch_attr(node: ast.AST, *names: str) -> bool:
    """``torch.<name>`` / ``torch.nn.functional.<name>`` / ``F.<name>`` / ``nn.functional.<name>``."""
    if not isinstance(node, ast.Attribute) or node.attr not in names:
        return False
    owner = _src(node.value)
    return owner in ("torch", "F", "nn.functional", "torch.nn.functional", "functional")


def _matmul_operands(node: ast.AST) -> tuple[ast.expr, ast.expr] | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    if isinstance(node, ast.Call) and _is_torch_attr(node.func, "matmul", "bmm") and len(node.args) == 2 and not node.keywords:
        return node.args[0], node.args[1]
    return None


def _einsum(node: ast.AST) -> tuple[str, ast.expr, ast.expr] | None:
    if (isinstance(node, ast.Call) and _is_torch_attr(node.func, "einsum") and len(node.args) == 3 and not node.keywords
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value.replace(" ", ""), node.args[1], node.args[2]
    return None


def _split_einsum(eq: str) -> tuple[str, str, str] | None:
    if "->" not in eq or eq.count(",") != 1:
        return None
    ins, out = eq.split("->")
    a, b = ins.split(",")
    return a, b, out


def _einsum_tails(eq: str) -> tuple[str, str, str] | None:
    """The last two subscripts of each operand and of the output, when all three share one batch
    prefix (letters or '...') that the tails do not reuse; None otherwise."""
    parts = _split_einsum(eq)
    if not parts or min(len(x) for x in parts) < 2:
        return None
    a, b, out = parts
    prefix = a[:-2]
    if b[:-2] != prefix or out[:-2] != prefix:
        return None
    tails = a[-2:], b[-2:], out[-2:]
    if set("".join(tails)) & set(prefix.replace(".", "")):
        return None
    return tails


def _canonical_scores_eq(eq: str) -> bool:
    """'<P>id,<P>jd-><P>ij': q (..., L, E), k (..., S, E) -> scores (..., L, S)."""
    tails = _einsum_tails(eq)
    if tails is None:
        return False
    (i, d), (j, d2), out = tails
    return d2 == d and out == i + j and len({i, j, d}) == 3


def _canonical_output_eq(eq: str) -> bool:
    """'<P>ij,<P>jd-><P>id': weights (..., L, S) times v (..., S, E)."""
    tails = _einsum_tails(eq)
    if tails is None:
        return False
    (i, j), (j2, d), out = tails
    return j2 == j and out == i + d and len({i, j, d}) == 3


def _is_neg_inf(node: ast.AST) -> bool:
    return _src(node).replace('"', "'") in {s.replace('"', "'") for s in _NEG_INF_SOURCES}


def _is_last_dim(args: list[ast.expr], keywords: list[ast.keyword], pos: int) -> bool:
    dim = next((k.value for k in keywords if k.arg == "dim"), args[pos] if len(args) > pos else None)
    return dim is not None and _src(dim) == "-1"


def _walk_expressions(stmt: ast.stmt):
    """The expression nodes of one statement, not descending into nested statements or scopes."""
    todo = [c for c in ast.iter_child_nodes(stmt) if not isinstance(c, ast.stmt)]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.stmt))


def _after_softmax(ops: list[tuple[str, Any]]) -> bool:
    return any(k == "softmax" for k, _ in ops)


def _tuple(*items: ast.expr) -> ast.Tuple:
    return ast.Tuple(elts=list(items), ctx=ast.Load())


def _const(value: Any) -> ast.Constant:
    return ast.Constant(value=value)


def _name(id_: str, store: bool = False) -> ast.Name:
    return ast.Name(id=id_, ctx=ast.Store() if store else ast.Load())


# -- one attention site ---------------------------------------------------------------------------


@dataclass
class _Site:
    """A matched attention pattern inside one statement block of a forward."""

    block: list[ast.stmt]
    start: int                         # index in block of the scores statement
    final_stmt: ast.stmt               # the statement holding the final `@ v`
    final_node: ast.expr               # the `@ v` expression inside it
    final_v: ast.expr
    final_eq: str | None
    head: tuple                        # ("mm", q, kT) | ("einsum", eq, q, k)
    steps: list[tuple[ast.stmt, ast.stmt | None, list[tuple[str, Any]]]] = field(default_factory=list)
    #   (statement in block, pattern statement inside it if it is an If (else None), ops it contributes)
    names: set[str] = field(default_factory=set)
    scores_names: set[str] = field(default_factory=set)   # names that held pre-softmax scores
    probs_name: str = ""
    causal_mask: ast.expr | None = None                  # the mask M of the only fill, when a candidate
    dropout: list[tuple[str, ast.expr]] = field(default_factory=list)
    escapes: list[ast.Name] = field(default_factory=list)
    line: int = 0


def _parse_scores(expr: ast.expr) -> tuple[tuple, list[tuple[str, ast.expr]]]:
    """The head of the pattern and any scale applied inline: ``(q @ kT) * c``, ``c * (q @ kT)``, ``/ c``."""
    ops = _matmul_operands(expr)
    if ops:
        return ("mm", ops[0], ops[1]), []
    es = _einsum(expr)
    if es:
        if not _canonical_scores_eq(es[0]):
            raise _Skip(f"einsum {es[0]!r} is not in the (..., L, E) x (..., S, E) layout SDPA takes")
        return ("einsum", es[0], es[1], es[2]), []
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Mult, ast.Div)):
        try:
            head, scale = _parse_scores(expr.left)
            return head, scale + [("mul" if isinstance(expr.op, ast.Mult) else "div", expr.right)]
        except _NoScores:
            if isinstance(expr.op, ast.Mult):
                head, scale = _parse_scores(expr.right)
                return head, scale + [("mul", expr.left)]
            raise
    raise _NoScores


class _NoScores(Exception):
    pass


class _Analyzer:
    """Finds attention sites in one parsed forward."""

    def __init__(self, tree: ast.FunctionDef, self_name: str) -> None:
        self.tree = tree
        self.self_name = self_name
        self.sites: list[_Site] = []
        self.left_alone: list[tuple[int, str]] = []
        self._loops: dict[int, ast.AST] = {}

    # blocks ------------------------------------------------------------------------------------
    def run(self) -> None:
        self._visit_block(self.tree.body, in_loop=None)

    def _visit_block(self, block: list[ast.stmt], in_loop: ast.AST | None) -> None:
        i = 0
        while i < len(block):
            stmt = block[i]
            site = None
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                try:
                    site = self._match(block, i)
                except _NoScores:
                    site = None
                except _Skip as skip:
                    self.left_alone.append((stmt.lineno, str(skip)))
                    site = None
            if site is not None:
                try:
                    self._check_liveness(site, in_loop)
                    self.sites.append(site)
                except _Skip as skip:
                    self.left_alone.append((stmt.lineno, str(skip)))
            self._find_inline(stmt)
            for child in self._child_blocks(stmt):
                loop = stmt if isinstance(stmt, (ast.For, ast.While, ast.AsyncFor)) else in_loop
                self._visit_block(child, loop)
            i += 1

    def _find_inline(self, stmt: ast.stmt) -> None:
        """``softmax(q @ kT * c [+ mask]) @ v`` written as one expression."""
        for node in _walk_expressions(stmt):
            ops = _matmul_operands(node)
            final_eq = None
            if ops is None:
                es = _einsum(node)
                if not (es and _canonical_output_eq(es[0])):
                    continue
                final_eq, ops = es[0], (es[1], es[2])
            try:
                chain = self._chain(ops[0], None, "scores", False, node.lineno)
            except _NoScores:
                continue
            except _Skip as skip:
                self.left_alone.append((node.lineno, str(skip)))
                continue
            if not chain or chain[0][0] != "head" or not _after_softmax(chain[1:]):
                continue
            site = _Site([], 0, stmt, node, ops[1], final_eq, chain[0][1], line=node.lineno)
            site.steps = [(None, None, chain[1:])]  # type: ignore[list-item]
            site.inline = True  # type: ignore[attr-defined]
            site.dropout = [(k, e) for k, e in chain[1:] if k in ("dropout", "dropout_module")]
            fills = [e for k, e in chain[1:] if k == "fill"]
            site.causal_mask = fills[0] if len(fills) == 1 and not any(k == "add" for k, _ in chain[1:]) else None
            self.sites.append(site)

    @staticmethod
    def _child_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
        out = []
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                out.append(block)
        for handler in getattr(stmt, "handlers", []) or []:
            out.append(handler.body)
        return out

    # one candidate --------------------------------------------------------------------------------
    def _match(self, block: list[ast.stmt], i: int) -> _Site | None:
        stmt = block[i]
        first = self._chain(stmt.value, None, "scores", False, stmt.lineno)
        if not first or first[0][0] != "head":
            raise _NoScores  # no q @ kT at the root of this statement
        head, first_ops = first[0][1], first[1:]
        current = stmt.targets[0].id
        site = _Site(block, i, stmt, stmt, stmt.value, None, head, line=stmt.lineno)
        site.names = {current}
        site.scores_names = set() if _after_softmax(first_ops) else {current}
        site.steps.append((stmt, None, first_ops))
        stage = "probs" if _after_softmax(first_ops) else "scores"
        seen_add = any(k == "add" for k, _ in first_ops)
        fills: list[tuple[ast.expr, bool]] = [(e, False) for k, e in first_ops if k == "fill"]
        site.dropout += [(k, e) for k, e in first_ops if k in ("dropout", "dropout_module")]
        for j in range(i + 1, len(block)):
            st = block[j]
            touched = rewrite.names_loaded(st) | rewrite.names_stored(st)
            if not (touched & site.names):
                continue
            if isinstance(st, ast.If) and stage == "scores" and not st.orelse:
                inner = [s for s in st.body if (rewrite.names_loaded(s) | rewrite.names_stored(s)) & site.names]
                if len(inner) != 1 or (rewrite.names_loaded(st.test) & site.names):
                    raise _Skip(f"line {st.lineno}: the scores are used in a conditional block in a way that is not a mask")
                ops, new = self._step(inner[0], current, stage, seen_add)
                if new != current or not all(k in ("fill", "add") for k, _ in ops):
                    raise _Skip(f"line {st.lineno}: only a mask may be applied conditionally to the scores")
                site.steps.append((st, inner[0], ops))
                seen_add |= any(k == "add" for k, _ in ops)
                fills += [(e, True) for k, e in ops if k == "fill"]
                continue
            if stage == "probs":
                final = self._final_use(st, current)
                if final is not None:
                    site.final_stmt, (site.final_node, site.final_v, site.final_eq) = st, final
                    site.probs_name = current
                    site.causal_mask = fills[0][0] if (len(fills) == 1 and not fills[0][1] and not seen_add) else None
                    return site
            try:
                ops, new = self._step(st, current, stage, seen_add)
            except _Unrecognized:
                # before the softmax, a product that goes elsewhere is just a matmul, unless a
                # softmax of it follows: then it is attention we cannot rewrite, and we say so
                if stage == "scores" and not self._softmax_follows(block, j, site.names | {new_name(st)}):
                    raise _NoScores from None
                raise
            if any(k == "softmax" for k, _ in ops):
                stage = "probs"
            seen_add |= any(k == "add" for k, _ in ops)
            fills += [(e, False) for k, e in ops if k == "fill"]
            site.dropout += [(k, e) for k, e in ops if k in ("dropout", "dropout_module")]
            site.steps.append((st, None, ops))
            if stage == "scores" and new != current:
                site.scores_names.add(new)
            site.names.add(new)
            current = new
        if stage == "probs":
            raise _Skip(f"softmax of q @ kT at line {stmt.lineno} is never multiplied by v in the same block")
        raise _NoScores  # a matmul that never reached a softmax: not attention

    def _step(self, st: ast.stmt, cur: str, stage: str, seen_add: bool) -> tuple[list[tuple[str, Any]], str]:
        """The ops one statement applies to the pattern's current value, and the name it binds."""
        what = "scores" if stage == "scores" else "weights"
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
            raise _Unrecognized(f"line {st.lineno}: the attention {what} are used by a statement that is not part of attention")
        target, value = st.targets[0].id, st.value
        ops = self._chain(value, cur, stage, seen_add, st.lineno)
        if ops is None:
            raise _Unrecognized(f"line {st.lineno}: `{_src(value)[:80]}` uses the attention {what} in a way SDPA cannot express")
        return ops, target

    @staticmethod
    def _softmax_follows(block: list[ast.stmt], j: int, names: set[str]) -> bool:
        for st in block[j:]:
            for node in ast.walk(st):
                if isinstance(node, ast.Call) and ((_is_torch_attr(node.func, "softmax") and node.args
                                                    and rewrite.names_loaded(node.args[0]) & names)
                                                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "softmax"
                                                       and rewrite.names_loaded(node.func.value) & names)):
                    return True
        return False

    def _chain(self, value: ast.expr, cur: str, stage: str, seen_add: bool, line: int) -> list[tuple[str, Any]] | None:
        """Decompose ``value`` into ops applied to ``Name(cur)``, innermost first; None if it is not such a chain."""
        if cur is not None and isinstance(value, ast.Name) and value.id == cur:
            return []
        if cur is None:  # the first statement: the chain starts at q @ kT (with any inline scale)
            try:
                head, scale = _parse_scores(value)
                return [("head", head)] + [(k, e) for k, e in scale]
            except _NoScores:
                pass
        names = lambda n: rewrite.names_loaded(n) if cur is not None else set()  # noqa: E731
        # binary ops: scale and additive mask
        if isinstance(value, ast.BinOp) and stage == "scores":
            if isinstance(value.op, (ast.Mult, ast.Div)):
                inner, other = value.left, value.right
                if isinstance(value.op, ast.Mult) and cur in names(value.right) and cur not in names(value.left):
                    inner, other = value.right, value.left
                if cur in names(other):
                    return None
                rest = self._chain(inner, cur, stage, seen_add, line)
                if rest is None or _after_softmax(rest):
                    return None
                if seen_add or any(k == "add" for k, _ in rest):
                    raise _Skip(f"line {line}: the scores are scaled after an additive mask")
                return rest + [("mul" if isinstance(value.op, ast.Mult) else "div", other)]
            if isinstance(value.op, ast.Add):
                inner, other = value.left, value.right
                if cur in names(value.right) and cur not in names(value.left):
                    inner, other = value.right, value.left
                if cur in names(other):
                    return None
                rest = self._chain(inner, cur, stage, seen_add, line)
                return None if rest is None or _after_softmax(rest) else rest + [("add", other)]
            return None
        if not isinstance(value, ast.Call):
            return None
        func = value.func
        # softmax as a function: F.softmax(x, dim=-1[, dtype=...]) / torch.softmax(x, -1)
        if _is_torch_attr(func, "softmax") and value.args:
            rest = self._chain(value.args[0], cur, stage, seen_add, line)
            if rest is None or stage != "scores" or _after_softmax(rest):
                return None
            if not _is_last_dim(value.args, value.keywords, 1):
                raise _Skip(f"line {line}: softmax is not over the last dim")
            dtype = next((k.value for k in value.keywords if k.arg == "dtype"), None)
            return rest + [("softmax", dtype)]
        # dropout as a function: F.dropout(x, p, training)
        if _is_torch_attr(func, "dropout") and value.args:
            rest = self._chain(value.args[0], cur, stage, seen_add, line)
            if rest is None or not (stage == "probs" or _after_softmax(rest)):
                return None
            p = next((k.value for k in value.keywords if k.arg == "p"), value.args[1] if len(value.args) > 1 else _const(0.5))
            training = next((k.value for k in value.keywords if k.arg == "training"), value.args[2] if len(value.args) > 2 else _const(True))
            return rest + [("dropout", ast.IfExp(test=training, body=p, orelse=_const(0.0)))]
        # a module attribute called on the weights: nn.Dropout (verified on the instance at apply time)
        attr = rewrite.self_attribute(func, self.self_name)
        if attr is not None and len(value.args) == 1 and not value.keywords:
            rest = self._chain(value.args[0], cur, stage, seen_add, line)
            if rest is None or not (stage == "probs" or _after_softmax(rest)):
                return None
            return rest + [("dropout_module", func)]
        # methods on the current value: x.masked_fill / .softmax / .float / .to / .type_as
        if isinstance(func, ast.Attribute):
            rest = self._chain(func.value, cur, stage, seen_add, line)
            if rest is None:
                return None
            method, args, kw = func.attr, value.args, value.keywords
            if stage == "scores" and not _after_softmax(rest):
                if method == "masked_fill" and len(args) + len(kw) == 2:
                    mask = args[0] if args else next(k.value for k in kw if k.arg == "mask")
                    fill = args[1] if len(args) > 1 else next(k.value for k in kw if k.arg == "value")
                    if cur in names(mask):
                        return None
                    if not _is_neg_inf(fill):
                        raise _Skip(f"line {line}: masked_fill value `{_src(fill)}` is not -inf (a fully masked row would differ)")
                    return rest + [("fill", mask)]
                if method == "float" and not args and not kw:
                    return rest + [("float", None)]
                if method == "softmax":
                    if not _is_last_dim(args, kw, 0):
                        raise _Skip(f"line {line}: softmax is not over the last dim")
                    dtype = next((k.value for k in kw if k.arg == "dtype"), None)
                    return rest + [("softmax", dtype)]
                return None
            if _after_softmax(rest) or stage == "probs":
                if method == "to" and len(args) == 1 and not kw:
                    return rest + [("to", args[0])]
                if method == "type_as" and len(args) == 1 and not kw:
                    return rest + [("type_as", args[0])]
            return None
        return None

    def _final_use(self, st: ast.stmt, cur: str) -> tuple[ast.expr, ast.expr, str | None] | None:
        """The ``weights @ v`` node inside ``st`` (outside nested scopes), if there is exactly one."""
        found = []
        for node in ast.walk(st):
            if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.ListComp, ast.GeneratorExp, ast.DictComp, ast.SetComp)):
                continue
            ops = _matmul_operands(node)
            if ops and isinstance(ops[0], ast.Name) and ops[0].id == cur and cur not in rewrite.names_loaded(ops[1]):
                found.append((node, ops[1], None))
                continue
            es = _einsum(node)
            if es and isinstance(es[1], ast.Name) and es[1].id == cur and _canonical_output_eq(es[0]):
                found.append((node, es[2], es[0]))
        return found[0] if len(found) == 1 else None

    # liveness ---------------------------------------------------------------------------------------
    def _check_liveness(self, site: _Site, in_loop: ast.AST | None) -> None:
        """Every other read of the pattern's names must be harmless, or an escape we can serve."""
        pattern_nodes: set[int] = set()
        for st, inner, _ in site.steps:
            for n in ast.walk(inner or st):
                pattern_nodes.add(id(n))
        final_operand = site.final_node.left if isinstance(site.final_node, ast.BinOp) else (
            site.final_node.args[1] if site.final_eq else site.final_node.args[0])
        pattern_nodes.add(id(final_operand))
        first, last = site.line, site.final_stmt.lineno
        final_end = getattr(site.final_stmt, "end_lineno", last)
        loop_nodes = {id(n) for n in ast.walk(in_loop)} if in_loop is not None else set()
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in site.names):
                continue
            if id(node) in pattern_nodes:
                continue
            line = node.lineno
            if line < first:
                if id(node) in loop_nodes:
                    raise _Skip(f"line {line}: `{node.id}` is read in the loop before the attention assigns it")
                continue
            if line <= final_end and not (line >= last and self._inside(site.final_stmt, node)):
                raise _Skip(f"line {line}: `{node.id}` is read between the attention's steps")
            if node.id != site.probs_name or node.id in site.scores_names - {site.probs_name}:
                raise _Skip(f"line {line}: the pre-softmax scores `{node.id}` are read after the attention")
            site.escapes.append(node)

    @staticmethod
    def _inside(stmt: ast.stmt, node: ast.AST) -> bool:
        return any(n is node for n in ast.walk(stmt))


# -- apply-time decisions ---------------------------------------------------------------------------


def _resolve(module: nn.Module, node: ast.expr, self_name: str) -> Any:
    """The value of ``self.a.b`` on the instance (or a constant); raises _Skip otherwise."""
    if isinstance(node, ast.Constant):
        return node.value
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == self_name:
        value: Any = module
        for attr in reversed(parts):
            value = getattr(value, attr)
        return value
    raise _Skip(f"`{_src(node)}` is not an attribute of the module")


def _causal_buffer(module: nn.Module, mask: ast.expr, self_name: str) -> bool:
    """Is ``mask`` a causal buffer of the module, sliced to a top-left square (values checked)?"""
    expect_lower = True
    node = mask
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq) \
            and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value in (0, False):
        node = node.left
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Invert, ast.Not)):
        node = node.operand
    elif isinstance(node, ast.Call) and _is_torch_attr(node.func, "logical_not") and len(node.args) == 1:
        node = node.args[0]
    else:
        expect_lower = False  # the mask itself marks what is hidden: a strict upper triangle
    if not isinstance(node, ast.Subscript):
        return False
    attr = rewrite.self_attribute(node.value, self_name)
    if attr is None:
        return False
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if len(elts) < 2 or not all(isinstance(e, ast.Slice) and e.step is None and e.lower is None for e in elts):
        return False
    *lead, row, col = elts
    if any(e.upper is not None for e in lead) or row.upper is None or col.upper is None \
            or ast.dump(row.upper) != ast.dump(col.upper):
        return False
    buf = getattr(module, attr, None)
    if not isinstance(buf, torch.Tensor) or buf.dim() < 2 or buf.shape[-1] != buf.shape[-2] \
            or any(s != 1 for s in buf.shape[:-2]) or len(lead) != buf.dim() - 2:
        return False
    nonzero = buf.reshape(buf.shape[-2], buf.shape[-1]) != 0
    ones = torch.ones_like(nonzero)
    expected = ones.tril() if expect_lower else ones.triu(1)
    return bool(torch.equal(nonzero.cpu(), expected.cpu()))


def _zero_dropout(module: nn.Module, site: _Site, self_name: str) -> bool:
    """Is every dropout of the site provably zero on this instance (so weights read later are exact)?"""
    for kind, expr in site.dropout:
        try:
            if kind == "dropout_module":
                mod = _resolve(module, expr, self_name)
                if not isinstance(mod, nn.Dropout) or mod.p != 0:
                    return False
            else:
                p = _resolve(module, expr.body, self_name)
                if not isinstance(p, (int, float)) or p != 0:
                    return False
        except (_Skip, AttributeError):
            return False
    return True


def _check_dropout_modules(module: nn.Module, site: _Site, self_name: str) -> None:
    for kind, expr in site.dropout:
        if kind == "dropout_module":
            try:
                mod = _resolve(module, expr, self_name)
            except AttributeError:
                raise _Skip(f"`{_src(expr)}` does not exist on the module") from None
            if type(mod) is not nn.Dropout:
                raise _Skip(f"`{_src(expr)}` is applied to the attention weights but is a {type(mod).__name__}, not nn.Dropout")


# -- emission ---------------------------------------------------------------------------------------


class _Emitter:
    """Rewrites the sites of one (copied) forward for one instance's decisions."""

    def __init__(self, tree: ast.FunctionDef, exact_float_masks: bool = False) -> None:
        self.tree = tree
        self.exact_float_masks = exact_float_masks

    def emit(self, sites: list[tuple[_Site, bool]]) -> None:
        replacements: dict[int, list[ast.stmt]] = {}
        inner_replacements: dict[int, ast.stmt] = {}
        expr_replacements: dict[int, ast.expr] = {}
        before: dict[int, list[ast.stmt]] = {}
        for n, (site, causal) in enumerate(sites):
            var = f"__sk_attention_{n}"
            head = site.head
            head_tuple = _tuple(_const(head[0]), *head[1:3]) if head[0] == "mm" else _tuple(_const("einsum"), _const(head[1]), head[2], head[3])
            if getattr(site, "inline", False):
                elts = [e for e in (self._op_tuple(k, x, causal) for k, x in site.steps[0][2]) if e is not None]
                pattern = ast.List(elts=[head_tuple, *elts], ctx=ast.Load())
                expr_replacements[id(site.final_node)] = ast.copy_location(self._call(pattern, site, causal), site.final_node)
                continue
            for idx, (st, inner, ops) in enumerate(site.steps):
                elts = [self._op_tuple(k, e, causal) for k, e in ops]
                elts = [e for e in elts if e is not None]
                if idx == 0:
                    stmt: ast.stmt = ast.Assign(targets=[_name(var, store=True)], value=ast.List(elts=[head_tuple, *elts], ctx=ast.Load()))
                elif elts:
                    stmt = ast.Expr(value=ast.Call(func=ast.Attribute(value=_name(var), attr="extend", ctx=ast.Load()),
                                                  args=[ast.List(elts=elts, ctx=ast.Load())], keywords=[]))
                else:
                    stmt = ast.Pass()
                ast.copy_location(stmt, inner or st)
                if inner is not None:
                    inner_replacements[id(inner)] = stmt
                else:
                    replacements[id(st)] = [stmt]
            expr_replacements[id(site.final_node)] = ast.copy_location(self._call(_name(var), site, causal), site.final_node)
            for esc in site.escapes:
                expr_replacements[id(esc)] = ast.copy_location(call_ops("materialize", _name(esc.id)), esc)
            if site.escapes:
                deferred = ast.Assign(targets=[_name(site.probs_name, store=True)], value=call_ops("Deferred", _name(var)))
                before.setdefault(id(site.final_stmt), []).append(ast.copy_location(deferred, site.final_stmt))
        self._apply(self.tree, replacements, inner_replacements, expr_replacements, before)
        ast.fix_missing_locations(self.tree)

    def _call(self, pattern: ast.expr, site: _Site, causal: bool) -> ast.Call:
        return call_ops("attention", pattern, site.final_v,
                        **{k: v for k, v in (("final_eq", _const(site.final_eq) if site.final_eq else None),
                                             ("is_causal", _const(True) if causal else None),
                                             ("exact_float_masks", _const(True) if self.exact_float_masks else None))
                           if v is not None})

    @staticmethod
    def _op_tuple(kind: str, expr: Any, causal: bool) -> ast.Tuple | None:
        if kind == "fill" and causal:
            return None  # the causal buffer is the whole mask: SDPA's is_causal replaces it
        if kind == "float":
            return _tuple(_const("float"))
        if kind == "softmax":
            return _tuple(_const("softmax"), expr if expr is not None else _const(None))
        return _tuple(_const(kind), expr)

    def _apply(self, tree: ast.AST, stmts: dict, inner: dict, exprs: dict, before: dict) -> None:
        class T(ast.NodeTransformer):
            def generic_visit(self, node):  # noqa: N802 - ast API
                for name, value in ast.iter_fields(node):
                    if isinstance(value, list):
                        new = []
                        for item in value:
                            if isinstance(item, ast.stmt):
                                new.extend(before.get(id(item), []))
                                if id(item) in inner:
                                    new.append(inner[id(item)])
                                    continue
                                if id(item) in stmts:
                                    new.extend(stmts[id(item)])
                                    continue
                            if isinstance(item, ast.AST):
                                if id(item) in exprs:
                                    new.append(self.visit_replacement(item))
                                    continue
                                item = self.visit(item)
                            new.append(item)
                        setattr(node, name, new)
                    elif isinstance(value, ast.AST):
                        if id(value) in exprs:
                            setattr(node, name, self.visit_replacement(value))
                        else:
                            setattr(node, name, self.visit(value))
                return node

            def visit_replacement(self, node):
                rep = exprs[id(node)]
                # the replacement's own arguments may contain further replacements (e.g. escapes)
                return self.generic_visit(rep) if rep is not node else rep

        T().visit(tree)


# -- the rung ---------------------------------------------------------------------------------------


@dataclass
class SdpaOptions:
    """Options of the sdpa rung."""

    #: "fused": additive float masks go to SDPA's fused kernels (fast). A query row whose every key
    #: is masked by a huge finite negative (left padding under a causal mask) then differs from the
    #: hand-written code: its gradient on CPU, its output too on CUDA — as with Hugging Face's own
    #: SDPA attention; everywhere else, and for any loss that ignores padded positions, the
    #: function is the same. "exact": such attention runs on SDPA's math backend, the hand-written
    #: function everywhere, without the speed-up. Causal and boolean masks are always fused.
    float_masks: Literal["fused", "exact"] = "fused"
    #: flip the model libraries' own switches (Hugging Face attn_implementation, timm fused_attn)
    libraries: bool = True
    #: the Hugging Face attention implementation switched to ("flash_attention_2" needs flash-attn)
    hf_implementation: Literal["sdpa", "flash_attention_2", "flex_attention"] = "sdpa"


@dataclass
class _ClassAnalysis:
    parsed: ParsedForward | None
    sites: list[_Site]
    left_alone: list[str]
    error: str | None = None


class SdpaRung(Rung):
    name = "sdpa"
    judged_at_full_precision = True
    Options = SdpaOptions

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._cache: dict[ParsedForward, _ClassAnalysis] = {}

    def _analyze_module(self, module: nn.Module) -> _ClassAnalysis:
        """The analysis of what this instance runs: its class's forward or an earlier rung's rewrite."""
        cls = type(module)
        try:
            parsed = rewrite.parse_module_forward(module)
        except NotRewritable as exc:
            return _ClassAnalysis(None, [], [], str(exc))
        if parsed not in self._cache:
            tree = rewrite.copy_tree(parsed)
            analyzer = _Analyzer(tree, parsed.self_name)
            analyzer.run()
            notes = [f"{cls.__name__} ({rewrite.where(parsed, ast.Pass(lineno=line))}): {why}" for line, why in analyzer.left_alone]
            result = _ClassAnalysis(parsed, analyzer.sites, notes)
            result.tree = tree  # type: ignore[attr-defined]
            self._cache[parsed] = result
        return self._cache[parsed]

    def plan(self, model: nn.Module, switched: SwitchPlan | None = None,
             ) -> tuple[list[tuple[nn.Module, _ClassAnalysis, list[tuple[_Site, bool]]]], list[str]]:
        """Which instances get which sites (with their causal decision), and what is left alone;
        modules a library switch moves to SDPA (``switched``) are not rewritten."""
        planned, left_alone = [], []
        seen_notes: set[str] = set()
        skip = {id(m) for m in [*switched.timm, *switched.timm_fused]} if switched is not None else set()
        for module in model.modules():
            if not rewrite.is_user_module(module) or id(module) in skip:
                continue
            analysis = self._analyze_module(module)
            for note in analysis.left_alone:
                if note not in seen_notes:
                    seen_notes.add(note)
                    left_alone.append(note)
            if not analysis.sites:
                continue
            decisions = []
            self_name = analysis.parsed.self_name
            for site in analysis.sites:
                try:
                    _check_dropout_modules(module, site, self_name)
                    if site.escapes and not _zero_dropout(module, site, self_name):
                        raise _Skip(f"line {site.line}: the attention weights are read after `@ v` (returned or stored) "
                                    "while attention dropout may be on: they could not match")
                    causal = site.causal_mask is not None and _causal_buffer(module, site.causal_mask, self_name)
                    decisions.append((site, causal))
                except _Skip as skip:
                    note = f"{type(module).__name__} ({rewrite.where(analysis.parsed, site.final_stmt)}): {skip}"
                    if note not in seen_notes:
                        seen_notes.add(note)
                        left_alone.append(note)
            if decisions:
                planned.append((module, analysis, decisions))
        return planned, left_alone

    def _switches(self, model: nn.Module) -> SwitchPlan:
        return plan_switches(model, self.options.hf_implementation) if self.options.libraries else SwitchPlan()

    def check(self, state: TrainState) -> str | None:
        switches = self._switches(state.model)
        planned, left_alone = self.plan(state.model, switches)
        if planned or switches:
            return None
        if left_alone:
            return "hand-written attention found but none could be rewritten exactly: " + "; ".join(left_alone[:3])
        return ("no hand-written attention (q @ kᵀ → softmax → @ v) found in the model's forward methods"
                + "".join(f"; {note}" for note in switches.left_alone))

    def apply(self, state: TrainState) -> Handle:
        handle = Handle(self.name)
        switches = self._switches(state.model)
        apply_switches(handle, switches, self.options.hf_implementation)
        # a kernel draws attention dropout from its own random stream: parity is judged with dropout off
        handle.draws_differently = bool(switches)
        planned, left_alone = self.plan(state.model, switches)
        switched = list(handle.changes)
        compiled: dict[tuple, Any] = {}
        per_class: dict[str, list[int]] = {}
        for module, analysis, decisions in planned:
            key = (analysis.parsed, tuple((id(site), causal) for site, causal in decisions))
            if key not in compiled:
                import copy

                tree = copy.deepcopy(analysis.tree)  # type: ignore[attr-defined]
                # map the sites onto the copy: same positions, walked in the same order
                originals = list(ast.walk(analysis.tree))  # type: ignore[attr-defined]
                copies = list(ast.walk(tree))
                mapping = {id(a): b for a, b in zip(originals, copies)}
                emitter = _Emitter(tree, exact_float_masks=self.options.float_masks == "exact")
                emitter.emit([(_remap(site, mapping), causal) for site, causal in decisions])
                compiled[key] = rewrite.compile_forward(analysis.parsed, tree, "sdpa")
            causal_n = sum(c for _, c in decisions)
            rewrite.bind_forward(handle, module, compiled[key],
                                 f"{type(module).__name__}.forward: {len(decisions)} attention site(s) -> "
                                 f"scaled_dot_product_attention" + (f" (is_causal=True: {causal_n})" if causal_n else ""))
            stats = per_class.setdefault(type(module).__name__, [0, 0])
            stats[0] += len(decisions)
            stats[1] += causal_n
        sites = sum(s for s, _ in per_class.values())
        summary = ", ".join(f"{name} x{s}" + (f" ({c} causal)" if c else "") for name, (s, c) in per_class.items())
        # the per-instance lines say the same thing many times over: keep one summary line
        handle.changes = switched + ([f"sdpa: rewrote {sites} attention site(s) in {len(planned)} module(s): {summary}"] if planned else [])
        handle.changes += [f"left alone: {note}" for note in [*switches.left_alone, *left_alone]]
        handle.sites = {"rewritten": sites, "modules": len(planned), "left_alone": left_alone}  # type: ignore[attr-defined]
        return handle


def _remap(site: _Site, m: dict[int, Any]) -> _Site:
    """The same site, pointing at the nodes of a deep copy of its tree."""
    new = _Site(
        block=site.block, start=site.start, final_stmt=m[id(site.final_stmt)], final_node=m[id(site.final_node)],
        final_v=m[id(site.final_v)], final_eq=site.final_eq,
        head=tuple(m[id(x)] if isinstance(x, ast.AST) else x for x in site.head),
        steps=[(m[id(st)] if st is not None else None, m[id(inner)] if inner is not None else None,
                [(k, m[id(e)] if isinstance(e, ast.AST) and id(e) in m else e) for k, e in ops]) for st, inner, ops in site.steps],
        names=site.names, scores_names=site.scores_names, probs_name=site.probs_name, causal_mask=site.causal_mask,
        dropout=site.dropout, escapes=[m[id(e)] for e in site.escapes], line=site.line)
    if getattr(site, "inline", False):
        new.inline = True  # type: ignore[attr-defined]
    return new


__all__ = ["SdpaRung"]
