"""sdpa's matcher: hand-written attention (``softmax(q @ kᵀ * scale + mask) @ v``) found in a method's
source, step by step, each where the user's statement stood (see :mod:`speedkit.rungs.sdpa`).

A site records the statements of the pattern (the scores, scale, masks, softmax, dropout) and the
final ``@ v``; what this instance decides and how the emitter rewrites it are in
:mod:`speedkit.rewrite.attention_emit`. Near misses are kept as ``(line, reason)`` notes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from speedkit.rewrite.ast_tools import child_blocks, const, names_loaded, names_stored, self_attribute
from speedkit.rewrite.pipeline import Found
from speedkit.rewrite.source import ParsedMethod

_NEG_INF_SOURCES = {
    "float('-inf')",
    '-float("inf")',
    "-float('inf')",
    "-math.inf",
    "-torch.inf",
    "-np.inf",
    "-numpy.inf",
    "float('-Inf')",
    "-float('Inf')",
}


class Skip(Exception):
    """This candidate is not rewritten; the message says why."""


class _Unrecognized(Skip):
    """A statement uses the candidate's values in a way that is not an attention step."""


def new_name(st: ast.stmt) -> str:
    """The single name a statement binds, or ''."""
    if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
        return st.targets[0].id
    return ""


# -- small AST predicates ---------------------------------------------------------------------------


def src(node: ast.AST) -> str:
    return ast.unparse(node)


def is_torch_attr(node: ast.AST, *names: str) -> bool:
    """``torch.<name>`` / ``torch.nn.functional.<name>`` / ``F.<name>`` / ``nn.functional.<name>``."""
    if not isinstance(node, ast.Attribute) or node.attr not in names:
        return False
    owner = src(node.value)
    return owner in ("torch", "F", "nn.functional", "torch.nn.functional", "functional")


def _matmul_operands(node: ast.AST) -> tuple[ast.expr, ast.expr] | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    if isinstance(node, ast.Call) and is_torch_attr(node.func, "matmul", "bmm") and len(node.args) == 2 and not node.keywords:
        return node.args[0], node.args[1]
    return None


def _einsum(node: ast.AST) -> tuple[str, ast.expr, ast.expr] | None:
    if (
        isinstance(node, ast.Call)
        and is_torch_attr(node.func, "einsum")
        and len(node.args) == 3
        and not node.keywords
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
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
    return src(node).replace('"', "'") in {s.replace('"', "'") for s in _NEG_INF_SOURCES}


def _is_last_dim(args: list[ast.expr], keywords: list[ast.keyword], pos: int) -> bool:
    dim = next((k.value for k in keywords if k.arg == "dim"), args[pos] if len(args) > pos else None)
    return dim is not None and src(dim) == "-1"


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


# -- one attention site ---------------------------------------------------------------------------


@dataclass
class Site:
    """A matched attention pattern inside one statement block of a forward."""

    block: list[ast.stmt]
    start: int  # index in block of the scores statement
    final_stmt: ast.stmt  # the statement holding the final `@ v`
    final_node: ast.expr  # the `@ v` expression inside it
    final_v: ast.expr
    final_eq: str | None
    head: tuple  # ("mm", q, kT) | ("einsum", eq, q, k)
    steps: list[tuple[ast.stmt, ast.stmt | None, list[tuple[str, Any]]]] = field(default_factory=list)
    #   (statement in block, pattern statement inside it if it is an If (else None), ops it contributes)
    names: set[str] = field(default_factory=set)
    scores_names: set[str] = field(default_factory=set)  # names that held pre-softmax scores
    probs_name: str = ""
    causal_mask: ast.expr | None = None  # the mask M of the only fill, when a candidate
    dropout: list[tuple[str, ast.expr]] = field(default_factory=list)
    escapes: list[ast.Name] = field(default_factory=list)
    line: int = 0
    inline: bool = False  # written as one expression: `softmax(q @ kT) @ v`


def _parse_scores(expr: ast.expr) -> tuple[tuple, list[tuple[str, ast.expr]]]:
    """The head of the pattern and any scale applied inline: ``(q @ kT) * c``, ``c * (q @ kT)``, ``/ c``."""
    ops = _matmul_operands(expr)
    if ops:
        return ("mm", ops[0], ops[1]), []
    es = _einsum(expr)
    if es:
        if not _canonical_scores_eq(es[0]):
            raise Skip(f"einsum {es[0]!r} is not in the (..., L, E) x (..., S, E) layout SDPA takes")
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
        self.sites: list[Site] = []
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
                except Skip as skip:
                    self.left_alone.append((stmt.lineno, str(skip)))
                    site = None
            if site is not None:
                try:
                    self._check_liveness(site, in_loop)
                    self.sites.append(site)
                except Skip as skip:
                    self.left_alone.append((stmt.lineno, str(skip)))
            self._find_inline(stmt)
            for child in child_blocks(stmt):
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
            except Skip as skip:
                self.left_alone.append((node.lineno, str(skip)))
                continue
            if not chain or chain[0][0] != "head" or not _after_softmax(chain[1:]):
                continue
            site = Site([], 0, stmt, node, ops[1], final_eq, chain[0][1], line=node.lineno, inline=True)
            site.steps = [(None, None, chain[1:])]  # type: ignore[list-item]
            site.dropout = [(k, e) for k, e in chain[1:] if k in ("dropout", "dropout_module")]
            fills = [e for k, e in chain[1:] if k == "fill"]
            site.causal_mask = fills[0] if len(fills) == 1 and not any(k == "add" for k, _ in chain[1:]) else None
            self.sites.append(site)

    # one candidate --------------------------------------------------------------------------------
    def _match(self, block: list[ast.stmt], i: int) -> Site | None:
        stmt = block[i]
        first = self._chain(stmt.value, None, "scores", False, stmt.lineno)
        if not first or first[0][0] != "head":
            raise _NoScores  # no q @ kT at the root of this statement
        head, first_ops = first[0][1], first[1:]
        current = stmt.targets[0].id
        site = Site(block, i, stmt, stmt, stmt.value, None, head, line=stmt.lineno)
        site.names = {current}
        site.scores_names = set() if _after_softmax(first_ops) else {current}
        site.steps.append((stmt, None, first_ops))
        stage = "probs" if _after_softmax(first_ops) else "scores"
        seen_add = any(k == "add" for k, _ in first_ops)
        fills: list[tuple[ast.expr, bool]] = [(e, False) for k, e in first_ops if k == "fill"]
        site.dropout += [(k, e) for k, e in first_ops if k in ("dropout", "dropout_module")]
        for j in range(i + 1, len(block)):
            st = block[j]
            touched = names_loaded(st) | names_stored(st)
            if not (touched & site.names):
                continue
            if isinstance(st, ast.If) and stage == "scores" and not st.orelse:
                inner = [s for s in st.body if (names_loaded(s) | names_stored(s)) & site.names]
                if len(inner) != 1 or (names_loaded(st.test) & site.names):
                    raise Skip(f"line {st.lineno}: the scores are used in a conditional block in a way that is not a mask")
                ops, new = self._step(inner[0], current, stage, seen_add)
                if new != current or not all(k in ("fill", "add") for k, _ in ops):
                    raise Skip(f"line {st.lineno}: only a mask may be applied conditionally to the scores")
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
            raise Skip(f"softmax of q @ kT at line {stmt.lineno} is never multiplied by v in the same block")
        raise _NoScores  # a matmul that never reached a softmax: not attention

    def _step(self, st: ast.stmt, cur: str, stage: str, seen_add: bool) -> tuple[list[tuple[str, Any]], str]:
        """The ops one statement applies to the pattern's current value, and the name it binds."""
        what = "scores" if stage == "scores" else "weights"
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
            raise _Unrecognized(f"line {st.lineno}: the attention {what} are used by a statement that is not part of attention")
        target, value = st.targets[0].id, st.value
        ops = self._chain(value, cur, stage, seen_add, st.lineno)
        if ops is None:
            raise _Unrecognized(f"line {st.lineno}: `{src(value)[:80]}` uses the attention {what} in a way SDPA cannot express")
        return ops, target

    @staticmethod
    def _softmax_follows(block: list[ast.stmt], j: int, names: set[str]) -> bool:
        for st in block[j:]:
            for node in ast.walk(st):
                if isinstance(node, ast.Call) and (
                    (is_torch_attr(node.func, "softmax") and node.args and names_loaded(node.args[0]) & names)
                    or (
                        isinstance(node.func, ast.Attribute)
                        and node.func.attr == "softmax"
                        and names_loaded(node.func.value) & names
                    )
                ):
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
        names = lambda n: names_loaded(n) if cur is not None else set()  # noqa: E731
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
                    raise Skip(f"line {line}: the scores are scaled after an additive mask")
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
        if is_torch_attr(func, "softmax") and value.args:
            rest = self._chain(value.args[0], cur, stage, seen_add, line)
            if rest is None or stage != "scores" or _after_softmax(rest):
                return None
            if not _is_last_dim(value.args, value.keywords, 1):
                raise Skip(f"line {line}: softmax is not over the last dim")
            dtype = next((k.value for k in value.keywords if k.arg == "dtype"), None)
            return rest + [("softmax", dtype)]
        # dropout as a function: F.dropout(x, p, training)
        if is_torch_attr(func, "dropout") and value.args:
            rest = self._chain(value.args[0], cur, stage, seen_add, line)
            if rest is None or not (stage == "probs" or _after_softmax(rest)):
                return None
            p = next((k.value for k in value.keywords if k.arg == "p"), value.args[1] if len(value.args) > 1 else const(0.5))
            training = next(
                (k.value for k in value.keywords if k.arg == "training"), value.args[2] if len(value.args) > 2 else const(True)
            )
            return rest + [("dropout", ast.IfExp(test=training, body=p, orelse=const(0.0)))]
        # a module attribute called on the weights: nn.Dropout (verified on the instance at apply time)
        attr = self_attribute(func, self.self_name)
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
                        raise Skip(f"line {line}: masked_fill value `{src(fill)}` is not -inf (a fully masked row would differ)")
                    return rest + [("fill", mask)]
                if method == "float" and not args and not kw:
                    return rest + [("float", None)]
                if method == "softmax":
                    if not _is_last_dim(args, kw, 0):
                        raise Skip(f"line {line}: softmax is not over the last dim")
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
            if ops and isinstance(ops[0], ast.Name) and ops[0].id == cur and cur not in names_loaded(ops[1]):
                found.append((node, ops[1], None))
                continue
            es = _einsum(node)
            if es and isinstance(es[1], ast.Name) and es[1].id == cur and _canonical_output_eq(es[0]):
                found.append((node, es[2], es[0]))
        return found[0] if len(found) == 1 else None

    # liveness ---------------------------------------------------------------------------------------
    def _check_liveness(self, site: Site, in_loop: ast.AST | None) -> None:
        """Every other read of the pattern's names must be harmless, or an escape we can serve."""
        pattern_nodes: set[int] = set()
        for st, inner, _ in site.steps:
            for n in ast.walk(inner or st):
                pattern_nodes.add(id(n))
        final_operand = (
            site.final_node.left
            if isinstance(site.final_node, ast.BinOp)
            else (site.final_node.args[1] if site.final_eq else site.final_node.args[0])
        )
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
                    raise Skip(f"line {line}: `{node.id}` is read in the loop before the attention assigns it")
                continue
            if line <= final_end and not (line >= last and self._inside(site.final_stmt, node)):
                raise Skip(f"line {line}: `{node.id}` is read between the attention's steps")
            if node.id != site.probs_name or node.id in site.scores_names - {site.probs_name}:
                raise Skip(f"line {line}: the pre-softmax scores `{node.id}` are read after the attention")
            site.escapes.append(node)

    @staticmethod
    def _inside(stmt: ast.stmt, node: ast.AST) -> bool:
        return any(n is node for n in ast.walk(stmt))


def analyze(tree: ast.FunctionDef, self_name: str) -> _Analyzer:
    """The attention sites of ``tree`` (nodes of ``tree``), and its near misses."""
    analyzer = _Analyzer(tree, self_name)
    analyzer.run()
    return analyzer


def find(parsed: ParsedMethod) -> Found:
    """Attention sites in ``parsed``; the notes are ``(line, reason)`` near misses."""
    analyzer = analyze(parsed.tree, parsed.self_name)
    return Found(analyzer.sites, analyzer.left_alone)
